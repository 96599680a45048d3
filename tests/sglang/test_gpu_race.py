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
