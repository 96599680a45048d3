"""A source file changed in flight, scales on kept shards, --force and hidden files: every
case is refused cleanly (`source-changed`, `scale-nan` naming the source) or correct."""

from __future__ import annotations

from pathlib import Path

import faults as fl


def test_published_only_as_proven(tmp_path: Path) -> None:
    rows = fl.publish_proof_cases(fl.make_source(tmp_path / "template"), tmp_path / "work")
    assert len(rows) == 9
    assert not fl.bad_rows(rows, {fl.CLEAN, fl.CORRECT}), fl.bad_rows(rows, {fl.CLEAN, fl.CORRECT})
