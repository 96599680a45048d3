"""What `verify` found: one `Check` per thing proven, each with its problems (with codes).

A check is passed (`ok` True), failed (False) or skipped (None: there was nothing it could
look at, e.g. the file-list check of an output without a checksums file). The report passes
when no check failed. `as_dict` is the `--json` document: every problem carries its stable
`code`, so scripts and tests act on the reason, never on message text.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..errors import Code, Problem

# Problems kept per check: a badly damaged 334k-tensor output must not print a million lines.
MAX_PROBLEMS_KEPT = 1000

LEVELS = ("structure", "checksums", "source", "numerics")


@dataclass
class Check:
    name: str  # stable id, e.g. "index", "experts", "source-tensors"
    level: str  # one of LEVELS
    title: str  # what a person reads
    ok: bool | None  # None: skipped
    detail: str
    problems: list[Problem] = field(default_factory=list)
    problems_total: int = 0  # before the MAX_PROBLEMS_KEPT cut

    @property
    def codes(self) -> set[Code]:
        return {p.code for p in self.problems}

    def as_dict(self) -> dict:
        return {
            "name": self.name,
            "level": self.level,
            "title": self.title,
            "ok": self.ok,
            "detail": self.detail,
            "problems_total": self.problems_total,
            "problems": [p.as_dict() for p in self.problems],
        }


@dataclass
class VerifyReport:
    output: str
    levels: list[str] = field(default_factory=list)
    checks: list[Check] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return all(c.ok is not False for c in self.checks)

    @property
    def codes(self) -> set[Code]:
        """Every reason any check failed for."""
        return {p.code for c in self.checks for p in c.problems}

    @property
    def problems(self) -> list[Problem]:
        return [p for c in self.checks for p in c.problems]

    def check(self, name: str) -> Check | None:
        return next((c for c in self.checks if c.name == name), None)

    def add(self, name: str, level: str, title: str, problems: list[Problem], detail: str) -> Check:
        check = Check(
            name, level, title, not problems, detail, problems[:MAX_PROBLEMS_KEPT], len(problems)
        )
        self.checks.append(check)
        return check

    def skip(self, name: str, level: str, title: str, detail: str) -> Check:
        check = Check(name, level, title, None, detail)
        self.checks.append(check)
        return check

    def as_dict(self) -> dict:
        return {
            "output": self.output,
            "ok": self.ok,
            "levels": self.levels,
            "codes": sorted(c.value for c in self.codes),
            "checks": [c.as_dict() for c in self.checks],
        }
