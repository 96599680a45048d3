"""A non-expert tensor of the wrong shape (one dimension off, the file well formed): convert
refuses it before writing anything and `verify --source` refuses an output holding it, each
with `inventory-shape` naming every such tensor as its file spells it
(faults/shapes.py); the untouched source converts."""

from __future__ import annotations

from pathlib import Path

import faults as fl
import pytest


@pytest.mark.parametrize("seed", [0, 1])
def test_wrong_shapes_are_refused_at_convert_and_verify(tmp_path: Path, seed: int) -> None:
    template = fl.make_source(tmp_path / "template")
    rows = fl.shape_cases(template, tmp_path / "work", seed)
    assert len(rows) == 5
    assert not fl.bad_rows(rows, {fl.CLEAN, fl.CORRECT}), fl.bad_rows(rows, {fl.CLEAN, fl.CORRECT})
