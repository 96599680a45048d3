"""E8M0 scale byte 0xFF (NaN): --check-scales and verify --checksums report tensor and byte."""

from __future__ import annotations

from pathlib import Path

import faultlib as fl


def test_nan_scale_reported_with_position(tmp_path: Path) -> None:
    template = fl.make_source(tmp_path / "template")
    rows = fl.data_fault_cases(template, tmp_path / "work")
    assert len(rows) == 3
    assert not fl.bad_rows(rows, {fl.CLEAN}), fl.bad_rows(rows, {fl.CLEAN})
