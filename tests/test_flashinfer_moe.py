"""CPU tests of adapter/flashinfer_moe.py against fake `flashinfer` modules.

The real kernel runs only on a GPU (gpu/harness.py; docs/gpu-validation.md); here we check
what the module decides and passes: the capability check, the SiTU tensors, the weight
preparation calls and every keyword argument of the `cutlass_fused_moe` call.
"""

from __future__ import annotations

import enum
import functools
import subprocess
import sys
import types

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from kimi_w31.adapter import flashinfer_moe as fm
from kimi_w31.adapter.reasons import AdapterCode

E, K, N = 4, 256, 128


class FakeActivationType(enum.IntEnum):
    Swiglu = 3
    Situ = 10


class NoSituActivationType(enum.IntEnum):
    Swiglu = 3


def _cutlass_with_situ(
    input,
    token_selected_experts,
    token_final_scales,
    fc1_expert_weights,  # noqa: A002
    fc2_expert_weights,
    output_dtype,
    quant_scales,
    fc1_expert_biases=None,
    fc2_expert_biases=None,
    input_sf=None,
    swiglu_alpha=None,
    swiglu_beta=None,
    swiglu_limit=None,
    tp_size=1,
    tp_rank=0,
    ep_size=1,
    ep_rank=0,
    output=None,
    use_w4_group_scaling=False,
    use_mxfp8_act_scaling=False,
    tune_max_num_tokens=8192,
    activation_type=FakeActivationType.Swiglu,
    use_fused_finalize=True,
    workspace_buffer=None,
    *,
    situ_beta=None,
    situ_linear_beta=None,
):
    raise AssertionError("replaced per test")


def _cutlass_without_situ(
    input,
    token_selected_experts,
    token_final_scales,  # noqa: A002
    fc1_expert_weights,
    fc2_expert_weights,
    output_dtype,
    quant_scales,
    activation_type=FakeActivationType.Swiglu,
):
    raise AssertionError("never called")


def _install_fake(
    monkeypatch, version: str, cutlass, activation_type=FakeActivationType, **extra
) -> types.SimpleNamespace:
    root = types.ModuleType("flashinfer")
    root.__version__ = version
    fused = types.ModuleType("flashinfer.fused_moe")
    fused.ActivationType = activation_type
    fused.cutlass_fused_moe = cutlass
    for name, fn in extra.items():
        setattr(fused if name.startswith("interleave") else root, name, fn)
    root.fused_moe = fused
    monkeypatch.setitem(sys.modules, "flashinfer", root)
    monkeypatch.setitem(sys.modules, "flashinfer.fused_moe", fused)
    return types.SimpleNamespace(root=root, fused=fused)


# --------------------------------------------------------------------------------------
# import and capability check
# --------------------------------------------------------------------------------------


def test_import_needs_no_flashinfer() -> None:
    code = (
        "import sys; sys.modules['flashinfer'] = None\n"  # any import of it would fail
        "import kimi_w31.adapter.flashinfer_moe as fm\n"
        "print(fm.situ_params(3)[0].tolist())"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[4.0, 4.0, 4.0]"


def test_support_with_situ_kwargs(monkeypatch) -> None:
    _install_fake(monkeypatch, "0.7.2.post1", _cutlass_with_situ)
    assert fm.check_situ_support() == "0.7.2.post1"


def test_support_follows_wrapped_signature(monkeypatch) -> None:
    @functools.wraps(_cutlass_with_situ)
    def api_logged(*args, **kwargs):  # FlashInfer wraps its API functions like this
        return _cutlass_with_situ(*args, **kwargs)

    _install_fake(monkeypatch, "0.7.0", api_logged)
    assert fm.check_situ_support() == "0.7.0"


def test_enum_alone_is_not_enough(monkeypatch) -> None:
    """0.6.16-0.6.18: ActivationType.Situ exists but CUTLASS has no SiTU kwargs."""
    _install_fake(monkeypatch, "0.6.18.post1", _cutlass_without_situ)
    with pytest.raises(fm.SituUnsupportedError) as err:
        fm.check_situ_support()
    assert err.value.reason == "situ-unsupported"
    msg = str(err.value)
    assert "0.6.18.post1" in msg
    assert "situ_beta" in msg and "situ_linear_beta" in msg
    assert "upgrade flashinfer-python" in msg and "--moe-runner-backend marlin" in msg
    assert "ActivationType.Situ" not in msg  # the enum is present; only the kwargs are missing


def test_missing_enum_is_reported(monkeypatch) -> None:
    _install_fake(monkeypatch, "0.6.10", _cutlass_with_situ, activation_type=NoSituActivationType)
    with pytest.raises(fm.SituUnsupportedError, match=r"0\.6\.10.*ActivationType\.Situ"):
        fm.check_situ_support()


def test_flashinfer_not_installed(monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "flashinfer", None)
    monkeypatch.setitem(sys.modules, "flashinfer.fused_moe", None)
    with pytest.raises(fm.SituUnsupportedError, match="cannot import") as err:
        fm.check_situ_support()
    assert err.value.codes == (AdapterCode.SITU_UNSUPPORTED.value,) and "marlin" in str(err.value)


# --------------------------------------------------------------------------------------
# SiTU tensors and shapes
# --------------------------------------------------------------------------------------


def test_situ_params_shapes_and_values() -> None:
    beta, linear = fm.situ_params(7)
    for t, value in ((beta, 4.0), (linear, 25.0)):
        assert t.dtype == torch.float32 and t.shape == (7,) and t.is_contiguous()
        assert torch.all(t == value)
    b2, l2 = fm.situ_params(2, beta=3.5, linear_beta=20.0, device="cpu")
    assert b2.tolist() == [3.5, 3.5] and l2.tolist() == [20.0, 20.0]


@pytest.mark.parametrize("args", [(0,), (3, 0.0), (3, 4.0, -1.0), (3, float("inf"))])
def test_situ_params_rejects(args) -> None:
    with pytest.raises(ValueError):
        fm.situ_params(*args)


def _tensors(e=E, k=K, n=N):
    u8 = torch.uint8
    return (
        torch.zeros(e, 2 * n, k // 2, dtype=u8),
        torch.zeros(e, 2 * n, k // 32, dtype=u8),
        torch.zeros(e, k, n // 2, dtype=u8),
        torch.zeros(e, k, n // 32, dtype=u8),
    )


def test_moe_dims() -> None:
    assert fm.moe_dims(*_tensors()) == fm.MoeDims(E, K, N)


def test_moe_dims_rejects_bad_layouts() -> None:
    w31p, w31s, w2p, w2s = _tensors()
    with pytest.raises(ValueError, match="w2_packed"):
        fm.moe_dims(w31p, w31s, w2p[:, :, :-1], w2s)
    with pytest.raises(ValueError, match="uint8"):
        fm.moe_dims(w31p.to(torch.int8), w31s, w2p, w2s)
    with pytest.raises(ValueError, match="multiples of 128"):
        fm.moe_dims(*_tensors(n=64))
    with pytest.raises(ValueError, match="odd row count"):
        fm.moe_dims(w31p[:, 1:], w31s[:, 1:], w2p, w2s)


# --------------------------------------------------------------------------------------
# weight preparation
# --------------------------------------------------------------------------------------


def test_prepare_sm90_calls_the_mixed_gemm_interleaves(monkeypatch) -> None:
    calls = []

    def weights(w, quant_type):
        calls.append(("w", tuple(w.shape), quant_type))
        return w + 1

    def scales(s, group_size):
        calls.append(("s", tuple(s.shape), group_size))
        return s.reshape(s.shape[0], -1)  # some other layout, same bytes count

    _install_fake(
        monkeypatch,
        "0.7.2",
        _cutlass_with_situ,
        interleave_moe_weights_for_sm90_mixed_gemm=weights,
        interleave_moe_scales_for_sm90_mixed_gemm=scales,
    )
    w31p, w31s, w2p, w2s = _tensors()
    p = fm.prepare_sm90(w31p, w31s, w2p, w2s)
    assert calls == [
        ("w", (E, 2 * N, K // 2), "fp4"),
        ("w", (E, K, N // 2), "fp4"),
        ("s", (E, 2 * N, K // 32), 32),
        ("s", (E, K, N // 32), 32),
    ]
    assert p.arch == "sm90" and p.dims == fm.MoeDims(E, K, N)
    assert torch.all(p.fc1 == 1) and torch.all(p.fc2 == 1)  # the interleaved tensors are used
    assert [s.dtype for s in p.quant_scales] == [torch.int32, torch.int32]
    assert p.quant_scales[0].numel() * 4 == w31s.numel()


def test_prepare_sm120_swizzles_scales_only(monkeypatch) -> None:
    seen = []

    def block_scale_interleave(s):
        seen.append(tuple(s.shape))
        return (s.flatten() + 7).contiguous()  # FlashInfer returns a flat buffer

    _install_fake(
        monkeypatch, "0.7.2", _cutlass_with_situ, block_scale_interleave=block_scale_interleave
    )
    w31p, w31s, w2p, w2s = _tensors()
    w31p[0, 0, 0] = 0x21
    p = fm.prepare_sm120(w31p, w31s, w2p, w2s)
    assert seen == [(E, 2 * N, K // 32), (E, K, N // 32)]
    assert p.fc1.dtype == torch.int64 and torch.equal(p.fc1.view(torch.uint8), w31p)
    assert len(p.quant_scales) == 4
    s1, gs1, s2, gs2 = p.quant_scales
    assert s1.dtype == torch.int32 and torch.all(s1.view(torch.uint8) == 7)
    assert gs1 is gs2 and gs1.tolist() == [1.0] * E


def test_prepare_weights_dispatch() -> None:
    with pytest.raises(ValueError, match="sm100"):
        fm.prepare_weights("sm100", *_tensors())  # type: ignore[arg-type]


# --------------------------------------------------------------------------------------
# the call
# --------------------------------------------------------------------------------------


def _prepared(arch: fm.Arch = "sm90", e: int = E) -> fm.PreparedMoeWeights:
    w31p, w31s, w2p, w2s = _tensors(e)
    scales = (w31s.view(torch.int32), w2s.view(torch.int32))
    if arch == "sm120":
        ones = torch.ones(e)
        scales = (scales[0], ones, scales[1], ones)
    return fm.PreparedMoeWeights(arch, fm.MoeDims(e, K, N), w31p, w2p, scales)


def _routing(m: int = 3, top_k: int = 2):
    return (
        torch.zeros(m, K, dtype=torch.bfloat16),
        torch.zeros(m, top_k, dtype=torch.int32),
        torch.full((m, top_k), 0.5),
    )


def test_kwargs_sm90_situ() -> None:
    x, ids, w = _routing()
    beta, linear = fm.situ_params(E)
    out = torch.empty(3, K, dtype=torch.bfloat16)
    kw = fm.build_moe_kwargs(
        x,
        ids,
        w,
        _prepared(),
        FakeActivationType.Situ,
        situ_beta=beta,
        situ_linear_beta=linear,
        output=out,
        tp_size=2,
        tp_rank=1,
        ep_size=4,
        ep_rank=3,
        use_fused_finalize=False,
    )
    assert kw["activation_type"] is FakeActivationType.Situ
    assert kw["situ_beta"] is beta and kw["situ_linear_beta"] is linear
    assert kw["swiglu_alpha"] is kw["swiglu_beta"] is kw["swiglu_limit"] is None
    assert kw["fc1_expert_biases"] is kw["fc2_expert_biases"] is None
    assert kw["use_w4_group_scaling"] is True and kw["use_mxfp8_act_scaling"] is False
    assert kw["input_sf"] is None and kw["output"] is out and kw["output_dtype"] == torch.bfloat16
    assert (kw["tp_size"], kw["tp_rank"], kw["ep_size"], kw["ep_rank"]) == (2, 1, 4, 3)
    assert kw["use_fused_finalize"] is False
    assert kw["token_selected_experts"] is ids and kw["token_final_scales"] is w
    assert isinstance(kw["quant_scales"], list) and len(kw["quant_scales"]) == 2


def test_kwargs_sm120_uses_mxfp8_activations() -> None:
    x, ids, w = _routing()
    sf = torch.zeros(16, dtype=torch.uint8)
    kw = fm.build_moe_kwargs(
        x,
        ids,
        w,
        _prepared("sm120"),
        FakeActivationType.Situ,
        situ_beta=None,
        situ_linear_beta=None,
        output=None,
        input_sf=sf,
    )
    assert kw["use_mxfp8_act_scaling"] is True and kw["use_w4_group_scaling"] is False
    assert kw["input_sf"] is sf and len(kw["quant_scales"]) == 4
    with pytest.raises(ValueError, match="input_sf"):
        fm.build_moe_kwargs(
            x,
            ids,
            w,
            _prepared("sm120"),
            FakeActivationType.Situ,
            situ_beta=None,
            situ_linear_beta=None,
            output=None,
        )


@pytest.mark.parametrize(
    "change, match",
    [
        ({"ids": torch.zeros(3, 2, dtype=torch.int64)}, "int32"),
        ({"w": torch.zeros(3, 2, dtype=torch.bfloat16)}, "float32"),
        ({"w": torch.zeros(3, 3)}, "top_k"),
        ({"x": torch.zeros(4, K, dtype=torch.bfloat16)}, "M = 3"),
        ({"beta": torch.full((2 * E,), 4.0)}, "local experts"),  # global length under EP
        ({"beta": torch.full((E,), 4.0, dtype=torch.float64)}, "float32"),
        ({"ep_rank": 2}, "ranks"),
        ({"input_sf": torch.zeros(1)}, "bf16 activations"),
    ],
)
def test_kwargs_reject(change, match) -> None:
    x, ids, w = _routing()
    args = {"x": x, "ids": ids, "w": w, "beta": None, "ep_rank": 0, "input_sf": None, **change}
    with pytest.raises(ValueError, match=match):
        fm.build_moe_kwargs(
            args["x"],
            args["ids"],
            args["w"],
            _prepared(),
            FakeActivationType.Situ,
            situ_beta=args["beta"],
            situ_linear_beta=None,
            output=None,
            ep_size=2,
            ep_rank=args["ep_rank"],
            input_sf=args["input_sf"],
        )


def test_run_situ_moe_passes_situ_and_returns_the_output(monkeypatch) -> None:
    seen = {}
    result = torch.ones(3, K, dtype=torch.bfloat16)

    def kernel(**kwargs):
        seen.update(kwargs)
        return [result, torch.zeros(1)]  # FlashInfer returns [output, *min-latency tensors]

    _install_fake(monkeypatch, "0.7.2", kernel)
    x, ids, w = _routing()
    beta, linear = fm.situ_params(E)
    out = fm.run_situ_moe(x, ids, w, _prepared(), beta, linear, ep_size=2, ep_rank=1)
    assert out is result
    assert seen["activation_type"] is FakeActivationType.Situ
    assert seen["situ_beta"] is beta and seen["situ_linear_beta"] is linear
    assert (seen["ep_size"], seen["ep_rank"]) == (2, 1)
    assert seen["use_w4_group_scaling"] is True


def test_run_swiglu_control(monkeypatch) -> None:
    seen = {}
    _install_fake(monkeypatch, "0.7.2", lambda **kw: seen.update(kw) or [torch.zeros(1)])
    x, ids, w = _routing()
    fm.run_situ_moe(x, ids, w, _prepared(), None, None, activation="swiglu")
    assert seen["activation_type"] is FakeActivationType.Swiglu
    assert seen["situ_beta"] is None and seen["swiglu_alpha"] is None
    with pytest.raises(ValueError, match="no SiTU parameters"):
        fm.run_situ_moe(x, ids, w, _prepared(), *fm.situ_params(E), activation="swiglu")
    with pytest.raises(ValueError, match="unknown activation"):
        fm.run_situ_moe(x, ids, w, _prepared(), None, None, activation="gelu")  # type: ignore[arg-type]  # noqa: E501


def test_run_sm90_rejects_non_bf16(monkeypatch) -> None:
    _install_fake(monkeypatch, "0.7.2", lambda **kw: [torch.zeros(1)])
    _, ids, w = _routing()
    with pytest.raises(ValueError, match="bf16"):
        fm.run_situ_moe(torch.zeros(3, K), ids, w, _prepared(), None, None)


def test_kwargs_bind_to_the_real_signature() -> None:
    """Every keyword we pass exists in the installed FlashInfer's cutlass_fused_moe."""
    flashinfer_moe = pytest.importorskip("flashinfer.fused_moe", reason="flashinfer not installed")
    import inspect

    x, ids, w = _routing()
    kw = fm.build_moe_kwargs(
        x,
        ids,
        w,
        _prepared(),
        flashinfer_moe.ActivationType.Situ,
        situ_beta=None,
        situ_linear_beta=None,
        output=None,
    )
    inspect.signature(flashinfer_moe.cutlass_fused_moe).bind(**kw)


# --------------------------------------------------------------------------------------
# SM90 W4A8 (Humming)
# --------------------------------------------------------------------------------------


def test_prepare_sm90_humming_fills_the_five_slots(monkeypatch) -> None:
    calls = []

    def humming(w, s):
        calls.append((tuple(w.shape), tuple(s.shape)))
        e = w.shape[0]
        return w + 1, s.reshape(e, -1), torch.arange(e, dtype=torch.float32) + 0.5

    env = _install_fake(monkeypatch, "0.7.2", _cutlass_with_situ)
    env.fused.preprocess_moe_weights_for_sm90_mixed_gemm_humming = humming
    w31p, w31s, w2p, w2s = _tensors()
    p = fm.prepare_sm90_humming(w31p, w31s, w2p, w2s)
    assert calls == [((E, 2 * N, K // 2), (E, 2 * N, K // 32)), ((E, K, N // 2), (E, K, N // 32))]
    assert p.humming and p.arch == "sm90" and p.dims == fm.MoeDims(E, K, N)
    s1, r1, act, s2, r2 = p.quant_scales
    assert s1.dtype == s2.dtype == torch.int32 and s1.numel() * 4 == w31s.numel()
    want = (torch.arange(E, dtype=torch.float32) + 0.5) * 64.0  # Humming's 2^6 compensation
    assert torch.equal(r1, want) and torch.equal(r2, want)
    assert act.shape == () and act.item() == 1.0 and act.dtype == torch.float32
    assert torch.all(p.fc1 == 1) and torch.all(p.fc2 == 1)
    raw = fm.prepare_sm90_humming(w31p, w31s, w2p, w2s, residual_factor=1.0)
    assert torch.equal(raw.quant_scales[1], want / 64.0)


def test_kwargs_name_humming_only_for_humming_weights() -> None:
    x, ids, w = _routing()
    base = _prepared()
    hum = fm.PreparedMoeWeights(
        "sm90",
        base.dims,
        base.fc1,
        base.fc2,
        (*base.quant_scales, torch.ones(()), *base.quant_scales[:2]),
        humming=True,
    )
    plain = fm.build_moe_kwargs(
        x,
        ids,
        w,
        base,
        FakeActivationType.Situ,
        situ_beta=None,
        situ_linear_beta=None,
        output=None,
    )
    kw = fm.build_moe_kwargs(
        x,
        ids,
        w,
        hum,
        FakeActivationType.Situ,
        situ_beta=None,
        situ_linear_beta=None,
        output=None,
    )
    assert "use_wfp4afp8_humming" not in plain
    assert kw["use_wfp4afp8_humming"] is True and len(kw["quant_scales"]) == 5
    assert kw["use_w4_group_scaling"] is True and kw["input_sf"] is None


def test_humming_kwargs_bind_to_the_real_signature() -> None:
    flashinfer_moe = pytest.importorskip("flashinfer.fused_moe", reason="flashinfer not installed")
    import inspect

    x, ids, w = _routing()
    base = _prepared()
    hum = fm.PreparedMoeWeights("sm90", base.dims, base.fc1, base.fc2, base.quant_scales, True)
    kw = fm.build_moe_kwargs(
        x,
        ids,
        w,
        hum,
        flashinfer_moe.ActivationType.Situ,
        situ_beta=None,
        situ_linear_beta=None,
        output=None,
    )
    inspect.signature(flashinfer_moe.cutlass_fused_moe).bind(**kw)
    assert hasattr(flashinfer_moe, "preprocess_moe_weights_for_sm90_mixed_gemm_humming")


# --------------------------------------------------------------------------------------
# W4A8 preparation in chunks of experts (bounded temporaries)
# --------------------------------------------------------------------------------------


def _per_expert_prep(calls: list[int]):
    """A stand-in with the real preprocessing's contract: every output is a function of one
    expert's own payload and scales (its E8M0 range clamp), never of another expert's."""

    def prep(w: torch.Tensor, s: torch.Tensor):
        calls.append(w.shape[0])
        e = w.shape[0]
        hi = s.reshape(e, -1).max(dim=1).values
        lo = torch.maximum(s.reshape(e, -1).min(dim=1).values, hi - 11)
        folded = (torch.maximum(s, lo[:, None, None]) - lo[:, None, None]).to(torch.uint8)
        payload = w ^ (hi - lo).to(torch.uint8)[:, None, None]
        residual = torch.exp2(lo.float() - 127.0) * 0.5
        return payload.reshape(e, -1, 16), folded.reshape(e, -1), residual

    return prep


@given(
    e=st.integers(1, 13),
    rows=st.sampled_from([2, 4, 8]),
    kb=st.sampled_from([16, 32]),
    chunk=st.integers(1, 16),
    seed=st.integers(0, 2**16),
)
@settings(max_examples=60, deadline=None)
def test_chunked_preparation_equals_one_call(e, rows, kb, chunk, seed) -> None:
    g = torch.Generator().manual_seed(seed)
    w = torch.randint(0, 256, (e, rows, kb), generator=g, dtype=torch.uint8)
    s = torch.randint(100, 140, (e, rows, kb * 2 // 32), generator=g, dtype=torch.uint8)
    calls: list[int] = []
    whole = fm.map_expert_chunks(_per_expert_prep(calls), w, s, e)
    assert calls == [e]
    calls.clear()
    chunked = fm.map_expert_chunks(_per_expert_prep(calls), w, s, chunk)
    assert sum(calls) == e and max(calls) <= chunk and len(calls) == -(-e // chunk)
    for a, b in zip(whole, chunked, strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)


@given(
    per_expert=st.integers(1, 1 << 26),
    budget=st.integers(1, 1 << 34),
    factor=st.integers(1, 64),
)
def test_experts_per_chunk_keeps_the_transient_within_the_budget(per_expert, budget, factor):
    n = fm.experts_per_chunk(per_expert, budget, factor)
    assert n >= 1
    # within the budget, or a single expert (the smallest unit) ...
    assert n * per_expert * factor <= budget or n == 1
    # ... and as large as the budget allows
    assert (n + 1) * per_expert * factor > budget


@pytest.mark.parametrize("bad", [(0, 1, 1), (1, 0, 1), (1, 1, 0), (-5, 1 << 30, 40)])
def test_experts_per_chunk_rejects_non_positive_sizes(bad) -> None:
    with pytest.raises(ValueError):
        fm.experts_per_chunk(*bad)


def test_prepare_sm90_humming_chunks_within_the_budget(monkeypatch) -> None:
    """Through the adapter's entry point: the budget decides the chunks of each tensor, and
    the result is the one-call result byte for byte."""
    calls: list[int] = []
    env = _install_fake(monkeypatch, "0.7.2", _cutlass_with_situ)
    env.fused.preprocess_moe_weights_for_sm90_mixed_gemm_humming = _per_expert_prep(calls)
    e = 7
    g = torch.Generator().manual_seed(3)
    w31p, w31s, w2p, w2s = (
        torch.randint(0, 256, t.shape, generator=g, dtype=torch.uint8) for t in _tensors(e=e)
    )
    whole = fm.prepare_sm90_humming(w31p, w31s, w2p, w2s, budget=1 << 62)
    assert calls == [e, e]
    calls.clear()
    fc1_expert = 2 * N * K // 2  # packed bytes of one expert's fc1
    budget = 3 * fc1_expert * fm.HUMMING_PREP_BYTES_PER_PACKED_BYTE
    chunked = fm.prepare_sm90_humming(w31p, w31s, w2p, w2s, budget=budget)
    # fc1: 3 experts a call; fc2 (half the bytes): 6
    assert calls == [3, 3, 1, 6, 1]
    for a, b in zip(
        (whole.fc1, whole.fc2, *whole.quant_scales),
        (chunked.fc1, chunked.fc2, *chunked.quant_scales),
        strict=True,
    ):
        assert torch.equal(a, b)
