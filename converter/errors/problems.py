"""Problems are values: every check returns them, the CLI renders them.

A `Problem` says why (a stable code: a member of the converter's `Code` or the adapter's
`AdapterCode`), where (file, tensor), what is wrong, and expected
vs found, so a user can act on it without reading a traceback and a script or a test can
act on the reason without matching message text. `Fatal` carries one or more of them out
of deep code to the command line, which prints their causes (what a reason's record says
`implies` is counted, not repeated) and exits with the code their reasons' records
give: raise sites never choose an exit code.

A call site names the code and passes the facts, `problem(Code.HEADER_TOO_LARGE, file=name,
length=n)`, and never writes message text: the words are the reason's record. Where one code
covers several situations, a `rule` fact picks the situation's message.
"""

from __future__ import annotations

import string
from collections.abc import Iterable
from dataclasses import dataclass, field
from enum import Enum

from .reason import EXIT_OK, EXIT_PROBLEMS, Message
from .registry import reason

# A member of a package's code enum (`converter.reasons.Code`, `adapter.reasons.AdapterCode`).
ReasonCode = Enum


@dataclass(frozen=True)
class Problem:
    code: ReasonCode
    what: str
    file: str | None = None
    tensor: str | None = None
    expected: str | None = None
    found: str | None = None

    def render(self) -> str:
        where = ", ".join(p for p in (self.file, self.tensor and f"tensor {self.tensor}") if p)
        text = f"{where}: {self.what}" if where else self.what
        # Only what is known: a check that knows what it found but not what it expected
        # (or the reverse) says so, never "expected None".
        facts = [
            f"{label} {value}"
            for label, value in (("expected", self.expected), ("found", self.found))
            if value is not None
        ]
        return text + (f" ({', '.join(facts)})" if facts else "")

    def as_dict(self) -> dict[str, str]:
        fields = {k: v for k, v in self.__dict__.items() if v is not None}
        fields["code"] = self.code.value
        return fields


def message(code: ReasonCode, rule: str | None = None) -> Message:
    """The message of `code` (in the situation `rule`, where the code has several)."""
    return reason(code).message(rule)


def rules(code: ReasonCode) -> list[str | None]:
    """The situations `code` has messages for ([None]: one message)."""
    return reason(code).situations()


def template_names(template: str | None) -> set[str]:
    """The facts a template names ('{value!r}', '{size:.1f}', '{a.b}' -> value, size, a)."""
    if template is None:
        return set()
    return {
        name.split(".")[0].split("[")[0]
        for _, name, _, _ in string.Formatter().parse(template)
        if name
    }


def facts_of(code: ReasonCode, rule: str | None = None) -> frozenset[str]:
    """The facts a call site must pass for this message (beyond file/tensor)."""
    m = message(code, rule)
    names = set().union(*(template_names(t) for t in (m.what, m.expected, m.found, m.hint)))
    return frozenset(names - {"file", "tensor"})


class _Facts(dict):
    # A fact a call site failed to pass shows as its name rather than losing the problem
    # to a KeyError on the error path; tests/test_messages.py holds every call site to the
    # facts its message names.
    def __missing__(self, key: str) -> str:
        return "{" + key + "}"


def _render(template: str | None, facts: _Facts) -> str | None:
    return None if template is None else template.format_map(facts)


def _text(value: object) -> str | None:
    return None if value is None else str(value)


def problem(
    code: ReasonCode,
    *,
    rule: str | None = None,
    file: object = None,
    tensor: str | None = None,
    expected: object = None,
    found: object = None,
    **facts: object,
) -> Problem:
    """The Problem for `code` with these facts: its words come from the code's message.
    `expected`/`found` given here are facts of their own, for a message without templates
    for them."""
    m = message(code, rule)
    values = _Facts(facts, file=_text(file), tensor=tensor)
    values.update(expected=_text(expected), found=_text(found))
    return Problem(
        code,
        _render(m.what, values) or "",
        file=_text(file),
        tensor=tensor,
        expected=_render(m.expected, values) if m.expected is not None else _text(expected),
        found=_render(m.found, values) if m.found is not None else _text(found),
    )


def fatal(code: ReasonCode, *, hint: str | None = None, **facts: object) -> Fatal:
    """A single-problem error for `code` with these facts; its hint is the message's unless
    the call site has one only it can word (what a rerun would keep, say)."""
    p = problem(code, **facts)
    m = message(code, facts.get("rule"))  # type: ignore[arg-type]
    if hint is None and m.hint is not None:
        values = _Facts(facts, file=p.file, tensor=p.tensor)
        hint = m.hint.format_map(values)
    return Fatal([p], hint=hint)


def exit_code(codes: Iterable[ReasonCode]) -> int:
    """The exit code of a run that stopped for these reasons: a usage reason wins (the
    command line is wrong whatever else is)."""
    return max((reason(c).exit for c in codes), default=EXIT_OK)


def suppressed_codes(present: Iterable[ReasonCode]) -> set[ReasonCode]:
    """The reasons among `present` that follow from another reason also present (its
    record's `implies`)."""
    present = set(present)
    return {c for c in present if any(c.value in reason(r).implies for r in present - {c})}


def root_problems(problems: Iterable[Problem]) -> tuple[list[Problem], list[Problem]]:
    """The problems to report (the causes), and those that follow from them."""
    problems = list(problems)
    hidden = suppressed_codes(p.code for p in problems)
    return [p for p in problems if p.code not in hidden], [p for p in problems if p.code in hidden]


def count_codes(problems: Iterable[Problem]) -> dict[str, int]:
    """{code: how many}, in first-seen order: how a list of suppressed problems is shown."""
    counts: dict[str, int] = {}
    for p in problems:
        counts[p.code.value] = counts.get(p.code.value, 0) + 1
    return counts


@dataclass
class Fatal(Exception):
    """Raised with every problem found; the CLI prints their causes and exits with the exit
    code their reasons' records give."""

    problems: list[Problem] = field(default_factory=list)
    hint: str | None = None

    def __post_init__(self) -> None:
        super().__init__(self.summary())

    def __reduce__(self) -> tuple:
        # Pickled by its fields (a Ray worker raises it to the driver): an Exception's own
        # pickling would call Fatal(summary) and lose the problems.
        return (type(self), (self.problems, self.hint))

    @property
    def roots(self) -> list[Problem]:
        return root_problems(self.problems)[0]

    @property
    def suppressed(self) -> list[Problem]:
        return root_problems(self.problems)[1]

    @property
    def exit_code(self) -> int:
        return exit_code(p.code for p in self.roots) or EXIT_PROBLEMS

    def summary(self) -> str:
        roots = self.roots
        if len(roots) == 1:
            return roots[0].render()
        return f"{len(roots)} problems found"

    @property
    def codes(self) -> list[ReasonCode]:
        return [p.code for p in self.problems]
