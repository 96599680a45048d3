"""kimi-convert's own synthetic source and conversion, served through SGLang's real code:
the converted checkpoint's MoE output equals the reference computed from the source."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from harness import (
    FakeK3Text,
    build_moe,
    kimi_convert,
    load_with_real_loader,
    process_hf_config,
    sglang_process,
)
from kernel_ref import RefCutlassFusedMoe
from kimi_w31.converter.reference import compare, dequant_expert, moe_forward
from safetensors.torch import load_file

pytestmark = pytest.mark.sglang

E, K, N, LAYERS = 4, 256, 128, 2


@pytest.fixture(scope="module")
def pair(tmp_path_factory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("e2e")
    src, out = root / "src", root / "out"
    kimi_convert(
        "synth",
        str(src),
        "--layers",
        str(LAYERS),
        "--dense-layers",  # every layer a MoE layer: each is served and compared below
        "0",
        "--experts",
        str(E),
        "--k",
        str(K),
        "--n",
        str(N),
    )
    kimi_convert(str(src), str(out), "--manifest", "kimi-k3-any")
    return src, out


EXPERTS = ".block_sparse_moe.experts."  # the published spelling synth writes


def _experts(path: Path) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    for shard in sorted(path.glob("*.safetensors")):
        tensors.update({k: v for k, v in load_file(str(shard)).items() if EXPERTS in k})
    return tensors


def test_converter_wraps_the_config_for_fail_closed(pair):
    cfg = json.loads((pair[1] / "config.json").read_text())
    # As published, the one quantization_config is inside text_config: that is what is wrapped.
    assert "quantization_config" not in cfg
    assert cfg["text_config"]["quantization_config"]["quant_method"] == "kimi_w31"
    assert cfg["kimi_w31"]["fc1_order"] == ["up", "gate"]


@pytest.mark.parametrize("arch", ["sm90", "sm120"])
def test_converted_checkpoint_serves_the_sources_moe(plugins, pair, monkeypatch, arch):
    import flashinfer
    import flashinfer.fused_moe
    from kimi_w31.adapter.sglang.moe_method import KimiW31SituMoEMethod

    kernel = RefCutlassFusedMoe()
    ident = lambda t, *a, **k: t.clone()  # noqa: E731  (CUDA-only swizzles)
    for mod, name in (
        (flashinfer.fused_moe, "interleave_moe_weights_for_sm90_mixed_gemm"),
        (flashinfer.fused_moe, "interleave_moe_scales_for_sm90_mixed_gemm"),
        (flashinfer, "block_scale_interleave"),
    ):
        monkeypatch.setattr(mod, name, ident)
    monkeypatch.setattr(flashinfer.fused_moe, "cutlass_fused_moe", kernel)
    monkeypatch.setattr(flashinfer, "mxfp8_quantize", lambda x, **kw: (x, torch.zeros(1)))

    src, out = pair
    source, converted = _experts(src), _experts(out)
    assert not any(".w1." in k or ".w3." in k for k in converted)
    text = json.loads((src / "config.json").read_text())["text_config"]
    rsf = text["routed_scaling_factor"]
    gen = torch.Generator().manual_seed(11)
    x = torch.randn(5, K, generator=gen).to(torch.bfloat16)
    ids = torch.stack([torch.randperm(E, generator=gen)[:2] for _ in range(5)]).to(torch.int32)
    weights = torch.rand(5, 2, generator=gen)

    with sglang_process(out, arch=arch):
        moes = [build_moe(experts=E, hidden=K, inter=N, layer_id=i, rsf=rsf) for i in range(LAYERS)]
        load_with_real_loader(FakeK3Text(process_hf_config().text_config, moes), converted)
        from sglang.srt.layers.moe.token_dispatcher import StandardDispatchOutput
        from sglang.srt.layers.moe.topk import StandardTopKOutput

        for layer, moe in enumerate(moes):
            assert isinstance(moe.quant_method, KimiW31SituMoEMethod)
            moe.quant_method.process_weights_after_loading(moe)
            topk = StandardTopKOutput(topk_weights=weights, topk_ids=ids, router_logits=None)
            got = moe.quant_method.apply(
                moe,
                StandardDispatchOutput(hidden_states=x, hidden_states_scale=None, topk_output=topk),
            ).hidden_states
            experts = {}
            for e in range(E):
                p = f"language_model.model.layers.{layer}{EXPERTS}{e}."
                experts[e] = dequant_expert(
                    *[
                        (
                            source[f"{p}{w}.weight_packed"].numpy(),
                            source[f"{p}{w}.weight_scale"].numpy(),
                        )
                        for w in ("w1", "w3", "w2")
                    ]
                )
            expected = moe_forward(
                x.float().numpy(), ids.numpy(), weights.numpy(), experts, 4.0, 25.0
            )
            m = compare(got.float().numpy(), expected)
            assert m["cosine"] > 0.9999 and m["nrmse"] < 1e-2, (layer, m)
    assert len(kernel.calls) == LAYERS


def test_serve_checks_pass_on_the_real_stack_and_print_the_command(pair):
    """Real metadata of sglang/flashinfer/the entry point, real structure verify."""
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "kimi_w31",
            "serve",
            str(pair[1]),
            "--print",
            "--",
            "--port",
            "30001",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    cmd = proc.stdout.strip().splitlines()[-1]
    assert "-m sglang.launch_server --model-path" in cmd
    assert (
        "--moe-runner-backend flashinfer_mxfp4 --tp-size 1 --trust-remote-code "
        "--reasoning-parser kimi_k3 --tool-call-parser kimi_k3 --port 30001"
    ) in cmd
    # the source is refused without the opt-in
    proc = subprocess.run(
        [sys.executable, "-m", "kimi_w31", "serve", str(pair[0]), "--print"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode != 0 and "--unconverted" in proc.stdout + proc.stderr
