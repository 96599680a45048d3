"""Unit tests of the numerical reference (converter/reference/), numpy only."""

from __future__ import annotations

import math

import numpy as np
import pytest
from kimi_w31.converter import reference as ref

# OCP MX e2m1, written out independently of the module's table.
E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]


def test_only_numpy_is_needed() -> None:
    import ast
    import inspect

    tree = ast.parse(inspect.getsource(ref))
    imported = {
        (node.module or "").split(".")[0] if isinstance(node, ast.ImportFrom) else alias.name
        for node in ast.walk(tree)
        if isinstance(node, (ast.Import, ast.ImportFrom))
        for alias in node.names
    }
    assert imported <= {"__future__", "collections", "dataclasses", "numpy"}, imported


def test_e2m1_table_every_code() -> None:
    codes = np.arange(16, dtype=np.uint8)
    packed = codes | (codes << 4)  # both nibbles = code
    values = ref.unpack_fp4(packed.reshape(16, 1))
    assert values.shape == (16, 2) and values.dtype == np.float32
    assert values[:, 0].tolist() == E2M1
    assert values[:, 1].tolist() == E2M1
    # -0.0 keeps its sign bit (code 8)
    assert math.copysign(1.0, float(values[8, 0])) == -1.0


def test_low_nibble_first() -> None:
    packed = np.array([[0x21, 0xF7]], dtype=np.uint8)
    assert ref.unpack_fp4(packed).tolist() == [[0.5, 1.0, 6.0, -6.0]]
    assert ref.unpack_fp4(packed, low_nibble_first=False).tolist() == [[1.0, 0.5, -6.0, 6.0]]


def test_e8m0_bytes() -> None:
    s = ref.e8m0_to_float(np.array([127, 128, 126, 0, 254, 0xFF], dtype=np.uint8))
    assert s.dtype == np.float32
    assert s[:3].tolist() == [1.0, 2.0, 0.5]
    assert float(s[3]) == 2.0**-127 and s[3] > 0  # byte 0 is a valid, tiny scale
    assert float(s[4]) == 2.0**127
    assert math.isnan(float(s[5]))
    # every non-NaN byte is exactly 2^(e-127)
    every = ref.e8m0_to_float(np.arange(255, dtype=np.uint8))
    assert [float(v) for v in every] == [2.0 ** (e - 127) for e in range(255)]


def test_dtype_checks() -> None:
    with pytest.raises(TypeError):
        ref.unpack_fp4(np.zeros((1, 1), dtype=np.int8))
    with pytest.raises(TypeError):
        ref.e8m0_to_float(np.zeros(1, dtype=np.int32))
    with pytest.raises(TypeError):
        ref.dequant_mxfp4(np.zeros((1, 16), dtype=np.uint8), np.zeros((1, 1), dtype=np.int32))


def test_dequant_applies_one_scale_per_group_of_32() -> None:
    packed = np.full((1, 32), 0x22, dtype=np.uint8)  # 64 values of 1.0
    scale = np.array([[128, 125]], dtype=np.uint8)  # 2.0 then 0.25
    w = ref.dequant_mxfp4(packed, scale)
    assert w.shape == (1, 64) and w.dtype == np.float32
    assert np.all(w[0, :32] == 2.0) and np.all(w[0, 32:] == 0.25)
    with pytest.raises(ValueError):
        ref.dequant_mxfp4(packed, np.zeros((1, 3), dtype=np.uint8))


def test_situ_hand_computed_value() -> None:
    g, u, beta, lb = 2.0, 10.0, 4.0, 25.0
    expected = (beta * math.tanh(g / beta) / (1 + math.exp(-g))) * (lb * math.tanh(u / lb))
    got = float(ref.situ(np.array([g]), np.array([u]), beta, lb)[0])
    assert got == pytest.approx(expected, rel=1e-6)
    assert got == pytest.approx(1.6281 * 9.4987, rel=1e-3)  # 4 tanh(.5) s(2) * 25 tanh(.4)


def test_situ_sigmoid_is_of_the_uncapped_gate() -> None:
    # For a huge gate, tanh saturates to beta and sigmoid -> 1: gate' -> beta exactly.
    out = float(ref.situ(np.array([100.0]), np.array([1.0]), 4.0, 25.0)[0])
    assert out == pytest.approx(4.0 * 25.0 * math.tanh(1 / 25), rel=1e-6)
    # A negative gate is damped by the sigmoid, not only capped.
    neg = float(ref.situ(np.array([-6.0]), np.array([1.0]), 4.0, 25.0)[0])
    assert neg == pytest.approx(4 * math.tanh(-1.5) / (1 + math.exp(6)) * 25 * math.tanh(0.04))
    # A very negative gate underflows to 0 without a warning turning into an error.
    with np.errstate(all="raise"):
        assert float(ref.situ(np.array([-200.0]), np.array([1.0]), 4.0, 25.0)[0]) == 0.0


def test_situ_gate_up_asymmetry() -> None:
    g, u = np.array([3.0, -2.0, 8.0]), np.array([-1.0, 5.0, 30.0])
    assert not np.allclose(ref.situ(g, u, 4.0, 25.0), ref.situ(u, g, 4.0, 25.0))
    # The up branch is capped at linear_beta, unlike SwiGLU's linear up.
    big_up = float(ref.situ(np.array([50.0]), np.array([1e4]), 4.0, 25.0)[0])
    assert big_up == pytest.approx(4.0 * 25.0, rel=1e-5)


def test_swiglu_control() -> None:
    g, u = np.array([1.0, -2.0], dtype=np.float32), np.array([3.0, 4.0], dtype=np.float32)
    want = g / (1 + np.exp(-g)) * u
    got = ref.swiglu(g, u)
    assert got.dtype == np.float32 and np.allclose(got, want, rtol=1e-6)


def test_split_w31_orders() -> None:
    up, gate = np.zeros((4, 3)), np.ones((4, 3))
    w31 = np.concatenate([up, gate])
    u, g = ref.split_w31(w31, ("up", "gate"))
    assert np.array_equal(u, up) and np.array_equal(g, gate)
    u, g = ref.split_w31(w31, ["gate", "up"])
    assert np.array_equal(u, gate) and np.array_equal(g, up)
    with pytest.raises(ValueError):
        ref.split_w31(w31, ("up", "up"))
    with pytest.raises(ValueError):
        ref.split_w31(np.zeros((5, 3)), ("up", "gate"))


def _random_mxfp4(rows: int, k: int, g: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    packed = g.integers(0, 256, (rows, k // 2), dtype=np.uint8)
    scale = g.integers(122, 126, (rows, k // 32), dtype=np.uint8)
    return packed, scale


def test_converted_equals_source_semantics() -> None:
    g = np.random.default_rng(0)
    w1, w3, w2 = _random_mxfp4(8, 64, g), _random_mxfp4(8, 64, g), _random_mxfp4(64, 32, g)
    w31 = (np.concatenate([w3[0], w1[0]]), np.concatenate([w3[1], w1[1]]))
    src = ref.dequant_expert(w1, w3, w2)
    conv = ref.dequant_converted_expert(w31, w2)
    assert np.array_equal(src.gate, conv.gate) and np.array_equal(src.up, conv.up)
    wrong = ref.dequant_converted_expert(w31, w2, fc1_order=("gate", "up"))
    assert not np.array_equal(src.gate, wrong.gate)


def _experts(n_exp: int, k: int = 64, n: int = 32, seed: int = 0) -> dict[int, ref.ExpertWeights]:
    g = np.random.default_rng(seed)
    return {
        e: ref.dequant_expert(
            _random_mxfp4(n, k, g), _random_mxfp4(n, k, g), _random_mxfp4(k, n, g)
        )
        for e in range(n_exp)
    }


def _randn(*shape: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


def _rand(*shape: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).random(shape).astype(np.float32)


def test_moe_forward_matches_explicit_sum() -> None:
    experts = _experts(3)
    x = _randn(2, 64, seed=1)
    ids = np.array([[0, 2], [1, 0]])
    w = np.array([[0.25, 0.75], [0.5, 0.5]], dtype=np.float32)
    out = ref.moe_forward(x, ids, w, experts, 4.0, 25.0)
    assert out.dtype == np.float32 and out.shape == (2, 64)
    for t in range(2):
        want = sum(
            w[t, j] * ref.expert_forward(x[t : t + 1], experts[int(ids[t, j])], 4.0, 25.0)
            for j in range(2)
        )
        assert np.allclose(out[t : t + 1], want, rtol=1e-5, atol=1e-4)


def test_moe_forward_negative_slot_contributes_nothing() -> None:
    experts = _experts(4)
    x = _randn(3, 64, seed=2)
    ids = np.array([[0, 1, 2], [3, 2, 1], [1, 0, 3]])
    w = _rand(3, 3, seed=3)
    masked = ids.copy()
    masked[:, 2] = -1
    full_masked = ref.moe_forward(x, masked, w, experts, 4.0, 25.0)
    dropped = ref.moe_forward(x, ids[:, :2], w[:, :2], experts, 4.0, 25.0)
    assert np.allclose(full_masked, dropped, rtol=1e-6, atol=1e-5)
    assert not np.allclose(full_masked, ref.moe_forward(x, ids, w, experts, 4.0, 25.0))


def test_moe_forward_ep_disjoint_sums() -> None:
    experts = _experts(4)
    x = _randn(5, 64, seed=4)
    ids = np.array([[0, 3], [1, 2], [2, 0], [3, 1], [0, 1]])
    w = _rand(5, 2, seed=5)
    full = ref.moe_forward(x, ids, w, experts, 4.0, 25.0)
    rank0 = ref.moe_forward(x, ids, w, {e: experts[e] for e in (0, 1)}, 4.0, 25.0)
    rank1 = ref.moe_forward(x, ids, w, {e: experts[e] for e in (2, 3)}, 4.0, 25.0)
    assert np.allclose(rank0 + rank1, full, rtol=1e-5, atol=1e-4)
    assert not np.allclose(rank0, full)


def test_moe_forward_activation_switch() -> None:
    experts = _experts(2)
    x = _randn(2, 64, seed=6)
    ids, w = np.array([[0, 1], [1, 0]]), np.full((2, 2), 0.5, dtype=np.float32)
    situ = ref.moe_forward(x, ids, w, experts, 4.0, 25.0, "situ")
    swiglu = ref.moe_forward(x, ids, w, experts, 4.0, 25.0, "swiglu")
    assert not np.allclose(situ, swiglu)
    with pytest.raises(ValueError):
        ref.moe_forward(x, ids, w, experts, 4.0, 25.0, "gelu")


def test_compare() -> None:
    e = np.array([1.0, 2.0, 3.0], dtype=np.float32)
    same = ref.compare(e, e)
    assert set(same) == {"cosine", "nrmse", "max_abs"}
    assert same["cosine"] == pytest.approx(1.0) and same["nrmse"] == 0 and same["max_abs"] == 0
    off = ref.compare(e + np.array([0.0, 0.0, 0.5], dtype=np.float32), e)
    assert off["max_abs"] == pytest.approx(0.5)
    assert off["nrmse"] == pytest.approx(math.sqrt(0.25 / 3) / math.sqrt(14 / 3))
    assert ref.compare(-e, e)["cosine"] == pytest.approx(-1.0)
    assert all(isinstance(v, float) for v in off.values())


# -- the known-answer self-test (docs/format.md section 11) -----------------------------------

_unpack, _e8m0 = ref.unpack_fp4, ref.e8m0_to_float


def _bias(bias: int):
    def e8m0(scale: np.ndarray) -> np.ndarray:
        s = np.asarray(scale)
        out = np.ldexp(np.ones(s.shape, dtype=np.float32), s.astype(np.int32) - bias)
        return np.where(s == 0xFF, np.float32(np.nan), out).astype(np.float32)

    return e8m0


# Wrong decoders: each computes the same wrong function on both sides of a comparison.
WRONG_DECODERS = {
    "swapped nibbles": (
        "unpack_fp4",
        lambda packed, low_nibble_first=True: _unpack(packed, not low_nibble_first),
    ),
    "scale bias 126": ("e8m0_to_float", _bias(126)),
    "scale bias 128": ("e8m0_to_float", _bias(128)),
    "e2m1 table off by one": ("_E2M1_LUT", np.roll(ref._E2M1_LUT, 1)),
}


def test_the_reference_passes_its_self_test() -> None:
    from kimi_w31.converter.reference import known_answers

    assert known_answers.self_test() == []


@pytest.mark.parametrize("wrong", sorted(WRONG_DECODERS))
def test_a_wrong_decoder_fails_the_self_test(monkeypatch, wrong) -> None:
    from kimi_w31.converter.reference import known_answers

    monkeypatch.setattr(ref, *WRONG_DECODERS[wrong])
    assert known_answers.self_test(), wrong


@pytest.mark.parametrize("wrong", ["swapped nibbles", "scale bias 126"])
def test_verify_numerics_refuses_a_wrong_decoder(monkeypatch, converted, small_source, wrong):
    """The comparison alone passes a wrong decoder (it agrees with itself); the self-test
    stops it before any expert is computed."""
    from kimi_w31.converter.audit import numerics, verify
    from kimi_w31.converter.reasons import Code

    monkeypatch.setattr(ref, *WRONG_DECODERS[wrong])
    self_test = numerics.self_test
    monkeypatch.setattr(numerics, "self_test", lambda: [])
    blind = verify(converted, source=str(small_source), numerics=True, sample=2)
    assert blind.check("numerics").ok is True, "source vs converted cannot see it"
    monkeypatch.setattr(numerics, "self_test", self_test)
    report = verify(converted, source=str(small_source), numerics=True, sample=2)
    check = report.check("numerics")
    assert check.ok is False and not report.ok
    assert {p.code for p in check.problems} == {Code.NUMERICS_SELF_TEST}


def test_verify_numerics_passes_with_the_right_decoder(converted, small_source) -> None:
    from kimi_w31.converter.audit import verify

    report = verify(converted, source=str(small_source), numerics=True, sample=2)
    assert report.ok and report.check("numerics").ok is True
