"""A reason's record: its code, its exit code, its words and what follows from it, together.

Each reason is one `Reason` in the reasons of the package that refuses it (the converter's
`converter/reasons/`, the adapter's `adapter/reasons/`, grouped by area, as the safetensors
library keeps each error's message with its variant): adding a reason is adding its record,
and the package's code enum gains the member. A record is the only place a reason's words
and exit code are written; call sites pass facts, never text.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

EXIT_OK = 0
EXIT_PROBLEMS = 1  # the input is invalid or a check failed
EXIT_USAGE = 2  # the request cannot be carried out as asked: fix the command line
EXIT_INTERRUPTED = 130  # Ctrl-C; state kept, a rerun resumes
EXIT_TERMINATED = 143  # SIGTERM, handled as Ctrl-C
EXIT_BUG = 1  # an unexpected exception (a bug, or an OS error nobody turned into a Code)


@dataclass(frozen=True)
class Message:
    """Templates (`str.format` over named facts) for a problem's `what`, and for its
    `expected`/`found`/`hint` where the reason always words them the same way. A call site
    passes `expected`/`found` itself only where the message has no template for them."""

    what: str
    expected: str | None = None
    found: str | None = None
    hint: str | None = None


@dataclass(frozen=True, eq=False)
class Reason:
    """One reason a checkpoint, an output or a request is refused.

    `code` is its stable name in `--json` (never renamed). Its words are one message
    (`what`, `expected`, `found`, `hint`) or, where one reason covers several situations,
    `rules`: {rule: Message}, a call site's `rule` fact picking one. `exit`: EXIT_USAGE where
    what was asked (an option, a manifest name, an output path, a window) cannot be done as
    asked; EXIT_PROBLEMS (the default) where the data is wrong. `implies`: the codes that
    follow from this one when both are found (counted beside it, not repeated).
    """

    code: str
    what: str | None = None
    expected: str | None = None
    found: str | None = None
    hint: str | None = None
    rules: Mapping[str, Message] | None = field(default=None)
    exit: int = EXIT_PROBLEMS
    implies: frozenset[str] = frozenset()

    def __post_init__(self) -> None:
        plain = (self.what, self.expected, self.found, self.hint)
        if (self.rules is None) == (self.what is None) or (
            self.rules is not None and any(v is not None for v in plain)
        ):
            raise ValueError(f"{self.code}: one message or rules, not both or neither")
        if self.rules is not None and not self.rules:
            raise ValueError(f"{self.code}: empty rules")
        if self.exit not in (EXIT_PROBLEMS, EXIT_USAGE):
            raise ValueError(f"{self.code}: exit {self.exit} is neither usage nor problems")

    def message(self, rule: str | None = None) -> Message:
        """The message of this reason (in the situation `rule`, where it has several)."""
        if self.rules is None:
            if rule is not None:
                raise KeyError(f"{self.code} has one message: no rule {rule!r}")
            assert self.what is not None
            return Message(self.what, self.expected, self.found, self.hint)
        if rule not in self.rules:
            raise KeyError(f"{self.code}: rule {rule!r} is not one of {sorted(self.rules)}")
        return self.rules[rule]

    def situations(self) -> list[str | None]:
        """The rules this reason has messages for ([None]: one message)."""
        return [None] if self.rules is None else list(self.rules)
