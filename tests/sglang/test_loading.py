"""Converted checkpoints through SGLang's real Kimi-K3 loader and FusedMoE placement."""

from __future__ import annotations

import pytest
import torch
from conftest import LAYERS, E, K, N
from harness import (
    EXPERT_PREFIX,
    FakeK3Text,
    build_moe,
    load_with_real_loader,
    process_hf_config,
    sglang_process,
)

pytestmark = pytest.mark.sglang

P = EXPERT_PREFIX


def _build_and_load(tensors: dict, *, inter: int = N, experts: int = E, setup=None):
    moes = [build_moe(experts=experts, hidden=K, inter=inter, layer_id=i) for i in range(LAYERS)]
    for m in moes:
        if setup:
            setup(m)
    model = FakeK3Text(process_hf_config().text_config, moes)
    load_with_real_loader(model, tensors)
    return moes


@pytest.mark.parametrize("arch", ["sm90", "sm120"])
def test_up_first_w13_is_the_checkpoint_w31(plugins, converted_dir, converted_tensors, arch):
    from kimi_w31.adapter.sglang.moe_method import KimiW31SituMoEMethod

    with sglang_process(converted_dir, arch=arch):
        moes = _build_and_load(converted_tensors)
        for layer, moe in enumerate(moes):
            assert isinstance(moe.quant_method, KimiW31SituMoEMethod)
            for e in range(E):
                p = P.format(L=layer, E=e)
                assert torch.equal(moe.w13_weight[e], converted_tensors[p + "w31.weight_packed"])
                assert torch.equal(
                    moe.w13_weight_scale[e], converted_tensors[p + "w31.weight_scale"]
                )
                assert torch.equal(moe.w2_weight[e], converted_tensors[p + "w2.weight_packed"])
                assert torch.equal(moe.w2_weight_scale[e], converted_tensors[p + "w2.weight_scale"])


def test_stock_methods_load_converted_exactly_like_the_source(
    plugins, source_dir, converted_dir, source_tensors, converted_tensors
):
    """marlin (SGLang's method, default [gate; up] order): converted == source, buffer
    for buffer."""
    from kimi_w31.adapter.sglang.moe_method import KimiW31SituMoEMethod
    from sglang.srt.layers.quantization.mxfp4 import Mxfp4MoEMethod

    def load(path, tensors):
        with sglang_process(path, arch="sm90", moe_runner_backend="marlin"):
            moes = _build_and_load(tensors)
            assert type(moes[0].quant_method) is Mxfp4MoEMethod
            assert not isinstance(moes[0].quant_method, KimiW31SituMoEMethod)
            return [{k: v.clone() for k, v in m.state_dict().items()} for m in moes]

    from_source = load(source_dir, source_tensors)
    from_converted = load(converted_dir, converted_tensors)
    for layer, (a, b) in enumerate(zip(from_source, from_converted, strict=True)):
        assert a.keys() == b.keys()
        for key in a:
            assert torch.equal(a[key], b[key]), (layer, key)
        # and the stock order really is [gate; up]
        p = P.format(L=layer, E=1)
        gate_up = torch.cat(
            [source_tensors[p + "w1.weight_packed"], source_tensors[p + "w3.weight_packed"]]
        )
        assert torch.equal(b["w13_weight"][1], gate_up)


@pytest.mark.parametrize("rank", [0, 1])
def test_tp2_rank_holds_up_r_then_gate_r(
    plugins, converted_dir, source_tensors, converted_tensors, rank
):
    def as_tp2(m):
        m.moe_tp_size, m.moe_tp_rank = 2, rank

    half = N // 2
    with sglang_process(converted_dir, arch="sm120"):
        moes = _build_and_load(converted_tensors, inter=half, setup=as_tp2)
    rows = slice(rank * half, (rank + 1) * half)
    for layer, moe in enumerate(moes):
        for e in range(E):
            p = P.format(L=layer, E=e)
            for suffix in ("weight_packed", "weight_scale"):
                up = source_tensors[p + f"w3.{suffix}"][rows]
                gate = source_tensors[p + f"w1.{suffix}"][rows]
                got = moe.w13_weight if suffix == "weight_packed" else moe.w13_weight_scale
                assert torch.equal(got[e], torch.cat([up, gate])), (layer, e, suffix)
            # w2 [K, N/2] packed: rank r holds columns of its N slice
            cols = slice(rank * half // 2, (rank + 1) * half // 2)
            assert torch.equal(moe.w2_weight[e], source_tensors[p + "w2.weight_packed"][:, cols])
            scols = slice(rank * half // 32, (rank + 1) * half // 32)
            assert torch.equal(
                moe.w2_weight_scale[e], source_tensors[p + "w2.weight_scale"][:, scols]
            )


@pytest.mark.parametrize("rank", [0, 1])
def test_ep2_rank_holds_its_global_experts(plugins, converted_dir, converted_tensors, rank):
    local = E // 2

    def as_ep2(m):
        m.moe_ep_size, m.moe_ep_rank = 2, rank
        m._num_global_routed, m._num_local_routed, m._expert_storage_rank = E, local, rank

    with sglang_process(converted_dir, arch="sm90"):
        moes = _build_and_load(converted_tensors, experts=local, setup=as_ep2)
    for layer, moe in enumerate(moes):
        assert moe.w13_weight.shape[0] == local
        for i in range(local):
            p = P.format(L=layer, E=rank * local + i)
            assert torch.equal(moe.w13_weight[i], converted_tensors[p + "w31.weight_packed"])
            assert torch.equal(moe.w2_weight[i], converted_tensors[p + "w2.weight_packed"])


def test_4d_scales_and_extra_tuple_elements(plugins, converted_dir, converted_tensors):
    """[2N, 1, K/32, 1] scales (as some exporters write) load like 2-D ones."""
    four_d = {
        k: (v[:, None, :, None] if k.endswith("w31.weight_scale") else v)
        for k, v in converted_tensors.items()
    }
    with sglang_process(converted_dir, arch="sm120"):
        moes = _build_and_load(four_d)
    for layer, moe in enumerate(moes):
        for e in range(E):
            p = P.format(L=layer, E=e)
            assert torch.equal(moe.w13_weight_scale[e], converted_tensors[p + "w31.weight_scale"])


def test_converted_config_with_a_layer_missing_w31_fails(plugins, converted_dir, converted_tensors):
    from kimi_w31.adapter.sglang.hooks import W31LoadError

    holed = {
        k: v
        for k, v in converted_tensors.items()
        if ".layers.1.mlp.experts." not in k or ".w2." in k
    }
    with sglang_process(converted_dir, arch="sm120"), pytest.raises(W31LoadError) as err:
        _build_and_load(holed)
    assert "model.layers.1.mlp.experts" in str(err.value)
    assert "kimi-convert verify" in str(err.value)


def test_converted_config_with_unfused_w1_w3_fails(
    plugins, converted_dir, converted_tensors, source_tensors
):
    from kimi_w31.adapter.sglang.hooks import W31LoadError

    mixed = dict(converted_tensors)
    p = P.format(L=0, E=0)
    mixed[p + "w1.weight_packed"] = source_tensors[p + "w1.weight_packed"]
    with (
        sglang_process(converted_dir, arch="sm120"),
        pytest.raises(W31LoadError, match="partial or mixed"),
    ):
        _build_and_load(mixed)


def test_odd_w31_rows_fail_with_the_tensor_name(plugins, converted_dir, converted_tensors):
    from kimi_w31.adapter.split import SplitError

    bad = dict(converted_tensors)
    name = P.format(L=0, E=3) + "w31.weight_packed"
    bad[name] = bad[name][:-1]
    with (
        sglang_process(converted_dir, arch="sm120"),
        pytest.raises(SplitError, match="experts.3.w31"),
    ):
        _build_and_load(bad)
