"""What `verify` found: one `Check` per thing proven, each with its problems (with codes).

A check is passed (`ok` True), failed (False) or skipped (None: there was nothing it could
look at, e.g. the file-list check of an output without a checksums file). The report passes
when no check failed. `as_dict` is the `--json` document: every problem carries its stable
`code`, so scripts and tests act on the reason, never on message text.

One cause, one message: a problem whose reason follows from another reason the report
holds (its record's `implies`, across checks: an unconverted checkpoint lacks the block
*and* holds w1/w3) is counted, not listed; the check still fails.
"""

from __future__ import annotations

from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field

from ..errors import Problem, suppressed_codes
from ..errors import exit_code as exit_code_of
from ..reasons import Code
from ..text import repair_command

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
    code_counts: dict[Code, int] = field(default_factory=dict)  # every problem, before the cut

    @property
    def codes(self) -> set[Code]:
        return {p.code for p in self.problems}

    def roots(self, hidden: AbstractSet[Code]) -> list[Problem]:
        """The problems worth listing when the reasons in `hidden` follow from others."""
        return [p for p in self.problems if p.code not in hidden]

    def suppressed(self, hidden: AbstractSet[Code]) -> int:
        return sum(n for code, n in self.code_counts.items() if code in hidden)

    def as_dict(self, hidden: AbstractSet[Code] = frozenset()) -> dict:
        return {
            "name": self.name,
            "level": self.level,
            "title": self.title,
            "ok": self.ok,
            "detail": self.detail,
            "problems_total": self.problems_total,
            "suppressed": self.suppressed(hidden),
            "problems": [p.as_dict() for p in self.roots(hidden)],
        }


# Findings that mean the output's bytes are no longer what the conversion wrote: rerunning
# the conversion with --rehash re-reads every kept shard and rewrites what fails, so it
# repairs them (a plain rerun proves kept shards by size and header only and would not).
REPAIRED_BY_REHASH = frozenset(
    {
        Code.CHECKSUM_MISMATCH,
        Code.FILE_SIZE_MISMATCH,
        Code.HEADER_HASH_MISMATCH,
        Code.BYTES_DIFFER,
        Code.W31_NOT_UP_GATE,
        Code.FILE_TRUNCATED,
        Code.FILE_TRAILING_BYTES,
    }
)


@dataclass
class VerifyReport:
    output: str
    levels: list[str] = field(default_factory=list)
    checks: list[Check] = field(default_factory=list)
    # What became of the record a server checks (`verified.settle`): "recorded", "removed",
    # "not recorded: why", or "" (nothing to do).
    record: str = ""

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

    @property
    def hidden(self) -> set[Code]:
        """Reasons that follow from another reason in this report: counted, not listed."""
        return suppressed_codes(code for c in self.checks for code in c.code_counts)

    @property
    def root_codes(self) -> set[Code]:
        return self.codes - self.hidden

    @property
    def suppressed(self) -> int:
        hidden = self.hidden
        return sum(c.suppressed(hidden) for c in self.checks)

    @property
    def exit_code(self) -> int:
        """From the table, like every command's: 0 when every check passed."""
        return exit_code_of(self.root_codes) if not self.ok else 0

    @property
    def repair(self) -> str | None:
        """The command that repairs what failed, when a rerun can (None otherwise)."""
        if self.root_codes & REPAIRED_BY_REHASH:
            return repair_command(self.output)
        return None

    def check(self, name: str) -> Check | None:
        return next((c for c in self.checks if c.name == name), None)

    def add(self, name: str, level: str, title: str, problems: list[Problem], detail: str) -> Check:
        counts: dict[Code, int] = {}
        for p in problems:
            counts[p.code] = counts.get(p.code, 0) + 1
        check = Check(
            name,
            level,
            title,
            not problems,
            detail,
            problems[:MAX_PROBLEMS_KEPT],
            len(problems),
            counts,
        )
        self.checks.append(check)
        return check

    def skip(self, name: str, level: str, title: str, detail: str) -> Check:
        check = Check(name, level, title, None, detail)
        self.checks.append(check)
        return check

    def as_dict(self) -> dict:
        hidden = self.hidden
        return {
            "output": self.output,
            "ok": self.ok,
            "exit_code": self.exit_code,
            "levels": self.levels,
            "codes": sorted(c.value for c in self.root_codes),
            "suppressed": self.suppressed,
            "suppressed_codes": sorted(c.value for c in hidden),
            "checks": [c.as_dict(hidden) for c in self.checks],
            "record": self.record,
            "repair": self.repair,
        }
