"""Crash at any moment: SIGKILL at fault points spread over a run, Ctrl-C, torn ledger.

Each kill point stops a real `kimi-convert` subprocess at an exact place (fault hook, no
sleeps); rerunning the same command must give an output byte-identical to an uninterrupted
run, which itself verifies clean.
"""

from __future__ import annotations

from pathlib import Path

import faults as fl
import pytest


@pytest.fixture(scope="module")
def template(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return fl.make_source(tmp_path_factory.mktemp("crash") / "template")


@pytest.mark.parametrize("workers", [1, 2])
def test_sigkill_anywhere_resumes_identical(template: Path, tmp_path: Path, workers: int) -> None:
    rows = fl.crash_cases(template, tmp_path, workers, per_label=2)
    assert len(rows) >= 20
    # Every phase of a run is hit, not just the copy loop.
    labels = {r.name.split(" #")[0] for r in rows}
    assert {
        "shard.header",
        "shard.piece",
        "ledger.append",
        "finalize.config",
        "finalize.index",
        "lock.acquired",
    } <= labels
    assert not fl.bad_rows(rows, {fl.RESUMED}), fl.bad_rows(rows, {fl.RESUMED})


def test_kill_points_spread_over_the_run(template: Path) -> None:
    totals = fl.label_totals(template)
    points = fl.kill_points(totals, 2)
    pieces = [n for label, n in points if label == "shard.piece"]
    # First and last call of each label: the start and the very end of the copy.
    assert pieces == [1, totals["shard.piece"]] and totals["shard.piece"] > 100


def test_sigint_exits_130_and_resumes(template: Path, tmp_path: Path) -> None:
    rows = fl.sigint_cases(template, tmp_path)
    assert len(rows) == 3
    assert not fl.bad_rows(rows, {fl.RESUMED}), fl.bad_rows(rows, {fl.RESUMED})


def test_torn_ledger_line_is_dropped_not_glued(template: Path, tmp_path: Path) -> None:
    rows = fl.torn_ledger_cases(template, tmp_path)
    assert not fl.bad_rows(rows, {fl.RESUMED}), fl.bad_rows(rows, {fl.RESUMED})


def test_fault_hook_is_inert_without_the_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    from kimi_w31.converter import faults

    monkeypatch.setattr(faults, "_SPEC", None)
    faults.fault_point("shard.header")  # must simply return
    assert faults._parse("shard.piece:7:int") == ("shard.piece", 7, "int")
    assert faults._parse("ledger.append:2") == ("ledger.append", 2, "kill")
