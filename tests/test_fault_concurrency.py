"""Two conversions into one output directory; stale and foreign locks."""

from __future__ import annotations

from pathlib import Path

import faults as fl


def test_lock_refuses_live_takes_over_stale(tmp_path: Path) -> None:
    template = fl.make_source(tmp_path / "template")
    rows = fl.concurrency_cases(template, tmp_path / "work")
    assert len(rows) == 5
    allowed = {fl.CLEAN, fl.RESUMED}
    assert not fl.bad_rows(rows, allowed), fl.bad_rows(rows, allowed)
    # The live run is refused (twice), then finishes; the stale lock is taken over.
    assert [r.outcome for r in rows] == [fl.CLEAN, fl.CLEAN, fl.RESUMED, fl.RESUMED, fl.CLEAN]


def test_lock_takeover_is_serialised_and_corrupt_locks_refused(tmp_path: Path) -> None:
    rows = fl.lock_race_cases(tmp_path, tmp_path / "lock")
    assert [r.outcome for r in rows] == [fl.CLEAN, fl.CORRECT, fl.CLEAN, fl.CLEAN, fl.CLEAN], (
        fl.bad_rows(rows, set())
    )
