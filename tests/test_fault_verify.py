"""`verify` on hostile outputs (copied from anywhere): every planted header or index fault
is reported with exit 1, never a crash."""

from __future__ import annotations

import faultlib as fl
import pytest

# A non-string shard name once crashed verify (it sorted the names before checking types).
NON_STRING_ENTRY = {"index: weight_map entry not a string"}


@pytest.fixture(scope="module")
def rows(tmp_path_factory: pytest.TempPathFactory) -> list[fl.Case]:
    work = tmp_path_factory.mktemp("verify")
    return fl.verify_hostile_cases(fl.make_source(work / "template"), work / "cases")


def test_verify_reports_every_hostile_output(rows: list[fl.Case]) -> None:
    assert len(rows) >= 35
    checked = [r for r in rows if r.name not in NON_STRING_ENTRY]
    assert not fl.bad_rows(checked, {fl.CLEAN}), fl.bad_rows(checked, {fl.CLEAN})


def test_verify_non_string_weight_map_entry(rows: list[fl.Case]) -> None:
    cases = [r for r in rows if r.name in NON_STRING_ENTRY]
    assert cases and not fl.bad_rows(cases, {fl.CLEAN}), fl.bad_rows(cases, {fl.CLEAN})


def test_verify_never_opens_a_path_outside_the_output(tmp_path) -> None:
    rows = fl.verify_fifo_case(fl.make_source(tmp_path / "template"), tmp_path / "work")
    assert not fl.bad_rows(rows, {fl.CLEAN}), fl.bad_rows(rows, {fl.CLEAN})
