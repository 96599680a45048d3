"""After loading: the kernel-ready weights, and `apply` against the torch SiTU reference."""

from __future__ import annotations

import pytest
import torch
from conftest import LAYERS, E, K, N
from harness import (
    EXPERT_PREFIX,
    SITU_BETA,
    SITU_LINEAR_BETA,
    FakeK3Text,
    build_moe,
    load_with_real_loader,
    process_hf_config,
    sglang_process,
)
from kernel_ref import RefCutlassFusedMoe
from kimi_w31.converter.reference import compare, dequant_expert, moe_forward

pytestmark = pytest.mark.sglang

RSF = 2.5
TOP_K = 2


def _identity(t, *args, **kwargs):
    return t.clone()


@pytest.fixture
def cpu_flashinfer(monkeypatch):
    """Replace FlashInfer's CUDA-only ops; the pure-torch SM90 scale interleave stays real."""
    import flashinfer
    import flashinfer.fused_moe
    from sglang.srt.layers.quantization import mxfp4

    kernel = RefCutlassFusedMoe()
    monkeypatch.setattr(
        flashinfer.fused_moe, "interleave_moe_weights_for_sm90_mixed_gemm", _identity
    )
    monkeypatch.setattr(flashinfer, "block_scale_interleave", _identity)
    monkeypatch.setattr(flashinfer.fused_moe, "cutlass_fused_moe", kernel)
    monkeypatch.setattr(
        flashinfer, "mxfp8_quantize", lambda x, **kw: (x, torch.zeros(1, dtype=torch.uint8))
    )
    # SGLang's own SM90 routine uses module globals that CPU imports leave unset.
    monkeypatch.setattr(
        mxfp4, "interleave_moe_weights_for_sm90_mixed_gemm", _identity, raising=False
    )
    monkeypatch.setattr(
        mxfp4,
        "interleave_moe_scales_for_sm90_mixed_gemm",
        flashinfer.fused_moe.interleave_moe_scales_for_sm90_mixed_gemm,
        raising=False,
    )
    return kernel


@pytest.fixture
def cpu_kernel(cpu_flashinfer, monkeypatch):
    """As cpu_flashinfer, with the SM90 scale interleave an identity too: the torch kernel
    reads scales in checkpoint layout (the interleave itself is checked against SGLang's)."""
    import flashinfer.fused_moe

    monkeypatch.setattr(
        flashinfer.fused_moe, "interleave_moe_scales_for_sm90_mixed_gemm", _identity
    )
    return cpu_flashinfer


def _loaded(path, tensors, *, arch, inter=N, experts=E, setup=None, process=True, rsf=RSF):
    with sglang_process(path, arch=arch):
        moes = [
            build_moe(experts=experts, hidden=K, inter=inter, layer_id=i, rsf=rsf)
            for i in range(LAYERS)
        ]
        for m in moes:
            if setup:
                setup(m)
        load_with_real_loader(FakeK3Text(process_hf_config().text_config, moes), tensors)
        if process:
            for m in moes:
                m.quant_method.process_weights_after_loading(m)
    return moes


def test_sm90_postload_equals_sglangs_own_processing_of_the_source(
    plugins, cpu_flashinfer, source_dir, converted_dir, source_tensors, converted_tensors
):
    """Same kernel input as SGLang's SM90 routine builds from the original [gate; up] load,
    minus biases, with SiTU parameters instead of SwiGLU ones."""
    from sglang.srt.layers.quantization.mxfp4 import Mxfp4MoEMethod

    stock = _loaded(source_dir, source_tensors, arch="sm90")
    ours = _loaded(converted_dir, converted_tensors, arch="sm90")
    for s, o in zip(stock, ours, strict=True):
        assert type(s.quant_method) is Mxfp4MoEMethod
        assert torch.equal(o.w13_weight, s.w13_weight)
        assert torch.equal(o.w2_weight, s.w2_weight)
        assert o.w13_weight_scale.dtype == torch.int32  # the kernel's view
        assert torch.equal(o.w13_weight_scale.view(torch.uint8), s.w13_weight_scale)
        assert torch.equal(o.w2_weight_scale.view(torch.uint8), s.w2_weight_scale)
        assert o.w13_weight_bias is None and o.w2_weight_bias is None
        for t, value in (
            (o.kimi_w31_situ_beta, SITU_BETA),
            (o.kimi_w31_situ_linear_beta, SITU_LINEAR_BETA),
        ):
            assert t.dtype == torch.float32 and tuple(t.shape) == (E,)
            assert torch.all(t == value)


def test_sm120_postload_swizzles_only_the_scales(
    plugins, cpu_flashinfer, monkeypatch, converted_dir, converted_tensors
):
    import flashinfer

    seen = []

    def marked_swizzle(s):
        seen.append(tuple(s.shape))
        return s.flip(-1).contiguous()  # any permutation: shows which tensors went through it

    monkeypatch.setattr(flashinfer, "block_scale_interleave", marked_swizzle)
    moes = _loaded(converted_dir, converted_tensors, arch="sm120")
    assert seen == [(E, 2 * N, K // 32), (E, K, N // 32)] * LAYERS
    for layer, moe in enumerate(moes):
        for e in range(E):
            p = EXPERT_PREFIX.format(L=layer, E=e)
            assert torch.equal(
                moe.w13_weight[e].view(torch.uint8), converted_tensors[p + "w31.weight_packed"]
            )
            assert torch.equal(
                moe.w2_weight[e].view(torch.uint8), converted_tensors[p + "w2.weight_packed"]
            )
            assert torch.equal(
                moe.w13_weight_scale[e].view(torch.uint8),
                converted_tensors[p + "w31.weight_scale"].flip(-1),
            )
        assert torch.equal(moe.mxfp4_weight_global_scale, torch.ones(E))
        assert moe.w13_weight_bias is None


def _topk(moe, hidden, logits, *, fuse_rsf: bool, rsf: float = RSF):
    """TopK exactly as KimiK3MoE builds it (kimi_k3.py:520-551)."""
    from sglang.srt.layers.moe.topk import TopK, TopKOutputFormat

    topk = TopK(
        top_k=TOP_K,
        layer_id=moe.layer_id,
        renormalize=True,
        use_grouped_topk=True,
        num_expert_group=1,
        topk_group=1,
        scoring_func="sigmoid",
        correction_bias=torch.zeros(logits.shape[1]),
        routed_scaling_factor=rsf,
        apply_routed_scaling_factor_on_output=fuse_rsf,
        output_format=TopKOutputFormat.STANDARD,
    )
    return topk.forward_native(hidden, logits)


def _reference(source_tensors, layer, x, ids, weights) -> torch.Tensor:
    experts = {}
    for e in range(E):
        p = EXPERT_PREFIX.format(L=layer, E=e)
        experts[e] = dequant_expert(
            *[
                (
                    source_tensors[f"{p}{w}.weight_packed"].numpy(),
                    source_tensors[f"{p}{w}.weight_scale"].numpy(),
                )
                for w in ("w1", "w3", "w2")
            ]
        )
    out = moe_forward(
        x.float().numpy(),
        ids.numpy(),
        weights.float().numpy(),
        experts,
        SITU_BETA,
        SITU_LINEAR_BETA,
    )
    return torch.from_numpy(out)


def _close(actual, expected):
    m = compare(actual.float().numpy(), expected.float().numpy())
    assert m["cosine"] > 0.9999 and m["nrmse"] < 1e-2, m


@pytest.mark.parametrize("rsf", [1.0, RSF])  # 1.0 as published; 2.5 shows it applied once
@pytest.mark.parametrize("arch", ["sm90", "sm120"])
def test_apply_matches_the_reference_from_the_source_and_scales_once(
    plugins, cpu_kernel, converted_dir, converted_tensors, source_tensors, arch, rsf
):
    from flashinfer.fused_moe import ActivationType
    from sglang.srt.layers.moe.topk import TopK  # noqa: F401  (real routing below)

    moes = _loaded(converted_dir, converted_tensors, arch=arch, rsf=rsf)
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(9, K, generator=gen).to(torch.bfloat16)
    logits = torch.randn(9, E, generator=gen)
    with sglang_process(converted_dir, arch=arch):
        for layer, moe in enumerate(moes):
            assert moe.should_fuse_routed_scaling_factor_in_topk
            fuse = moe.should_fuse_routed_scaling_factor_in_topk
            routed = _topk(moe, x, logits, fuse_rsf=fuse, rsf=rsf)
            plain = _topk(moe, x, logits, fuse_rsf=False, rsf=rsf)
            assert torch.equal(routed.topk_ids, plain.topk_ids)
            out = moe(x, routed)  # FusedMoE.forward: dispatcher -> apply -> combine
            expected = (
                _reference(source_tensors, layer, x, plain.topk_ids, plain.topk_weights) * rsf
            )
            _close(out, expected)

    kw = cpu_kernel.calls[-1]
    assert kw["activation_type"] == ActivationType.Situ
    assert kw["swiglu_alpha"] is None and kw["swiglu_beta"] is None and kw["swiglu_limit"] is None
    assert kw["fc1_expert_biases"] is None and kw["fc2_expert_biases"] is None
    assert kw["situ_beta"].dtype == torch.float32 and tuple(kw["situ_beta"].shape) == (E,)
    assert kw["situ_linear_beta"].dtype == torch.float32 and torch.all(
        kw["situ_linear_beta"] == 25.0
    )
    assert (kw["tp_size"], kw["tp_rank"], kw["ep_size"], kw["ep_rank"]) == (1, 0, 1, 0)
    assert kw["use_w4_group_scaling"] is (arch == "sm90")
    assert kw["use_mxfp8_act_scaling"] is (arch == "sm120")
    assert (kw["input_sf"] is not None) is (arch == "sm120")
    assert kw["token_selected_experts"].dtype == torch.int32
    assert kw["output"].dtype == torch.bfloat16
    assert len(cpu_kernel.calls) == LAYERS


def _sharded_outputs(converted_dir, converted_tensors, *, arch, kind, x, ids, weights):
    outs = []
    for rank in (0, 1):
        if kind == "tp":

            def setup(m, rank=rank):
                m.moe_tp_size, m.moe_tp_rank = 2, rank

            moes = _loaded(converted_dir, converted_tensors, arch=arch, inter=N // 2, setup=setup)
        else:

            def setup(m, rank=rank):
                m.moe_ep_size, m.moe_ep_rank = 2, rank
                m._num_global_routed, m._num_local_routed, m._expert_storage_rank = E, E // 2, rank

            moes = _loaded(converted_dir, converted_tensors, arch=arch, experts=E // 2, setup=setup)
        moe = moes[0]
        with sglang_process(converted_dir, arch=arch):
            from sglang.srt.layers.moe.token_dispatcher import StandardDispatchOutput
            from sglang.srt.layers.moe.topk import StandardTopKOutput

            topk = StandardTopKOutput(topk_weights=weights, topk_ids=ids, router_logits=None)
            out = moe.quant_method.apply(
                moe,
                StandardDispatchOutput(hidden_states=x, hidden_states_scale=None, topk_output=topk),
            )
        outs.append(out.hidden_states.float())
    return outs


@pytest.mark.parametrize("kind", ["tp", "ep"])
def test_two_ranks_sum_to_the_reference(
    plugins, cpu_kernel, converted_dir, converted_tensors, source_tensors, kind
):
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(6, K, generator=gen).to(torch.bfloat16)
    ids = torch.stack([torch.randperm(E, generator=gen)[:TOP_K] for _ in range(6)]).to(torch.int32)
    weights = torch.rand(6, TOP_K, generator=gen)
    outs = _sharded_outputs(
        converted_dir, converted_tensors, arch="sm90", kind=kind, x=x, ids=ids, weights=weights
    )
    kw = cpu_kernel.calls[-1]
    if kind == "tp":
        assert (kw["tp_size"], kw["tp_rank"], kw["ep_size"]) == (2, 1, 1)
    else:
        assert (kw["ep_size"], kw["ep_rank"], kw["tp_size"]) == (2, 1, 1)
        assert tuple(kw["situ_beta"].shape) == (E // 2,)  # local experts
    _close(outs[0] + outs[1], _reference(source_tensors, 0, x, ids.long(), weights))


def test_sm90_humming_postload_and_apply(
    plugins, cpu_kernel, monkeypatch, converted_dir, converted_tensors, source_tensors
):
    """--flashinfer-mxfp4-moe-precision fp8 on SM90: Humming preparation at load, the five
    quant-scale slots and `use_wfp4afp8_humming` at the call, the same reference output."""
    import flashinfer.fused_moe

    seen = []

    def humming(w, s):  # the CPU fake: keeps the layout, residual 1 after the x64
        seen.append(tuple(w.shape))
        return w.clone(), s.clone(), torch.full((w.shape[0],), 1 / 64)

    monkeypatch.setattr(
        flashinfer.fused_moe, "preprocess_moe_weights_for_sm90_mixed_gemm_humming", humming
    )

    with sglang_process(converted_dir, arch="sm90", flashinfer_mxfp4_moe_precision="fp8"):
        moes = [build_moe(experts=E, hidden=K, inter=N, layer_id=i, rsf=RSF) for i in range(LAYERS)]
        load_with_real_loader(FakeK3Text(process_hf_config().text_config, moes), converted_tensors)
        for m in moes:
            assert m.quant_method.humming
            m.quant_method.process_weights_after_loading(m)
    assert seen == [(E, 2 * N, K // 2), (E, K, N // 2)] * LAYERS
    moe = moes[0]
    assert torch.equal(moe.kimi_w31_w13_humming_residual, torch.ones(E))
    assert moe.kimi_w31_humming_fc2_act_scale.shape == ()
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(7, K, generator=gen).to(torch.bfloat16)
    ids = torch.stack([torch.randperm(E, generator=gen)[:TOP_K] for _ in range(7)]).to(torch.int32)
    weights = torch.rand(7, TOP_K, generator=gen)
    with sglang_process(converted_dir, arch="sm90", flashinfer_mxfp4_moe_precision="fp8"):
        from sglang.srt.layers.moe.token_dispatcher import StandardDispatchOutput
        from sglang.srt.layers.moe.topk import StandardTopKOutput

        topk = StandardTopKOutput(topk_weights=weights, topk_ids=ids, router_logits=None)
        out = moe.quant_method.apply(
            moe, StandardDispatchOutput(hidden_states=x, hidden_states_scale=None, topk_output=topk)
        ).hidden_states
    kw = cpu_kernel.calls[-1]
    assert kw["use_wfp4afp8_humming"] is True and len(kw["quant_scales"]) == 5
    assert kw["quant_scales"][1] is moe.kimi_w31_w13_humming_residual
    assert kw["use_w4_group_scaling"] is True and kw["input_sf"] is None
    _close(out, _reference(source_tensors, 0, x, ids.long(), weights))
