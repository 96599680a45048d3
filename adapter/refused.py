"""The adapter's refusals as the converter's error values.

Each exception class the adapter raises for a user (`PrebuildError`, `SplitError`, ...) stays
where code catches it by type (SGLang's processes, the CLI, tests), and is built from a
`Fatal`: its words come from the reasons' records (adapter/reasons/), `.codes`
and `.reason` are their codes, `.exit_code` the records' exit code. A raise site passes a
code and facts (`X(fatal(AdapterCode.Y, ...))`), never text.
"""

from __future__ import annotations

from ..converter.errors import Fatal


def words(error: Fatal) -> str:
    """One line per cause, each with its code, then the hint: how every adapter refusal
    reads (the same lines `serve` prints)."""
    lines = [f"[{p.code.value}] {p.render()}" for p in error.roots]
    text = lines[0] if len(lines) == 1 else "\n".join(f"  - {line}" for line in lines)
    return text + (f"\nhint: {error.hint}" if error.hint else "")


class Refused(Exception):
    """Base of the adapter's refusals: an exception carrying a `Fatal`. Subclasses add the
    built-in base their callers catch (RuntimeError, ValueError)."""

    def __init__(self, error: Fatal, text: str | None = None) -> None:
        # `text`: a rendering of the same problems in another layout (a load refusal names
        # its checkpoint first), never words of its own.
        super().__init__(text if text is not None else words(error))
        self.error = error

    @property
    def codes(self) -> tuple[str, ...]:
        """Every problem's code, one per problem (as `Fatal.codes`)."""
        return tuple(p.code.value for p in self.error.problems)

    @property
    def reason(self) -> str:
        """The first cause's code: stable for tests and tools."""
        return self.error.roots[0].code.value

    @property
    def exit_code(self) -> int:
        return self.error.exit_code
