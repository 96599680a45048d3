"""The race's pure parts (gpu/race_cases.py), its command line (gpu/race.py) and the slim
sgl_kernel packing rule (gpu/slim_kernel.py), on CPU."""

from __future__ import annotations

import math
import tarfile
import zipfile

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpu import race, slim_kernel
from gpu import race_cases as R

EP16, MOETP8 = R.LAYOUTS["ep16"], R.LAYOUTS["moetp8"]


def test_layouts_are_the_deployments_per_rank_shapes() -> None:
    assert (EP16.local_experts, EP16.n_local, EP16.moe_tp) == (56, 3072, 1)
    assert (MOETP8.local_experts, MOETP8.n_local, MOETP8.moe_tp) == (448, 384, 8)
    for lay in R.LAYOUTS.values():  # every rank together holds every expert exactly once
        assert lay.local_experts * lay.ep == R.EXPERTS
        assert lay.n_local * lay.moe_tp == R.N
        # SGLang's check: tp == moe_ep x moe_dp x moe_tp, with the widths the race loads at
        w = race.widths_for(lay)
        assert w["tp"] == w["ep"] * w["moe_tp"]


@given(st.integers(1, 64), st.integers(0, 2**31 - 1))
@settings(max_examples=40, deadline=None)
def test_rank_loads_over_ranks_add_up_to_the_routing(m: int, seed: int) -> None:
    rng = np.random.default_rng(seed)
    ids = np.stack([rng.choice(R.EXPERTS, R.TOP_K, replace=False) for _ in range(m)])
    for lay in R.LAYOUTS.values():
        loads = [R.rank_load(ids, lay, rank) for rank in range(lay.ep)]
        assert sum(ld.pairs for ld in loads) == ids.size
        assert sum(ld.touched for ld in loads) == np.unique(ids).size
        assert all(ld.touched <= min(ld.pairs, lay.local_experts) for ld in loads)


def test_floor_is_the_larger_of_bytes_and_flops() -> None:
    # One expert at full N: 3 x 3072 x 3584 values, 4 bits each + one E8M0 byte per 32.
    assert R.expert_bytes(3072) == 3 * 3072 * 3584 // 2 + 3 * 3072 * 3584 // 32
    dec = R.floor_ms(EP16, R.Load(pairs=16, touched=16))
    assert dec["bound"] == "hbm"
    assert dec["floor_ms"] == pytest.approx(16 * R.expert_bytes(3072) / 4.8e12 * 1e3)
    big = R.floor_ms(EP16, R.Load(pairs=100_000, touched=56))
    assert big["bound"] == "tensor-core"
    assert big["floor_ms"] == pytest.approx(2 * 100_000 * 3 * 3072 * 3584 / 989e12 * 1e3)
    assert R.floor_ms(EP16, R.Load(0, 0))["floor_ms"] == 0.0


def test_link_bytes() -> None:
    lb = R.link_bytes_per_token()
    # ring all-reduce of (latent 3584 + hidden 7168) bf16 over 16 GPUs, summed over GPUs
    assert lb["all_reduce"] == pytest.approx(16 * 2 * 15 / 16 * (3584 + 7168) * 2)
    # 16 distinct experts over 16 ranks reach ~10.3 ranks; ~9.66 of them remote
    assert lb["remote_ranks_per_token"] == pytest.approx(10.30 * 15 / 16, abs=0.01)
    assert lb["all_to_all"] < lb["all_reduce"]
    fp8 = R.link_bytes_per_token(dispatch_bytes_per_value=1.0)
    assert fp8["all_to_all"] == pytest.approx(lb["all_to_all"] * 0.75)
    assert R.expected_distinct(1, 16) == pytest.approx(1.0)


def test_timing_summary_and_report() -> None:
    assert R.median_of_rounds([[1.0, 2.0, 9.0], [2.0, 2.0, 2.0], [3.0, 3.0, 1.0]]) == 2.0
    assert R.spread([[1.0], [2.0], [4.0]]) == pytest.approx(1.5)
    with pytest.raises(ValueError):
        R.median_of_rounds([[]])

    def row(arm: str, m: int, ms: float) -> R.Row:
        return R.Row("ep16", "uniform", m, arm, ms, 0.0, m, m, 0.05, "hbm")

    rows = [row("marlin", 8, 0.2), row("w4a16", 8, 0.25), row("w4a8", 8, 0.1)]
    rows += [row("marlin", 512, 1.0), row("w4a16", 512, 0.5), row("w4a8", 512, 0.25)]
    sp = R.speedups(rows)
    assert sp[("ep16", "uniform", 8, "w4a16")] == pytest.approx(0.8)
    assert sp[("ep16", "uniform", 512, "w4a8")] == pytest.approx(4.0)
    assert R.winners(rows)[("ep16", "uniform", 8)] == "w4a8"
    s = R.summary(rows, "ep16", "uniform")
    assert s["w4a16"]["slower_than_marlin_at"] == [8]
    assert s["w4a8"]["x_at_512_and_up_min"] == pytest.approx(4.0)
    md = R.markdown(rows, {"date_utc": "d"})
    assert md.count("\n| ep16 | uniform |") == 2 and "0.80" in md
    assert rows[0].floor_fraction == pytest.approx(0.25)


@given(st.floats(0.5, 1.0), st.floats(0.1, 2.0), st.floats(0.5, 4.0))
def test_rescaled_nrmse_matches_direct(cos: float, ratio: float, scale: float) -> None:
    rng = np.random.default_rng(0)
    e = rng.standard_normal(64)
    ortho = rng.standard_normal(64)
    ortho -= ortho @ e / (e @ e) * e
    a = cos * e / np.linalg.norm(e) + math.sqrt(1 - cos * cos) * ortho / np.linalg.norm(ortho)
    a *= ratio * np.linalg.norm(e)
    direct = np.linalg.norm(scale * a - e) / np.linalg.norm(e)
    assert R.rescaled_nrmse(cos, ratio, scale) == pytest.approx(direct, rel=1e-6, abs=1e-9)


def test_race_command_line() -> None:
    a = race.parse_args(["--root", "r", "--out", "o", "--ms", "8,1,8", "--arms", "marlin,w4a8"])
    assert a.ms == (1, 8) and a.arms == ["marlin", "w4a8"] and a.autotune
    assert race.parse_args(["--root", "r", "--out", "o"]).ms == R.MS
    assert R.MS[0] == 1 and R.MS[-1] == 8192
    for bad in (["--arms", "cutlass"], ["--ms", "0"], ["--routings", "zipf"]):
        with pytest.raises((SystemExit, ValueError)):
            race.parse_args(["--root", "r", "--out", "o", *bad])
    assert {s.checkpoint for s in race.ARM_SPECS.values()} == {"src", "conv"}
    assert race.ARM_SPECS["marlin"].backend == "marlin"  # the unconverted route


@pytest.mark.parametrize(
    ("name", "kept"),
    [
        ("sgl_kernel/__init__.py", True),
        ("sgl_kernel/sm90/common_ops.abi3.so", True),
        ("sgl_kernel/spatial_ops.abi3.so", True),
        ("sgl_kernel/flash_ops.abi3.so", False),
        ("sgl_kernel/flashmla_ops.abi3.so", False),
        ("sgl_kernel/infllm_ops.cpython-310-x86_64-linux-gnu.so", False),
        ("sgl_kernel/sm100/common_ops.abi3.so", False),
        ("sgl_kernel/sm100/__init__.py", True),
        ("triton_kernels/matmul_ogs.py", False),
        ("sglang_kernel-0.4.6.dist-info/METADATA", True),
        ("sgl_kernel/", False),
    ],
)
def test_slim_kernel_keeps(name: str, kept: bool) -> None:
    assert slim_kernel.keep(name) is kept


def test_slim_kernel_pack(tmp_path) -> None:
    whl = tmp_path / "k.whl"
    with zipfile.ZipFile(whl, "w") as zf:
        for n in ("sgl_kernel/__init__.py", "sgl_kernel/flash_ops.abi3.so", "triton_kernels/a.py"):
            zf.writestr(n, "x")
    with pytest.raises(SystemExit):  # the libraries the route needs are missing
        slim_kernel.pack(str(whl), str(tmp_path / "a.tar.xz"))
    with zipfile.ZipFile(whl, "a") as zf:
        for n in sorted(slim_kernel.KEEP_LIBRARIES):
            zf.writestr(n, "so")
    kept = slim_kernel.pack(str(whl), str(tmp_path / "b.tar.xz"))
    with tarfile.open(tmp_path / "b.tar.xz") as tf:
        assert sorted(tf.getnames()) == sorted(kept)
        assert tf.extractfile("sgl_kernel/__init__.py").read() == b"x"  # type: ignore[union-attr]
    assert "sgl_kernel/flash_ops.abi3.so" not in kept
