"""gpu/sglang_run.py's single-GPU suite, run on CPU: the same SGLang objects, loader, TopK
and FusedMoE.forward, with FlashInfer's CUDA-only pieces replaced as in
test_postload_apply.py. Proves the script's wiring and its reference, not the kernel."""

from __future__ import annotations

import contextlib
import sys
from pathlib import Path

import pytest
from harness import kimi_convert
from kernel_ref import RefCutlassFusedMoe

pytestmark = pytest.mark.sglang

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def pair(tmp_path_factory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("gpu-sglang")
    src, out = root / "src", root / "out"
    # N 1024 keeps every TP8 rank at 128 rows, the kernel tile.
    kimi_convert(
        "synth",
        str(src),
        "--layers",
        "1",
        "--experts",
        "8",
        "--top-k",
        "4",
        "--k",
        "256",
        "--n",
        "1024",
        "--routed-scaling-factor",
        "2.5",  # not the published 1.0: a scaling applied twice or never would show
    )
    kimi_convert(str(src), str(out), "--manifest", "kimi-k3-any", "-q")
    return src, out


def test_single_suite_on_cpu(plugins, pair, monkeypatch, tmp_path) -> None:
    import flashinfer
    import flashinfer.fused_moe
    from sglang.srt.layers.quantization import mxfp4
    from sglang.srt.runtime_context import override_platform

    sys.path.insert(0, str(ROOT))
    from gpu import sglang_layer as L
    from gpu import sglang_run as R

    ident = lambda t, *a, **k: t.clone()  # noqa: E731  (CUDA-only swizzles)
    for mod, name in (
        (flashinfer.fused_moe, "interleave_moe_weights_for_sm90_mixed_gemm"),
        (flashinfer.fused_moe, "interleave_moe_scales_for_sm90_mixed_gemm"),
    ):
        monkeypatch.setattr(mod, name, ident)
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
    # SGLang's stock runner needs real FlashInfer on CUDA: the GPU run covers it.
    monkeypatch.setattr(R.Single, "stock", lambda self, *a: None)
    src, conv = pair
    args = R.argparse.Namespace(source=src, converted=conv, out=tmp_path, prebuilt=None)
    report = R.Single(args, lambda _msg: None).run()

    by_name = {c.name: c for c in report["cases"]}
    for m in R.SINGLE_MS:
        assert by_name[f"sglang-situ-M{m}"].passes_gate
    assert not by_name["neg-w31-halves-swapped"].passes_gate
    assert by_name["tp8-sum-of-ranks"].passes_gate and by_name["tp2-rank1-N512"].passes_gate
    assert report["checks"]["adapter_engaged"]
    assert report["checks"]["sglang_topk_matches_reference_router"]
    assert report["checks"]["every_tp_rank_passes"]
    assert report["verdict"]["overall"]
    assert report["dims"]["routed_scaling_factor"] == 2.5  # != 1: the scaling is exercised
