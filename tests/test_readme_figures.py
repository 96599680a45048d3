"""One figure per fact, from a run whose output is in the repository: every measured figure
the README's Performance section and its cold-start measurements give appears, as written,
in the report that measured it (`docs/benchmarks.md`, `docs/reliability.md`,
`docs/gpu-validation.md`). A figure changed on one side only fails here."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text(encoding="utf-8")
REPORTS = ("docs/benchmarks.md", "docs/reliability.md", "docs/gpu-validation.md")
UNIT = r"(?:x|%|s|MiB|GiB|GB|TB|MB/s|min)"
# a figure: a number (or a range of two) and its unit; dates and counts without a unit are
# not measurements
FIGURE = re.compile(rf"(?<![\w.])(\d[\d,]*(?:\.\d+)?(?:-\d[\d,]*(?:\.\d+)?)?)\s?({UNIT})(?![\w/])")


def _norm(text: str) -> str:
    return re.sub(r"[\s,*`]", "", text)


def _section(start: str, end: str) -> str:
    at = README.index(start)
    return README[at : README.index(end, at + len(start))]


def figures(text: str) -> list[str]:
    return [f"{number} {unit}" for number, unit in FIGURE.findall(text)]


def _held(figure: str) -> bool:
    """In a report as written; a ratio ('0.878 x') also as its bare number (the reports'
    ratio columns)."""
    number, unit = figure.split(" ")
    return _norm(figure) in DOCS or (unit == "x" and _norm(number) in DOCS)


SECTIONS = {
    "performance": _section("## Performance\n", "## Why\n"),
    "cold start": _section("Measured 2026-12-01 on fresh H200 machines", "\n\n"),
}
DOCS = _norm("\n".join((ROOT / r).read_text(encoding="utf-8") for r in REPORTS))


@pytest.mark.parametrize("name", sorted(SECTIONS))
def test_every_figure_is_in_the_report_that_measured_it(name):
    found = figures(SECTIONS[name])
    assert len(found) >= 8, found  # the sections do give figures
    missing = [f for f in found if not _held(f)]
    assert missing == [], f"README figures no report holds: {missing}"


def test_a_figure_changed_on_one_side_is_caught():
    """Negative control: the rule sees a figure no report holds."""
    text = SECTIONS["performance"].replace("7.33 s", "7.39 s")
    assert [f for f in figures(text) if not _held(f)] == ["7.39 s"]
