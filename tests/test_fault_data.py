"""E8M0 scale byte 0xFF (NaN): convert refuses it, by default too, naming tensor and byte."""

from __future__ import annotations

from pathlib import Path

import faults as fl


def test_nan_scale_reported_with_position(tmp_path: Path) -> None:
    template = fl.make_source(tmp_path / "template")
    rows = fl.data_fault_cases(template, tmp_path / "work")
    assert len(rows) == 3
    assert not fl.bad_rows(rows, {fl.CLEAN}), fl.bad_rows(rows, {fl.CLEAN})


def test_e8m0_scales_checked_by_default_and_only_e8m0(tmp_path: Path) -> None:
    """A NaN expert scale stops a plain convert; finite F32 scales with 0xFF bytes pass even
    --check-scales; a NaN planted in an output is reported by verify's data levels."""
    from faults import library as flib

    rows = flib.scale_cases(fl.make_source(tmp_path / "template"), tmp_path / "work")
    assert len(rows) == 4
    assert not fl.bad_rows(rows, {fl.CLEAN, fl.CORRECT}), fl.bad_rows(rows, {fl.CLEAN, fl.CORRECT})
