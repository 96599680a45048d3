"""Class 8: two names SGLang folds into one parameter are refused by convert and verify."""

from __future__ import annotations

from pathlib import Path

import faults as fl


def test_every_fold_is_refused_by_convert_and_verify(tmp_path: Path) -> None:
    template = fl.make_source(tmp_path / "template")
    rows = fl.alias_cases(template, tmp_path / "work")
    assert len(rows) == 2 * len(fl.aliases.ALIASES)
    assert not fl.bad_rows(rows, {fl.CLEAN}), fl.bad_rows(rows, {fl.CLEAN})
