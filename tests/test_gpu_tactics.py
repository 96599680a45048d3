"""gpu/tactics.py, the pure parts: the tactic list as FlashInfer 0.7.2 orders it, and the
smallest set that keeps every case near its best (the GPU study's report rests on both)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gpu import tactics as T

cases = st.dictionaries(
    st.tuples(st.sampled_from([1, 2, 8]), st.sampled_from([1, 64, 8192]), st.sampled_from([1, 2])),
    st.dictionaries(st.integers(0, 20), st.floats(0.01, 10.0), min_size=1, max_size=8),
    min_size=1,
    max_size=12,
)


@given(times=cases, slack=st.sampled_from([0.0, 0.01, 0.02]))
def test_the_set_keeps_every_case_within_the_slack_of_its_best(times, slack) -> None:
    chosen = T.cover(times, slack)
    assert chosen == sorted(set(chosen))
    for by in times.values():
        best = min(by.values())
        assert by[T.best_in(by, chosen)] <= best * (1 + slack)


def test_one_tactic_near_best_everywhere_is_the_whole_set() -> None:
    times = {(tp, m, 1): {3: 1.0, 7: 1.005, 9: 2.0 + m} for tp in (1, 8) for m in (1, 64)}
    times[(1, 1, 1)][9] = 0.999  # best by 0.1 %: within 1 % of it, tactic 3 still serves
    assert T.cover(times, 0.01) == [3]
    assert T.cover(times, 0.0) == [3, 9]


def test_tactic_ids_follow_flashinfers_order_and_counts() -> None:
    names = T.describe_all(humming=False, gemm1_count=116, gemm2_count=116)
    assert names[0] == {
        "gemm": 1, "tile": "64x16x128", "schedule": "pingpong", "cluster": "1x1x1",
        "finalize": False,
    }  # fmt: skip
    assert names[116]["gemm"] == 2 and names[116]["tile"] == "64x16x128"
    assert names[4 * 12 + 1]["tile"] == "128x16x128" and names[4 * 12 + 1]["cluster"] == "2x1x1"
    humming = T.describe_all(humming=True, gemm1_count=126, gemm2_count=126)
    assert humming[125]["schedule"] == "sw_rolling" and humming[125]["tile"] == "128x64x128"
    with pytest.raises(SystemExit):
        T.describe_all(humming=False, gemm1_count=120, gemm2_count=116)  # a changed list


@given(times=cases, slack=st.sampled_from([0.0, 0.01, 0.02]), start=st.sets(st.integers(0, 3)))
def test_a_launcher_set_serves_every_case_and_keeps_what_was_chosen_before(
    times, slack, start
) -> None:
    key = T.launcher_of((10, 11))  # tactic 10 + i runs GEMM1's launcher i
    chosen = T.cover(times, slack, key, start=start)
    assert set(start) <= set(chosen) and chosen == sorted(set(chosen))
    for by in times.values():
        assert by[T.best_in(by, chosen, key)] <= min(by.values()) * (1 + slack)


def test_gemm1_and_gemm2_tactics_of_one_launcher_are_chosen_once() -> None:
    key = T.launcher_of((4, 4))
    times = {(8, 1, 1): {2: 1.0, 0: 1.5}, (8, 1, 2): {6: 1.0, 4: 1.5}}  # 6 = GEMM2's launcher 2
    assert T.cover(times, 0.01, key) == [2]
    assert T.cover(times, 0.01, key, start=[0]) == [0, 2]
    assert T.cover(times, 0.6, key, start=[0]) == [0]  # the default is within 60 %: enough


def test_only_tactics_near_the_first_best_are_timed_again() -> None:
    assert T.near_best({1: 1.0, 2: 1.09, 3: 1.11, 4: 5.0}, 0.1) == [1, 2]


@given(ms=st.floats(0.001, 100.0), least=st.integers(1, 50), window=st.floats(0.5, 20.0))
def test_a_timing_window_lasts_long_enough_without_running_away(ms, least, window) -> None:
    reps = T.reps_for(ms, least, window)
    assert reps >= least and (reps == least or reps <= 500)
    assert reps * ms >= window or reps == 500


def test_a_case_over_the_limit_brings_its_full_best_launchers() -> None:
    key = T.launcher_of((116, 116))
    checks = [
        {"full": [73, 188], "set": [73, 141], "ratio": 1.0281},
        {"full": [56, 164], "set": [48, 164], "ratio": 1.01},
    ]
    assert T.amend([0, 25, 73], checks, key) == [0, 25, 72, 73]
    assert T.amend([0, 25, 73], checks[1:], key) == [0, 25, 73]


def test_the_shipped_w4a16_set_is_the_measured_one() -> None:
    """adapter/kernels.py's Kimi-K3 launchers: the H200 study's cover, amended by its
    forward re-checks, plus the launcher FlashInfer sizes its workspace with."""
    import json
    from pathlib import Path

    from kimi_w31.adapter import kernels as K

    study = Path(__file__).parent.parent / "gpu/results/2026-12-01-h200-tactics/tactics-w4a16.json"
    report = json.loads(study.read_text())
    counts = (report["tactic_counts"]["gemm1"], report["tactic_counts"]["gemm2"])
    times = {
        tuple(int(x) for x in case.split(",")): {int(t): v for t, v in by.items()}
        for case, by in report["times"].items()
    }
    key = T.launcher_of(counts)
    chosen = T.cover(times, report["slack"], key, start=[0])
    assert chosen == report["set_launchers"]
    shipped = T.amend(chosen, report["checks"], key)
    names = T.describe_all(False, *counts)

    def shape(text: str) -> tuple[int, int, int]:
        return tuple(int(x) for x in text.split("x"))  # type: ignore[return-value]

    expected = {(shape(names[i]["tile"]), shape(names[i]["cluster"])) for i in shipped}
    workspace = ((128, 64, 256), (1, 1, 1))
    assert expected | {workspace} == K.KIMI_K3_W4A16
    # every case of the study keeps a launcher within 1 % of its best, by its own timings
    for by in times.values():
        assert by[T.best_in(by, shipped, key)] <= min(by.values()) * 1.01


def test_forward_ratio_ignores_a_pair_compared_with_itself() -> None:
    """The autotuner smoke's forward check: when the set's best pair is the full best pair,
    nothing was compared, and no ratio is reported (timing one pair twice is noise)."""
    from gpu.tactics import max_forward_ratio

    same = {"tp": 8, "m": 1, "full": [3, 4], "set": [3, 4], "same_pair": True}
    assert max_forward_ratio([same]) is None
    other = {"tp": 8, "m": 8, "full": [3, 4], "set": [5, 4], "ratio": 1.07}
    assert max_forward_ratio([same, other]) == 1.07
    assert max_forward_ratio([]) is None
