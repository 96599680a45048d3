"""A source shard truncated, rewritten or replaced while (or between) converting, or its
header rewritten (same size) after the plan was made."""

from __future__ import annotations

from pathlib import Path

import faultlib as fl


def test_source_changes_are_detected_and_never_reused(tmp_path: Path) -> None:
    template = fl.make_source(tmp_path / "template")
    rows = fl.source_change_cases(template, tmp_path / "work")
    assert len(rows) == 5
    want = [fl.CLEAN] * 3 + [fl.CORRECT, fl.CLEAN]
    assert [r.outcome for r in rows] == want, fl.bad_rows(rows, set())
    # Mid-run: the run names the shard that changed; the rerun redoes what came from it.
    for row in rows[:3]:
        reported = row.detail.split(" / rerun:")[0]
        assert f"{fl.VICTIM}: source file" in reported, row
        assert "changed during the run" in reported or "ended early" in reported, row
