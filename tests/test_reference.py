"""Unit tests of the numerical reference (converter/reference.py)."""

from __future__ import annotations

import math

import pytest
import torch
from kimi_w31.converter import reference as ref

# OCP MX e2m1, written out independently of the module's table.
E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]


def test_e2m1_table_every_code() -> None:
    codes = torch.arange(16, dtype=torch.uint8)
    packed = codes | (codes << 4)  # both nibbles = code
    values = ref.unpack_fp4(packed.reshape(16, 1))
    assert values.shape == (16, 2)
    assert values[:, 0].tolist() == E2M1
    assert values[:, 1].tolist() == E2M1
    # -0.0 keeps its sign bit (code 8)
    assert math.copysign(1.0, values[8, 0].item()) == -1.0


def test_low_nibble_first() -> None:
    packed = torch.tensor([[0x21, 0xF7]], dtype=torch.uint8)
    assert ref.unpack_fp4(packed).tolist() == [[0.5, 1.0, 6.0, -6.0]]
    assert ref.unpack_fp4(packed, low_nibble_first=False).tolist() == [[1.0, 0.5, -6.0, 6.0]]


def test_e8m0_bytes() -> None:
    s = ref.e8m0_to_float(torch.tensor([127, 128, 126, 0, 254, 0xFF], dtype=torch.uint8))
    assert s[:3].tolist() == [1.0, 2.0, 0.5]
    assert s[3].item() == 2.0**-127 and s[3].item() > 0  # byte 0 is a valid, tiny scale
    assert s[4].item() == 2.0**127
    assert math.isnan(s[5].item())


def test_dtype_checks() -> None:
    with pytest.raises(TypeError):
        ref.unpack_fp4(torch.zeros(1, 1, dtype=torch.int8))
    with pytest.raises(TypeError):
        ref.e8m0_to_float(torch.zeros(1, dtype=torch.int32))


def test_dequant_applies_one_scale_per_group_of_32() -> None:
    packed = torch.full((1, 32), 0x22, dtype=torch.uint8)  # 64 values of 1.0
    scale = torch.tensor([[128, 125]], dtype=torch.uint8)  # 2.0 then 0.25
    w = ref.dequant_mxfp4(packed, scale)
    assert w.shape == (1, 64)
    assert torch.all(w[0, :32] == 2.0) and torch.all(w[0, 32:] == 0.25)
    with pytest.raises(ValueError):
        ref.dequant_mxfp4(packed, torch.zeros(1, 3, dtype=torch.uint8))


def test_situ_hand_computed_value() -> None:
    g, u, beta, lb = 2.0, 10.0, 4.0, 25.0
    expected = (beta * math.tanh(g / beta) / (1 + math.exp(-g))) * (lb * math.tanh(u / lb))
    got = ref.situ(torch.tensor([g]), torch.tensor([u]), beta, lb).item()
    assert got == pytest.approx(expected, rel=1e-6)
    assert got == pytest.approx(1.6281 * 9.4987, rel=1e-3)  # 4 tanh(.5) s(2) * 25 tanh(.4)


def test_situ_sigmoid_is_of_the_uncapped_gate() -> None:
    # For a huge gate, tanh saturates to beta and sigmoid -> 1: gate' -> beta exactly.
    out = ref.situ(torch.tensor([100.0]), torch.tensor([1.0]), 4.0, 25.0).item()
    assert out == pytest.approx(4.0 * 25.0 * math.tanh(1 / 25), rel=1e-6)
    # A negative gate is damped by the sigmoid, not only capped.
    neg = ref.situ(torch.tensor([-6.0]), torch.tensor([1.0]), 4.0, 25.0).item()
    assert neg == pytest.approx(4 * math.tanh(-1.5) / (1 + math.exp(6)) * 25 * math.tanh(0.04))


def test_situ_gate_up_asymmetry() -> None:
    g, u = torch.tensor([3.0, -2.0, 8.0]), torch.tensor([-1.0, 5.0, 30.0])
    assert not torch.allclose(ref.situ(g, u, 4.0, 25.0), ref.situ(u, g, 4.0, 25.0))
    # The up branch is capped at linear_beta, unlike SwiGLU's linear up.
    big_up = ref.situ(torch.tensor([50.0]), torch.tensor([1e4]), 4.0, 25.0).item()
    assert big_up == pytest.approx(4.0 * 25.0, rel=1e-5)


def test_swiglu_control() -> None:
    g, u = torch.tensor([1.0, -2.0]), torch.tensor([3.0, 4.0])
    assert torch.allclose(ref.swiglu(g, u), g * torch.sigmoid(g) * u)


def test_split_w31_orders() -> None:
    up, gate = torch.zeros(4, 3), torch.ones(4, 3)
    w31 = torch.cat([up, gate])
    u, g = ref.split_w31(w31, ("up", "gate"))
    assert torch.equal(u, up) and torch.equal(g, gate)
    u, g = ref.split_w31(w31, ["gate", "up"])
    assert torch.equal(u, gate) and torch.equal(g, up)
    with pytest.raises(ValueError):
        ref.split_w31(w31, ("up", "up"))
    with pytest.raises(ValueError):
        ref.split_w31(torch.zeros(5, 3), ("up", "gate"))


def _random_mxfp4(rows: int, k: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    packed = torch.randint(0, 256, (rows, k // 2), generator=g, dtype=torch.uint8)
    scale = torch.randint(122, 126, (rows, k // 32), generator=g, dtype=torch.uint8)
    return packed, scale


def test_converted_equals_source_semantics() -> None:
    g = torch.Generator().manual_seed(0)
    w1, w3, w2 = _random_mxfp4(8, 64, g), _random_mxfp4(8, 64, g), _random_mxfp4(64, 32, g)
    w31 = (torch.cat([w3[0], w1[0]]), torch.cat([w3[1], w1[1]]))
    src = ref.dequant_expert(w1, w3, w2)
    conv = ref.dequant_converted_expert(w31, w2)
    assert torch.equal(src.gate, conv.gate) and torch.equal(src.up, conv.up)
    wrong = ref.dequant_converted_expert(w31, w2, fc1_order=("gate", "up"))
    assert not torch.equal(src.gate, wrong.gate)


def _experts(n_exp: int, k: int = 64, n: int = 32, seed: int = 0) -> dict[int, ref.ExpertWeights]:
    g = torch.Generator().manual_seed(seed)
    return {
        e: ref.dequant_expert(
            _random_mxfp4(n, k, g), _random_mxfp4(n, k, g), _random_mxfp4(k, n, g)
        )
        for e in range(n_exp)
    }


def test_moe_forward_matches_explicit_sum() -> None:
    experts = _experts(3)
    x = torch.randn(2, 64, generator=torch.Generator().manual_seed(1))
    ids = torch.tensor([[0, 2], [1, 0]])
    w = torch.tensor([[0.25, 0.75], [0.5, 0.5]])
    out = ref.moe_forward(x, ids, w, experts, 4.0, 25.0)
    for t in range(2):
        want = sum(
            w[t, j] * ref.expert_forward(x[t : t + 1], experts[int(ids[t, j])], 4.0, 25.0)
            for j in range(2)
        )
        assert torch.allclose(out[t : t + 1], want, rtol=1e-5, atol=1e-4)


def test_moe_forward_negative_slot_contributes_nothing() -> None:
    experts = _experts(4)
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(2))
    ids = torch.tensor([[0, 1, 2], [3, 2, 1], [1, 0, 3]])
    w = torch.rand(3, 3, generator=torch.Generator().manual_seed(3))
    masked = ids.clone()
    masked[:, 2] = -1
    full_masked = ref.moe_forward(x, masked, w, experts, 4.0, 25.0)
    dropped = ref.moe_forward(x, ids[:, :2], w[:, :2], experts, 4.0, 25.0)
    assert torch.allclose(full_masked, dropped, rtol=1e-6, atol=1e-5)
    assert not torch.allclose(full_masked, ref.moe_forward(x, ids, w, experts, 4.0, 25.0))


def test_moe_forward_ep_disjoint_sums() -> None:
    experts = _experts(4)
    x = torch.randn(5, 64, generator=torch.Generator().manual_seed(4))
    ids = torch.tensor([[0, 3], [1, 2], [2, 0], [3, 1], [0, 1]])
    w = torch.rand(5, 2, generator=torch.Generator().manual_seed(5))
    full = ref.moe_forward(x, ids, w, experts, 4.0, 25.0)
    rank0 = ref.moe_forward(x, ids, w, {e: experts[e] for e in (0, 1)}, 4.0, 25.0)
    rank1 = ref.moe_forward(x, ids, w, {e: experts[e] for e in (2, 3)}, 4.0, 25.0)
    assert torch.allclose(rank0 + rank1, full, rtol=1e-5, atol=1e-4)
    assert not torch.allclose(rank0, full)


def test_moe_forward_activation_switch() -> None:
    experts = _experts(2)
    x = torch.randn(2, 64, generator=torch.Generator().manual_seed(6))
    ids, w = torch.tensor([[0, 1], [1, 0]]), torch.full((2, 2), 0.5)
    situ = ref.moe_forward(x, ids, w, experts, 4.0, 25.0, "situ")
    swiglu = ref.moe_forward(x, ids, w, experts, 4.0, 25.0, "swiglu")
    assert not torch.allclose(situ, swiglu)
    with pytest.raises(ValueError):
        ref.moe_forward(x, ids, w, experts, 4.0, 25.0, "gelu")


def test_compare() -> None:
    e = torch.tensor([1.0, 2.0, 3.0])
    same = ref.compare(e, e)
    assert same["cosine"] == pytest.approx(1.0) and same["nrmse"] == 0 and same["max_abs"] == 0
    off = ref.compare(e + torch.tensor([0.0, 0.0, 0.5]), e)
    assert off["max_abs"] == pytest.approx(0.5)
    assert off["nrmse"] == pytest.approx(math.sqrt(0.25 / 3) / math.sqrt(14 / 3))
    assert ref.compare(-e, e)["cosine"] == pytest.approx(-1.0)
