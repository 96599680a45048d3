"""gpu/race.py on CPU: each arm's per-rank layer built and loaded by SGLang's own code under
the rank's parallel widths (EP rank 0), from a checkpoint that holds only that rank's
experts. The kernels (Marlin's repack, FlashInfer's interleaves) are CUDA-only: the
post-load step is recorded, not run; the GPU run covers it."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
from harness import kimi_convert

pytestmark = pytest.mark.sglang

ROOT = Path(__file__).resolve().parents[2]
GLOBAL, EP, LOCAL, KK, NN = 32, 4, 8, 256, 256


@pytest.fixture(scope="module")
def rank_pair(tmp_path_factory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("race")
    src, out = root / "src", root / "conv"
    kimi_convert(
        "synth", str(src), "--layers", "1", "--experts", str(LOCAL), "--top-k", "4",
        "--k", str(KK), "--n", str(NN),
    )  # fmt: skip
    kimi_convert(str(src), str(out), "--manifest", "kimi-k3-any", "-q")
    return src, out


def _fc1_rows(src: Path, e: int) -> list[bytes]:
    """The source's gate and up rows of expert `e` (packed bytes), the truth for both arms."""
    from gpu import sglang_layer as L

    t = L.read_layer_tensors(src, 0)
    names = [n for n in t if f".experts.{e}.w1." in n or f".experts.{e}.w3." in n]
    rows = np.concatenate([t[n].numpy() for n in sorted(names) if n.endswith("weight_packed")])
    return sorted(map(bytes, rows))


@pytest.mark.parametrize("arm", ["marlin", "w4a16"])
def test_rank_layer_holds_only_the_ranks_experts(plugins, rank_pair, monkeypatch, arm) -> None:
    import torch
    from sglang.srt.layers.quantization import mxfp4
    from sglang.srt.runtime_context import get_parallel, override_platform

    sys.path.insert(0, str(ROOT))
    from gpu import race
    from gpu import race_cases as R
    from gpu import sglang_layer as L

    monkeypatch.setattr(L, "DEVICE", "cpu")
    monkeypatch.setattr(R, "EXPERTS", GLOBAL)
    monkeypatch.setattr(R, "N", NN)
    layout = R.Layout("t", "test rank", tp=EP, ep=EP, n_local=NN)
    spec = race.ARM_SPECS[arm]
    repo = rank_pair[0] if spec.checkpoint == "src" else rank_pair[1]
    processed = []
    with L.sglang_rank(repo, tp=1, ep=1, rank=0, precision=spec.precision, backend=spec.backend):
        monkeypatch.setattr(mxfp4, "_FI_HAS_SM90_CUTLASS_MXFP4", True)
        with override_platform(is_sm90=True):
            cfg = L.text_config()
            with race.rank_of(layout):
                assert get_parallel().moe_ep_size == EP
                layer = L.build_layer(cfg, 0, intermediate=NN, num_experts=GLOBAL)
                monkeypatch.setattr(  # SGLang's method, or the plugin's subclass of it
                    type(layer.moe.quant_method),
                    "process_weights_after_loading",
                    lambda s, lyr: processed.append(1),
                )
                L.load_weights(layer, cfg, L.read_layer_tensors(repo, 0))
        # Outside the override the process is a one-rank world again.
        assert get_parallel().moe_ep_size == 1
    moe = layer.moe
    assert moe.num_local_experts == LOCAL and moe.moe_ep_size == EP and moe.moe_ep_rank == 0
    assert moe.dispatcher.moe_ep_size == EP
    assert processed, "the arm's post-load step was not reached"
    assert layer.info["quant_method"] == (
        "Mxfp4MoEMethod" if arm == "marlin" else "KimiW31SituMoEMethod"
    )
    w13 = moe.w13_weight.detach().view(torch.uint8).numpy()
    assert w13.shape[0] == LOCAL
    for e in range(LOCAL):  # each local expert's fc1 rows are its checkpoint rows
        assert sorted(map(bytes, w13[e])) == _fc1_rows(rank_pair[0], e)
    assert sorted(map(bytes, w13[0])) != _fc1_rows(rank_pair[0], 1)  # the check can fail


def test_rank_of_restores_widths_on_error(plugins, rank_pair, monkeypatch) -> None:
    from sglang.srt.runtime_context import get_parallel

    sys.path.insert(0, str(ROOT))
    from gpu import race
    from gpu import race_cases as R
    from gpu import sglang_layer as L

    monkeypatch.setattr(L, "DEVICE", "cpu")
    layout = R.LAYOUTS["ep16"]
    with L.sglang_rank(rank_pair[1], tp=1, ep=1, rank=0):
        with pytest.raises(RuntimeError), race.rank_of(layout):
            assert get_parallel().moe_ep_size == 16
            raise RuntimeError("boom")
        assert get_parallel().moe_ep_size == 1


class _Replay:
    """A CUDA graph stand-in: replay() calls the captured function."""

    def __init__(self, fn) -> None:
        self.fn = fn

    def replay(self) -> None:
        self.fn()


def test_race_layout_on_cpu(plugins, rank_pair, monkeypatch, tmp_path) -> None:
    """The race's flow for one layout with the plugin's W4A16 arm: batches over the global
    experts, SGLang's TopK and FusedMoE of EP rank 0, the rank's reference from the source
    (only its experts), rows, floors and the report files. FlashInfer's kernel is the CPU
    reference kernel (kernel_ref.py); graphs and CUDA-event timing are the GPU run's."""
    import contextlib
    import json

    import flashinfer.fused_moe
    from kernel_ref import RefCutlassFusedMoe
    from sglang.srt.layers.quantization import mxfp4
    from sglang.srt.runtime_context import override_platform

    sys.path.insert(0, str(ROOT))
    from gpu import race
    from gpu import race_cases as R
    from gpu import sglang_layer as L

    ident = lambda t, *a, **k: t.clone()  # noqa: E731  (CUDA-only swizzles)
    for name in (
        "interleave_moe_weights_for_sm90_mixed_gemm",
        "interleave_moe_scales_for_sm90_mixed_gemm",
    ):
        monkeypatch.setattr(flashinfer.fused_moe, name, ident)
    monkeypatch.setattr(flashinfer.fused_moe, "cutlass_fused_moe", RefCutlassFusedMoe())
    monkeypatch.setattr(L, "DEVICE", "cpu")
    real_rank = L.sglang_rank

    @contextlib.contextmanager
    def cpu_rank(*a, **k):
        with real_rank(*a, **k):
            monkeypatch.setattr(mxfp4, "_FI_HAS_SM90_CUTLASS_MXFP4", True)
            with override_platform(is_sm90=True):
                yield

    monkeypatch.setattr(L, "sglang_rank", cpu_rank)
    for name, value in (("EXPERTS", GLOBAL), ("K", KK), ("N", NN), ("TOP_K", 4)):
        monkeypatch.setattr(R, name, value)
    monkeypatch.setattr(race, "install_module", lambda spec, args: None)
    monkeypatch.setattr(race, "keep_module", lambda: None)
    monkeypatch.setattr(race.Race, "capture", staticmethod(_Replay))
    monkeypatch.setattr(
        race.Race,
        "time_layout",
        lambda self, arms, batches: {
            (*key, arm): [[0.5, 0.4, 0.6]] * 3 for key in batches for arm in arms
        },
    )
    root = tmp_path / "ck"
    (root / "t").mkdir(parents=True)
    (root / "t" / "src").symlink_to(rank_pair[0])
    (root / "t" / "conv").symlink_to(rank_pair[1])
    layout = R.Layout("t", "test rank", tp=EP, ep=EP, n_local=NN)
    args = race.parse_args(
        ["--root", str(root), "--out", str(tmp_path), "--arms", "w4a16", "--ms", "1,8,32",
         "--accuracy-ms", "8,32", "--no-autotune"],
    )  # fmt: skip
    r = race.Race(args, lambda _msg: None)
    r.layout(layout)
    r.write({"date_utc": "cpu"})

    assert not r.report["errors"]
    assert {(x.routing, x.m) for x in r.rows} == {(rt, m) for rt in R.ROUTINGS for m in (1, 8, 32)}
    for row in r.rows:
        assert row.ms == 0.5 and row.arm == "w4a16"
        assert 0 <= row.touched <= min(row.pairs, LOCAL)
        if row.m in (8, 32) and row.pairs:  # the rank's output against the rank's reference
            assert row.cosine > 0.99999 and row.nrmse < 0.005, row
    info = r.report["layouts"]["t"]["arms"]["w4a16"]
    assert info["local_experts"] == LOCAL and info["quant_method"] == "KimiW31SituMoEMethod"
    saved = json.loads((tmp_path / "report-race.json").read_text())
    assert len(saved["rows"]) == len(r.rows)
    assert "| t | uniform | 8 |" in (tmp_path / "report-race.md").read_text()
