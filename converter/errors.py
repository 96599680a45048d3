"""Problems are values: every check returns them, the CLI renders them.

A `Problem` says where (file, tensor), what is wrong, and expected vs found, so a user can
act on it without reading a traceback. `ConvertError` carries one or more of them out of
deep code to the CLI, which prints them all and exits 1.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Problem:
    what: str
    file: str | None = None
    tensor: str | None = None
    expected: str | None = None
    found: str | None = None

    def render(self) -> str:
        where = ", ".join(p for p in (self.file, self.tensor and f"tensor {self.tensor}") if p)
        text = f"{where}: {self.what}" if where else self.what
        if self.expected is not None or self.found is not None:
            text += f" (expected {self.expected}, found {self.found})"
        return text

    def as_dict(self) -> dict[str, str]:
        return {k: v for k, v in self.__dict__.items() if v is not None}


@dataclass
class ConvertError(Exception):
    """Raised with every problem found; the CLI prints them and exits with `exit_code`."""

    problems: list[Problem] = field(default_factory=list)
    exit_code: int = 1
    hint: str | None = None

    def __post_init__(self) -> None:
        super().__init__(self.summary())

    def summary(self) -> str:
        if len(self.problems) == 1:
            return self.problems[0].render()
        return f"{len(self.problems)} problems found"


def fail(what: str, **where: str | None) -> ConvertError:
    """Shorthand for a single-problem error."""
    return ConvertError([Problem(what, **where)])
