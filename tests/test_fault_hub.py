"""The Hub's fault cases (`faults/hub.py`): a server that never answers, one that sends
more than asked, the cache path and --download agreeing, a shared cache's blobs kept."""

from __future__ import annotations

from pathlib import Path

import faults as fl


def test_hub_faults_are_refused_or_handled(tmp_path: Path) -> None:
    rows = fl.hub_cases(fl.make_source(tmp_path / "template"), tmp_path / "work")
    assert len(rows) == 10
    assert not fl.bad_rows(rows, {fl.CLEAN, fl.CORRECT}), fl.bad_rows(rows, {fl.CLEAN, fl.CORRECT})
    assert {r.fault: r.outcome for r in rows if r.outcome == fl.CLEAN}.keys() == {
        fl.hub.FAULT_TIME,
        fl.hub.FAULT_BYTES,
    }
