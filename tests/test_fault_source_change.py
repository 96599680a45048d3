"""A source shard truncated, rewritten or replaced while (or between) converting, or its
header rewritten (same size) after the plan was made."""

from __future__ import annotations

from pathlib import Path

import faults as fl


def test_source_changes_are_detected_and_never_reused(tmp_path: Path) -> None:
    template = fl.make_source(tmp_path / "template")
    rows = fl.source_change_cases(template, tmp_path / "work")
    assert len(rows) == 7
    # Mid-run: the run reports the shard that changed (code source-changed, the file named:
    # checked in the cases); between runs, even with size, header, inode and mtime kept, the
    # rerun redoes what came from it and equals a fresh conversion.
    want = [fl.CLEAN] * 3 + [fl.CORRECT] * 3 + [fl.CLEAN]
    assert [r.outcome for r in rows] == want, fl.bad_rows(rows, set())
    assert all(r.detail.startswith("[source-changed]") for r in rows[:3]), rows
