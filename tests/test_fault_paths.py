"""Output vs source paths, --force, Hugging Face cache snapshots, permissions."""

from __future__ import annotations

from pathlib import Path

import faultlib as fl


def test_paths(tmp_path: Path) -> None:
    template = fl.make_source(tmp_path / "template")
    rows = fl.path_cases(template, tmp_path / "work")
    assert len(rows) == 7
    want = [fl.CLEAN] * 3 + [fl.CORRECT] * 3 + [fl.CLEAN]
    assert [r.outcome for r in rows] == want, fl.bad_rows(rows, set())
