"""CPU parts of the GPU harness (gpu/): inputs, routing, corruptions, gate, report, build list.

The GPU run itself is evidence (docs/gpu-validation.md, gpu/results/), not a CI test; the
one test here that needs a GPU and FlashInfer skips cleanly without them.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from cli_helpers import run_cli
from hypothesis import given
from hypothesis import strategies as st
from kimi_w31.converter import reference as ref

# gpu/ is a tool folder at the repository root, not part of the installed package.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from gpu import cases as C  # noqa: E402
from gpu import harness as H  # noqa: E402
from gpu import trimmed_build as T  # noqa: E402

# --------------------------------------------------------------------------------------
# routing and inputs
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["uniform", "skewed", "masked_slot"])
def test_routing_basic_properties(kind) -> None:
    r = C.make_routing(64, 28, 16, kind, seed=1)
    assert r.ids.shape == r.weights.shape == (64, 16)
    assert r.ids.dtype == torch.int32 and r.weights.dtype == torch.float32
    assert torch.allclose(r.weights.sum(1), torch.ones(64)) and torch.all(r.weights > 0)
    for row in r.ids.tolist():
        routed = [e for e in row if e >= 0]
        assert len(set(routed)) == len(routed) and all(0 <= e < 28 for e in routed)


def test_routing_is_reproducible() -> None:
    a, b = C.make_routing(8, 28, 16, "skewed", 5), C.make_routing(8, 28, 16, "skewed", 5)
    assert torch.equal(a.ids, b.ids) and torch.equal(a.weights, b.weights)
    assert not torch.equal(a.ids, C.make_routing(8, 28, 16, "skewed", 6).ids)


def test_skewed_routing_is_imbalanced() -> None:
    def max_share(kind):
        ids = C.make_routing(256, 28, 4, kind, seed=3).ids
        return torch.bincount(ids.flatten().long(), minlength=28).max().item() / ids.numel()

    assert max_share("skewed") > 2 * max_share("uniform")


def test_empty_expert_routing_leaves_experts_empty() -> None:
    r = C.make_routing(128, 28, 16, "empty_expert", seed=2, empty_experts=(3, 18))
    assert not torch.isin(r.ids, torch.tensor([3, 18], dtype=torch.int32)).any()
    with pytest.raises(ValueError):
        C.make_routing(4, 28, 16, "empty_expert", seed=2)
    with pytest.raises(ValueError):
        C.make_routing(4, 8, 7, "empty_expert", seed=2, empty_experts=(1, 2))


def test_masked_slot_pattern() -> None:
    r = C.make_routing(6, 28, 16, "masked_slot", seed=4)
    assert (r.ids[::2, 15] == -1).all() and (r.ids[1::2] >= 0).all()
    assert (r.ids[:, :15] >= 0).all()


def test_hidden_and_ep_slices() -> None:
    x = C.make_hidden(4, 64, seed=0, scale=3.0)
    assert x.dtype == torch.bfloat16 and x.shape == (4, 64)
    assert torch.equal(x, C.make_hidden(4, 64, seed=0, scale=3.0))
    assert C.ep_slices(28, 2) == [range(0, 14), range(14, 28)]
    with pytest.raises(ValueError):
        C.ep_slices(28, 3)


# --------------------------------------------------------------------------------------
# corruptions
# --------------------------------------------------------------------------------------


def test_swap_nibbles_reads_high_nibble_first() -> None:
    packed = torch.randint(0, 256, (3, 16), dtype=torch.uint8)
    swapped = C.swap_nibbles(packed)
    assert swapped.dtype == torch.uint8
    assert torch.equal(C.swap_nibbles(swapped), packed)
    assert np.array_equal(
        ref.unpack_fp4(swapped.numpy()), ref.unpack_fp4(packed.numpy(), low_nibble_first=False)
    )
    assert C.swap_nibbles(torch.tensor([0x21], dtype=torch.uint8)).item() == 0x12


def test_swap_fc1_halves() -> None:
    w31 = torch.arange(2 * 4 * 3).reshape(2, 4, 3)
    s = C.swap_fc1_halves(w31)
    assert torch.equal(s[:, :2], w31[:, 2:]) and torch.equal(s[:, 2:], w31[:, :2])


# --------------------------------------------------------------------------------------
# gate, comparison, verdict, report
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "cos, nrmse, ok",
    [
        (0.99999, 0.005, True),
        (0.9999946, 0.0033, True),
        (0.999989, 0.001, False),
        (1.0, 0.00501, False),
        (float("nan"), 0.0, False),
        (1.0, float("nan"), False),
    ],
)
def test_gate_thresholds(cos, nrmse, ok) -> None:
    assert C.gate(cos, nrmse) is ok


def test_case_result_expectations() -> None:
    good = C.CaseResult("a", "situ", 1, "uniform", 0.999995, 0.003, 0.5)
    neg_fails = C.CaseResult("n", "negative", 1, "uniform", 0.45, 1.0, 99.0, expect="fail")
    neg_passes = C.CaseResult("n", "negative", 1, "uniform", 0.999995, 0.003, 0.5, expect="fail")
    assert good.passes_gate and good.ok
    assert not neg_fails.passes_gate and neg_fails.ok
    assert neg_passes.passes_gate and not neg_passes.ok


def test_verdict() -> None:
    good = C.CaseResult("a", "situ", 1, "uniform", 0.999995, 0.003, 0.5)
    bad = C.CaseResult("b", "situ", 1, "uniform", 0.99, 0.03, 5.0)
    neg = C.CaseResult("n", "negative", 1, "uniform", 0.4, 1.0, 99.0, expect="fail")
    neg_ok = C.CaseResult("m", "negative", 1, "uniform", 0.999995, 0.003, 0.5, expect="fail")
    assert C.verdict([good, neg], {"graph_replay_bitwise": True})["overall"]
    assert not C.verdict([good, bad, neg], {})["overall"]
    assert not C.verdict([good, neg, neg_ok], {})["overall"]
    assert not C.verdict([good], {})["overall"]  # no negative control: cannot show it can fail
    v = C.verdict([good, neg], {"graph_replay_bitwise": False})
    assert not v["overall"] and v["expected_pass_cases_pass"]


def test_compare_and_bitwise() -> None:
    e = torch.randn(8, 16)
    stats = C.compare(e.to(torch.bfloat16), e)
    assert stats["cosine"] > 0.9999 and 0 < stats["nrmse"] < 0.01
    with pytest.raises(ValueError):
        C.compare(e[:4], e)
    assert C.bitwise_equal([e, e.clone(), e.clone()])
    assert not C.bitwise_equal([torch.zeros(2), torch.tensor([0.0, -0.0])])  # sign bit differs
    nan = torch.tensor([float("nan")])
    assert C.bitwise_equal([nan, nan.clone()])


def test_report_and_table(tmp_path) -> None:
    cases = [
        C.CaseResult("situ-M1-uniform", "situ", 1, "uniform", 0.9999947, 0.00326, 0.41),
        C.CaseResult("neg-x", "negative", 32, "uniform", 0.45, 1.04, 133.8, expect="fail"),
    ]
    report = {"cases": cases, "verdict": C.verdict(cases, {}), "path": tmp_path, "nan": math.nan}
    C.write_report(tmp_path / "r.json", report)
    back = json.loads((tmp_path / "r.json").read_text())
    assert back["cases"][0]["name"] == "situ-M1-uniform" and back["cases"][0]["passes_gate"]
    assert back["cases"][1]["ok"] and not back["cases"][1]["passes_gate"]
    assert back["verdict"]["overall"] and back["path"] == str(tmp_path)
    table = C.markdown_table(cases).splitlines()
    assert len(table) == 4 and table[2].startswith("| situ-M1-uniform | situ | 1 |")
    assert "0.326%" in table[2] and "| FAIL | yes |" in table[3]


def test_expert_index_and_layer_pick() -> None:
    wm = {
        f"model.layers.{L}.mlp.experts.{e}.{p}.{part}": "x"
        for L in (1, 2)
        for e in range(3)
        for p in ("w31", "w2")
        for part in ("weight_packed", "weight_scale")
    }
    wm["model.layers.1.self_attn.q_proj.weight"] = "x"
    idx = C.expert_index(wm)
    assert set(idx) == {"model.layers.1.mlp.experts", "model.layers.2.mlp.experts"}
    assert idx["model.layers.1.mlp.experts"][2] == {"w31", "w2"}
    assert C.pick_moe_layer(idx, {"w31", "w2"}, 3) == "model.layers.1.mlp.experts"
    with pytest.raises(ValueError):
        C.pick_moe_layer(idx, {"w1"}, 3)
    with pytest.raises(ValueError):
        C.pick_moe_layer(idx, {"w31"}, 4)


# --------------------------------------------------------------------------------------
# the whole case list on CPU, the torch reference standing in for the kernel
# --------------------------------------------------------------------------------------


def _kimi_convert(*args: str) -> None:
    run_cli(args, check=True)


@pytest.fixture(scope="module")
def checkpoint_pair(tmp_path_factory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("gpu-harness")
    src, conv = root / "src", root / "conv"
    _kimi_convert("synth", str(src), "--layers", "1", "--experts", "8", "--top-k", "4")
    _kimi_convert(str(src), str(conv), "--manifest", "kimi-k3-any", "-q")
    return src, conv


def _harness(pair, backend) -> H.Harness:
    layer = H.load_layer(pair[0], pair[1], 8)
    return H.Harness(backend, layer, top_k=4, log=lambda _msg: None)


def test_load_layer_reads_converted_and_source(checkpoint_pair) -> None:
    layer = H.load_layer(*checkpoint_pair, 8)
    assert layer.num_experts == 8 and layer.w31[0].shape == (
        8,
        2 * layer.intermediate,
        layer.hidden // 2,
    )
    # the converted fc1 really is [up; gate] of the source experts (bit-exact)
    conv = ref.dequant_converted_expert(
        (H.np_u8(layer.w31[0][5]), H.np_u8(layer.w31[1][5])),
        (H.np_u8(layer.w2[0][5]), H.np_u8(layer.w2[1][5])),
    )
    assert np.array_equal(conv.gate, layer.reference[5].gate)
    assert np.array_equal(conv.up, layer.reference[5].up)


def test_all_cases_on_cpu_stand_in(checkpoint_pair) -> None:
    h = _harness(checkpoint_pair, H.ReferenceBackend())
    report = H.run_all(h, gpu_checks=False, timing=False)
    names = [c.name for c in report["cases"]]
    for m in H.SITU_MS:
        assert f"situ-M{m}-uniform" in names and f"situ-M{m}-skewed" in names
    assert {
        "situ-M32-empty-experts",
        "ep2-M8-uniform",
        "swiglu-M8-uniform",
        "neg-fc1-halves-swapped",
        "neg-betas-swapped",
        "neg-nibble-order",
        "situ-M32-masked-slot",
    } <= set(names)
    assert report["verdict"]["overall"], C.markdown_table(report["cases"])
    negatives = [c for c in report["cases"] if c.kind == "negative"]
    assert len(negatives) == 3 and all(c.cosine < 0.95 for c in negatives)
    assert 2.0 < report["input_stats"]["gate_std"] < 20.0  # tanh(gate/4) saturation exercised


class _GateUpSwappedBackend(H.ReferenceBackend):
    """An adapter bug: reads w31 as [gate; up]. The harness must catch it."""

    def prepare(self, w31, w2):
        return [
            ref.dequant_converted_expert(
                (H.np_u8(w31[0][i]), H.np_u8(w31[1][i])),
                (H.np_u8(w2[0][i]), H.np_u8(w2[1][i])),
                fc1_order=("gate", "up"),
            )
            for i in range(w31[0].shape[0])
        ]


def test_harness_fails_a_broken_adapter(checkpoint_pair) -> None:
    h = _harness(checkpoint_pair, _GateUpSwappedBackend())
    report = H.run_all(h, gpu_checks=False, timing=False)
    assert not report["verdict"]["overall"]
    assert not report["verdict"]["expected_pass_cases_pass"]


def _cli_args(src, conv, out, *extra: str) -> list[str]:
    """The harness command line on the small pair: 8 experts, top-k 4."""
    return [
        "--source",
        str(src),
        "--converted",
        str(conv),
        "--out",
        str(out),
        "--experts",
        "8",
        "--top-k",
        "4",
        *extra,
    ]


def test_cli_reference_backend_writes_report(checkpoint_pair, tmp_path) -> None:
    src, conv = checkpoint_pair
    rc = H.main(_cli_args(src, conv, tmp_path, "--backend", "reference"))
    assert rc == 0
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["verdict"]["overall"] and report["dims"]["experts"] == 8
    assert report["backend"] == "torch-reference"
    assert (tmp_path / "report.md").read_text().startswith("| case |")


@pytest.mark.gpu
def test_harness_on_gpu(checkpoint_pair, tmp_path) -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU (the H200 evidence is in docs/gpu-validation.md)")
    pytest.importorskip("flashinfer", reason="needs flashinfer-python >= 0.7.0")
    src, conv = checkpoint_pair
    rc = H.main(_cli_args(src, conv, tmp_path, "--no-timing"))
    assert rc == 0


# --------------------------------------------------------------------------------------
# the trimmed FlashInfer build: what it compiles
# --------------------------------------------------------------------------------------

_BINDING = """class FusedMoeRunner {
  FusedMoeRunner() {
    mInnerDimMultiplier = 1;

    // keep consistent with cpp/tensorrt_llm/plugins/mixtureOfExperts/mixtureOfExpertsPlugin.cpp
    if (a) { mKernelRunner = std::make_shared<kernels::CutlassMoeFCRunner<half, half>>(); }
    if (isWFP4A16Quant()) { other(); }
    if (!mKernelRunner) {
      fail();
    }
  }
};
"""


def test_trim_binding_keeps_only_the_w4a16_runner() -> None:
    out = T.trim_binding(_BINDING)
    assert "CutlassMoeFCRunner<half, half>" not in out
    assert "CutlassMoeFCRunner<__nv_bfloat16, kernels::Fp4Type>" in out
    assert out.index("isWFP4A16Quant") < out.index("if (!mKernelRunner)")
    assert out.startswith("class FusedMoeRunner {") and out.endswith("};\n")
    with pytest.raises(ValueError):
        T.trim_binding("no markers here")


def test_trim_instantiation() -> None:
    text = """#include "x.h"
template class CutlassMoeFCRunner<half, half>;
template class CutlassMoeFCRunner<__nv_bfloat16, Fp4Type>;
INSTANTIATE_FINALIZE_MOE_ROUTING(half, half, half);
#ifdef ENABLE_BF16
INSTANTIATE_FINALIZE_MOE_ROUTING(__nv_bfloat16, __nv_bfloat16, __nv_bfloat16);
#endif
}
"""
    out = T.trim_instantiation(text)
    assert "CutlassMoeFCRunner<half, half>" not in out
    assert out.count("template class") == 1 and "<__nv_bfloat16, Fp4Type>" in out
    assert out.count("INSTANTIATE_FINALIZE_MOE_ROUTING") == 2 and "#endif\n}" in out
    with pytest.raises(ValueError):
        T.trim_instantiation("template class CutlassMoeFCRunner<half, half>;\n")


def test_select_generated_and_source_order(tmp_path) -> None:
    def gen(m, group, body):
        p = tmp_path / "gemm_grouped" / "90" / f"k_sm90_M{m}_Mixed_group{group}.generated.cu"
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(body)
        return p

    bf16 = "template void f<__nv_bfloat16, SafeFP4, __nv_bfloat16>();"
    files = [
        gen(64, 1, bf16),
        gen(256, 2, bf16),
        gen(128, 3, bf16),
        gen(128, 4, "template void f<half, SafeFP4, half>();"),
    ]
    sm80 = tmp_path / "gemm_grouped" / "80" / "k_sm80.generated.cu"
    sm80.parent.mkdir(parents=True)
    sm80.write_text(bf16)
    picked = T.select_generated([*files, sm80])
    assert [p.name for p in picked] == [files[1].name, files[2].name, files[0].name]

    d = Path("/csrc")
    stock = [
        d / "moe_gemm_kernels_fp8_fp8.cu",
        d / "moe_gemm_kernels_bf16_fp4.cu",
        d / T.BINDING,
        d / T.INSTANTIATION,
        *files,
        d / "logger.cpp",
    ]
    src = T.trimmed_sources(stock, picked, d / "trim_binding.cu", d / "trim_inst.cu")
    assert src[:3] == picked  # biggest M tile first: it compiles longest
    assert src[3:5] == [d / "trim_inst.cu", d / "trim_binding.cu"]
    assert src[5:] == [d / "moe_gemm_kernels_bf16_fp4.cu", d / "logger.cpp"]
    with pytest.raises(ValueError):
        T.trimmed_sources(stock[:1], picked, d / "b.cu", d / "i.cu")


def test_trim_for_the_w4a8_variant() -> None:
    out = T.trim_binding(_BINDING, T.W4A8_HUMMING)
    assert "isWMxfp4AFp8HummingQuant()" in out and "kHummingPreMmaE8M0" in out
    assert "CutlassMoeFCRunner<half, half>" not in out and "isWFP4A16Quant" not in out
    text = """template class CutlassMoeFCRunner<__nv_bfloat16, Fp4Type>;
template class CutlassMoeFCRunner<__nv_fp8_e4m3, Fp4Type, half, half, half, false,
                                  Sm90Wfp4Afp8ScaleMode::kHummingPreMmaE8M0>;
INSTANTIATE_FINALIZE_MOE_ROUTING(half, half, half);
"""
    inst = T.trim_instantiation(text, T.W4A8_HUMMING)
    assert inst.count("template class") == 2 and "<__nv_bfloat16, Fp4Type>" not in inst
    assert "__nv_bfloat16, false, Sm90Wfp4Afp8ScaleMode::kHummingPreMmaE8M0>" in inst
    with pytest.raises(ValueError):  # no Humming runner in the stock file: layout changed
        T.trim_instantiation(text.splitlines()[0] + "\n" + text.splitlines()[3], T.W4A8_HUMMING)
    # The W4A16 module keeps its name, kernels and derived files (its prebuilt stays valid).
    assert T.W4A16.module_name == "fused_moe_90_kimi_w31_w4a16"
    assert T.W4A16.derived_prefix != T.W4A8_HUMMING.derived_prefix
    assert T.W4A8_HUMMING.module_name != T.W4A16.module_name


def test_select_generated_per_variant(tmp_path) -> None:
    def gen(m, body):
        p = tmp_path / "gemm_grouped" / "90" / f"k_sm90_M{m}_Mixed.generated.cu"
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(body)
        return p

    bf16 = gen(64, "f<__nv_bfloat16, SafeFP4, __nv_bfloat16>")
    fp8 = gen(256, "f<__nv_fp8_e4m3, SafeFP4, __nv_bfloat16>")
    assert T.select_generated([bf16, fp8]) == [bf16]
    assert T.select_generated([bf16, fp8], variant=T.W4A8_HUMMING) == [fp8]
    d = Path("/csrc")
    stock = [
        d / "moe_gemm_kernels_bf16_fp4.cu",
        d / "moe_gemm_kernels_fp8_fp4.cu",
        d / T.BINDING,
        d / T.INSTANTIATION,
        d / "logger.cpp",
    ]
    src = T.trimmed_sources(stock, [fp8], d / "b.cu", d / "i.cu", T.W4A8_HUMMING)
    assert src == [fp8, d / "i.cu", d / "b.cu", d / "moe_gemm_kernels_fp8_fp4.cu", d / "logger.cpp"]


# --------------------------------------------------------------------------------------
# SGLang in the loop (gpu/sglang_*.py): the pure parts
# --------------------------------------------------------------------------------------


def test_router_reference() -> None:
    from gpu import sglang_cases as S

    r = S.make_router(6, 28, seed=3, skew=0.5)
    ids, w = S.route(r, 16, renormalize=True, routed_scaling_factor=2.5)
    assert ids.shape == w.shape == (6, 16) and ids.dtype == np.int32
    sig = 1 / (1 + np.exp(-r.logits.astype(np.float64)))
    biased = sig + r.bias
    for t in range(6):
        assert len(set(ids[t].tolist())) == 16
        chosen = biased[t, ids[t]]
        assert np.all(np.diff(chosen) <= 0)  # descending biased score
        assert chosen.min() >= np.delete(biased[t], ids[t]).max()  # the top 16
        want = sig[t, ids[t]] / sig[t, ids[t]].sum() * 2.5  # unbiased, renormalized, scaled
        assert np.allclose(w[t], want, rtol=1e-5)
    _, plain = S.route(r, 16, renormalize=False, routed_scaling_factor=1.0)
    assert np.allclose(plain, np.take_along_axis(sig, ids, 1), rtol=1e-6)


def test_same_routing_ignores_slot_order_only() -> None:
    from gpu import sglang_cases as S

    ids = np.array([[0, 1, 2], [3, 4, 5]])
    w = np.array([[0.5, 0.3, 0.2], [0.1, 0.2, 0.7]], dtype=np.float32)
    assert S.same_routing(ids[:, ::-1], w[:, ::-1], ids, w)["agree"]
    other = ids.copy()
    other[1, 0] = 9
    assert not S.same_routing(other, w, ids, w)["agree"]
    assert not S.same_routing(ids, w * 1.01, ids, w)["agree"]


def test_tp_slices_sum_to_the_expert() -> None:
    from gpu import sglang_cases as S

    g = np.random.default_rng(0)
    e = ref.dequant_expert(
        *[
            (
                g.integers(0, 256, (r, c // 2), dtype=np.uint8),
                g.integers(120, 126, (r, c // 32), dtype=np.uint8),
            )
            for r, c in ((256, 64), (256, 64), (64, 256))
        ]
    )
    x = g.standard_normal((3, 64)).astype(np.float32)
    full = ref.expert_forward(x, e, 4.0, 25.0)
    for tp in (2, 8):
        parts = [S.tp_slice(e, tp, r) for r in range(tp)]
        assert all(
            p.gate.shape == (256 // tp, 64) and p.down.shape == (64, 256 // tp) for p in parts
        )
        total = sum(ref.expert_forward(x, p, 4.0, 25.0) for p in parts)
        assert np.allclose(total, full, rtol=1e-4, atol=1e-3)
    with pytest.raises(ValueError):
        S.tp_slice(e, 3, 0)


def test_swiglu_bias_is_flashinfers_formula() -> None:
    from gpu import sglang_cases as S

    g, u = np.array([2.0, 30.0, -3.0]), np.array([1.0, -40.0, 5.0])
    got = S.swiglu_bias(g, u, alpha=4.0, beta=1.0, limit=25.0)
    gc, uc = np.minimum(g, 25.0), np.clip(u, -25.0, 25.0)
    assert np.allclose(got, gc / (1 + np.exp(-4.0 * gc)) * (uc + 1.0), rtol=1e-6)
    # alpha 1, beta 0, no limit: plain SwiGLU, the reference's control activation
    assert np.allclose(S.swiglu_bias(g, u, 1.0, 0.0, np.inf), ref.swiglu(g, u), rtol=1e-6)


def test_sgl_kernel_stub_imports_and_refuses_calls(monkeypatch) -> None:
    from gpu import sglang_layer as L

    monkeypatch.setattr(sys, "meta_path", list(sys.meta_path))
    for name in [n for n in sys.modules if n.split(".")[0] == "sgl_kernel"]:
        monkeypatch.delitem(sys.modules, name)
    L.install_sgl_kernel_stub()
    try:
        from sgl_kernel.scalar_type import scalar_types  # a module-level constant in SGLang

        kinds = [scalar_types.uint4b8, scalar_types.uint8b128]
        import sgl_kernel

        assert isinstance(type("X", (sgl_kernel.Base,), {})(), sgl_kernel.Base)
        with pytest.raises(RuntimeError, match="stub"):
            sgl_kernel.moe_fused_gate(1, 2)
        with pytest.raises(RuntimeError, match="stub"):
            kinds[0]()
    finally:
        for name in [n for n in sys.modules if n.split(".")[0] == "sgl_kernel"]:
            del sys.modules[name]


# --------------------------------------------------------------------------------------
# W4A8 (gpu/w4a8.py): the reference's FP8 model
# --------------------------------------------------------------------------------------


def test_fp8_rows_model() -> None:
    from gpu import w4a8 as W

    x = np.random.default_rng(1).standard_normal((8, 256)).astype(np.float32) * 3
    q = W.fp8_rows(x)
    assert np.array_equal(np.abs(q).max(1), np.abs(x).max(1))  # the row max maps to 448 exactly
    amax = np.abs(x).max(1, keepdims=True)
    # E4M3 after scaling by amax/448: half a step is 2^-4 relative (normals), 2^-10 x scale
    # absolute (subnormals)
    assert np.all(np.abs(q - x) <= np.maximum(np.abs(x) * 2**-4, amax / 448 * 2**-10) * 1.0001)
    assert not np.array_equal(q, x) and np.array_equal(W.fp8_rows(q), q)  # idempotent


def test_w4a8_reference_and_tp_rank_tensors(checkpoint_pair) -> None:
    from gpu import sglang_cases as S
    from gpu import w4a8 as W

    layer = H.load_layer(*checkpoint_pair, 8)
    x = C.make_hidden(4, layer.hidden, 0).float().numpy()
    r = C.make_routing(4, 8, 4, "uniform", 1)
    plain = ref.moe_forward(x, r.ids.numpy(), r.weights.numpy(), layer.reference, 4.0, 25.0)
    modelled = W.w4a8_reference(x, r.ids.numpy(), r.weights.numpy(), layer.reference, 4.0, 25.0)
    stats = ref.compare(modelled, plain)
    assert 0.001 < stats["nrmse"] < 0.06 and stats["cosine"] > 0.998  # FP8-sized, not more
    w31, w2 = W.tp_rank_tensors(layer, 2, 1)
    for e in (0, 7):
        got = ref.dequant_converted_expert(
            (w31[0][e].numpy(), w31[1][e].numpy()), (w2[0][e].numpy(), w2[1][e].numpy())
        )
        want = S.tp_slice(layer.reference[e], 2, 1)
        assert np.array_equal(got.gate, want.gate) and np.array_equal(got.up, want.up)
        assert np.array_equal(got.down, want.down)
    assert W.w4a8_gate(0.9999, 0.02) and not W.w4a8_gate(0.9999, 0.05)
    assert not W.w4a8_gate(0.999, 0.01)


# --------------------------------------------------------------------------------------
# what gpu/sglang_h200.sh wait reports
# --------------------------------------------------------------------------------------

_SUITES = ["single", "dist-ep1", "dist-ep2", "single-w4a8", "w4a8-checks"]


@st.composite
def _status_files(draw):
    plan = draw(st.lists(st.sampled_from(_SUITES), min_size=1, max_size=4, unique=True))
    outcome = {
        name: draw(st.one_of(st.none(), st.integers(0, 3), st.just("not-run"))) for name in plan
    }
    lines = [f"plan {' '.join(plan)}"]
    for name in plan:
        o = outcome[name]
        if o == "not-run":
            lines.append(f"{name} not-run needs 2 GPUs, found 1")
        elif o is not None:
            lines.append(f"{name} {o}")
    return plan, outcome, "\n".join(lines) + "\n"


@given(_status_files(), st.booleans())
def test_suite_summary_passes_only_when_every_planned_suite_passed(case, finished) -> None:
    from gpu import sglang_cases as S

    plan, outcome, text = case
    code, lines = S.suite_summary(text, finished)
    states = {o.name: o.state for o in S.suite_outcomes(text, finished)}
    assert list(states) == plan
    for name in plan:
        o = outcome[name]
        want = (
            "unfinished" if o is None else "not-run" if o == "not-run" else
            "passed" if o == 0 else "failed"
        )  # fmt: skip
        assert states[name] == want
    assert (code == 0) == all(outcome[n] == 0 for n in plan)
    assert all(any(line.startswith(f"{n}:") for line in lines) for n in plan)


def test_suite_summary_without_a_plan_or_with_a_failed_step() -> None:
    from gpu import sglang_cases as S

    assert S.suite_summary(None, finished=False)[0] == 1  # the pipeline never started
    assert S.suite_summary("", finished=True)[0] == 1
    code, _ = S.suite_summary("plan single dist-ep1\nsynth 1\n", finished=True)
    states = {o.name: o.state for o in S.suite_outcomes("plan single\nsynth 1\n", True)}
    assert code == 1 and states == {"single": "unfinished", "synth": "failed"}


@pytest.mark.parametrize(
    ("status", "done", "rc"),
    [
        ("plan single dist-ep1\nsingle 0\ndist-ep1 not-run needs 2 GPUs, found 1\n", True, 1),
        ("plan single dist-ep1\nsingle 0\ndist-ep1 1\n", True, 1),
        ("plan single dist-ep1\nsingle 0\n", False, 1),
        ("plan single dist-ep1\nsingle 0\ndist-ep1 0\n", True, 0),
    ],
)
def test_sglang_h200_wait_exits_with_the_suites_outcome(tmp_path, status, done, rc) -> None:
    """The script itself, on a work folder as the pipeline leaves it."""
    import os
    import shutil

    root = Path(__file__).resolve().parents[1]
    work = tmp_path / "work"
    (work / "out").mkdir(parents=True)
    shutil.copytree(root / "gpu", work / "repo" / "gpu")
    (work / "suites.status").write_text(status)
    (work / "out" / "pipeline.log").write_text("== pipeline start\n")
    if done:
        (work / "done").touch()
    env = {
        **os.environ,
        "KIMI_W31_WORK": str(work),
        "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}",
    }
    env.pop("OUT", None)
    proc = subprocess.run(
        ["bash", str(root / "gpu" / "sglang_h200.sh"), "wait", "0"],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert proc.returncode == rc, proc.stdout + proc.stderr
    if rc:
        assert "did not pass: dist-ep1" in proc.stdout
    else:
        assert "all 2 passed" in proc.stdout


# --------------------------------------------------------------------------------------
# W4A8 rows and the two-GPU W4A8 verdict (gpu/sglang_run.py dist --precision fp8)
# --------------------------------------------------------------------------------------


def test_gated_row_and_dist_w4a8_verdict() -> None:
    from gpu import sglang_cases as S

    rng = np.random.default_rng(0)
    want = rng.standard_normal((8, 64)).astype(np.float32)
    close = want + 0.001 * rng.standard_normal(want.shape).astype(np.float32)
    swapped = rng.standard_normal(want.shape).astype(np.float32)
    gate = {"cosine_min": 0.9995, "nrmse_max": 0.035}
    good = S.gated_row("tp2-w4a8-2gpu-M8", 8, close, want, want, **gate)
    bad = S.gated_row("neg", 32, swapped, want, want, expect="fail", **gate)
    missed = S.gated_row("tp2-w4a8-2gpu-M128", 128, swapped, want, want, **gate)
    assert good["passes_gate"] and good["ok"] and not bad["passes_gate"] and bad["ok"]
    assert not missed["ok"]
    assert S.dist_w4a8_verdict([good, bad], True)["overall"]
    assert not S.dist_w4a8_verdict([good, bad], False)["overall"]  # ranks differ
    assert not S.dist_w4a8_verdict([good], True)["overall"]  # no negative control
    assert not S.dist_w4a8_verdict([bad], True)["overall"]  # no positive case
    assert not S.dist_w4a8_verdict([good, bad, missed], True)["overall"]
    leaked = {**bad, "passes_gate": True, "ok": False}  # a control that passed
    assert not S.dist_w4a8_verdict([good, leaked], True)["overall"]
    # the gate is the single-GPU W4A8 gate's: both thresholds are inclusive
    from gpu import w4a8 as W

    assert gate == {"cosine_min": W.W4A8_COSINE_MIN, "nrmse_max": W.W4A8_NRMSE_MAX}


def test_dist_cli_takes_the_w4a8_precision() -> None:
    from gpu import sglang_run as R

    ns = R.argparse.Namespace(ep=2, precision="fp8")
    assert R._dist_tag(ns) == "dist-w4a8-ep2"
    assert R._dist_tag(R.argparse.Namespace(ep=1, precision="default")) == "dist-ep1"
