"""The one FlashInfer-facing module: SiTU capability check, weight preparation, the MoE call.

Everything that touches FlashInfer's CUTLASS fused MoE for a converted Kimi-K3 checkpoint
lives here, free of SGLang imports, so that the SGLang method and the GPU harness run the
same code. FlashInfer is imported lazily inside functions: importing this module works
without FlashInfer installed (CPU tests, converter-only installs).

Layout contract (see the design notes): per local expert, fc1 ("w31") is `[up; gate]`,
i.e. rows [0, N) are w3 (up) and rows [N, 2N) are w1 (gate), MXFP4 packed two e2m1 values
per byte (low nibble first) with one E8M0 byte per 32 elements along K. FlashInfer's gated
kernels read the first half of the fc1 output as the linear branch and the second half as
the gate, so the converted tensor is used as is: no reorder, no de-interleave.

Shapes (E = local experts, K = hidden size of the expert input, N = intermediate size):

    w31_packed [E, 2N, K/2] u8     w31_scale [E, 2N, K/32] u8
    w2_packed  [E, K, N/2]  u8     w2_scale  [E, K, N/32]  u8
"""

from __future__ import annotations

import inspect
import logging
from dataclasses import dataclass
from typing import Any, Literal

import torch

from ..converter.errors import fatal
from .arch import Arch, arch_name, is_served
from .reasons import AdapterCode
from .refused import Refused

SITU_BETA = 4.0
SITU_LINEAR_BETA = 25.0
GROUP_SIZE = 32
# The SM90 mixed-input GEMM and the SM120 block-scale swizzle work on 128-wide tiles; K3's
# real dims (K 3584, N 3072 / tp) satisfy this, so no padding path exists here: refuse instead.
ALIGNMENT = 128

Activation = Literal["situ", "swiglu"]

_SITU_KWARGS = ("situ_beta", "situ_linear_beta")


_INSTALL = "pip install '.[sglang]'"
logger = logging.getLogger("kimi_w31.adapter")


class SituUnsupportedError(Refused, RuntimeError):
    """The installed FlashInfer cannot run the CUTLASS fused MoE with the SiTU activation."""


def _broken(exc: BaseException) -> SituUnsupportedError:
    return SituUnsupportedError(
        fatal(AdapterCode.SITU_UNSUPPORTED, rule="broken", error=exc, install=_INSTALL)
    )


# --------------------------------------------------------------------------------------
# Capability check
# --------------------------------------------------------------------------------------


def check_situ_support() -> str:
    """Return FlashInfer's version if its CUTLASS fused MoE supports SiTU; raise otherwise.

    The enum alone is not enough: flashinfer-python 0.6.16-0.6.18 define
    `ActivationType.Situ` (for TRT-LLM-gen) but their CUTLASS MoE rejects it at the first
    forward. CUTLASS SiTU arrived together with the keyword arguments `situ_beta` and
    `situ_linear_beta` of `cutlass_fused_moe`, and the Python wrapper ships in the same
    wheel as the C++ it JIT-compiles, so the signature is the reliable witness.

    Raises:
        SituUnsupportedError: naming the installed version, what is missing, and the two
            ways out (upgrade flashinfer-python, or `--moe-runner-backend marlin`).
    """
    try:
        import flashinfer
        from flashinfer.fused_moe import ActivationType, cutlass_fused_moe
    except ModuleNotFoundError as exc:
        if (exc.name or "").split(".")[0] != "flashinfer":
            raise _broken(exc) from exc
        raise SituUnsupportedError(
            fatal(AdapterCode.SITU_UNSUPPORTED, rule="not-installed", install=_INSTALL)
        ) from exc
    except Exception as exc:  # installed but broken (missing CUDA libs, ...)
        raise _broken(exc) from exc
    version = str(getattr(flashinfer, "__version__", "unknown"))
    missing: list[str] = []
    if not hasattr(ActivationType, "Situ"):
        missing.append("ActivationType.Situ")
    try:
        params = inspect.signature(cutlass_fused_moe).parameters  # follows __wrapped__
    except (TypeError, ValueError):  # a C function or odd wrapper: cannot prove support
        params = {}
    missing += [f"cutlass_fused_moe({name}=...)" for name in _SITU_KWARGS if name not in params]
    if missing:
        raise SituUnsupportedError(
            fatal(
                AdapterCode.SITU_UNSUPPORTED,
                rule="missing",
                version=version,
                missing=", ".join(missing),
            )
        )
    return version


def check_humming_support() -> str:
    """Like `check_situ_support`, for SM90 W4A8 "Humming" too: FlashInfer must have the
    Humming weight preprocessing and the `use_wfp4afp8_humming` keyword."""
    version = check_situ_support()
    import flashinfer.fused_moe as fused

    missing = []
    if not hasattr(fused, "preprocess_moe_weights_for_sm90_mixed_gemm_humming"):
        missing.append("preprocess_moe_weights_for_sm90_mixed_gemm_humming")
    try:
        params = inspect.signature(fused.cutlass_fused_moe).parameters
    except (TypeError, ValueError):
        params = {}
    if "use_wfp4afp8_humming" not in params:
        missing.append("cutlass_fused_moe(use_wfp4afp8_humming=...)")
    if missing:
        raise SituUnsupportedError(
            fatal(
                AdapterCode.SITU_UNSUPPORTED,
                rule="humming",
                version=version,
                missing=", ".join(missing),
            )
        )
    return version


# --------------------------------------------------------------------------------------
# SiTU parameter tensors
# --------------------------------------------------------------------------------------


def situ_params(
    num_local_experts: int,
    beta: float = SITU_BETA,
    linear_beta: float = SITU_LINEAR_BETA,
    device: torch.device | str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-local-expert fp32 `(situ_beta, situ_linear_beta)` tensors of shape [E_local].

    FlashInfer requires them 1-D, float32, contiguous, on the input's device, with length
    `fc2_expert_weights.size(0)` (the LOCAL expert count under EP). Allocate once at load
    time and keep them: the call then allocates nothing for them (CUDA-graph safe).
    """
    if num_local_experts <= 0:
        raise ValueError(f"num_local_experts must be positive, got {num_local_experts}")
    for name, value in (("beta", beta), ("linear_beta", linear_beta)):
        if not (value > 0.0 and value != float("inf")):
            raise ValueError(f"SiTU {name} must be a positive finite number, got {value!r}")
    shape = (num_local_experts,)
    return (
        torch.full(shape, float(beta), dtype=torch.float32, device=device),
        torch.full(shape, float(linear_beta), dtype=torch.float32, device=device),
    )


# --------------------------------------------------------------------------------------
# The module: the plugin's own FlashInfer kernels (kernels.py)
# --------------------------------------------------------------------------------------


def use_plugin_kernels(arch: Arch, humming: bool = False) -> None:
    """Before this process first uses FlashInfer's fused-MoE module: route it to the plugin's
    module for the serving path (only its runner; from the `KIMI_W31_KERNELS` bundle when
    set, refused with `bundle.BundleError` if that does not match this stack). Called by
    every `prepare_*`; idempotent. A FlashInfer without the lookup this relies on keeps its
    stock module (correct, only a longer first build), with a warning."""
    from . import kernels

    try:
        from flashinfer.fused_moe import core

        core.get_cutlass_fused_moe_module.cache_clear  # noqa: B018  the hook point must exist
    except (ImportError, AttributeError) as exc:
        logger.warning(
            "kimi_w31: cannot route FlashInfer's fused-MoE module to the plugin's (%r); "
            "FlashInfer will build its whole module on first use",
            exc,
        )
        return
    kernels.ensure(arch, humming)


# --------------------------------------------------------------------------------------
# Weight preparation
# --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class MoeDims:
    """Per-rank MoE dimensions read off the packed tensors."""

    num_local_experts: int
    hidden_size: int  # K
    intermediate_size: int  # N (per TP rank)


@dataclass(frozen=True)
class PreparedMoeWeights:
    """Kernel-ready weights for one MoE layer on one rank.

    `fc1`/`fc2` are what `cutlass_fused_moe` takes as fc1/fc2_expert_weights and
    `quant_scales` the list it takes as quant_scales, both built once at load time.
    """

    arch: Arch
    dims: MoeDims
    fc1: torch.Tensor
    fc2: torch.Tensor
    quant_scales: tuple[torch.Tensor, ...]
    # SM90 W4A8 "Humming": FP8 activations quantized in the kernel (five quant-scale slots).
    humming: bool = False


def moe_dims(
    w31_packed: torch.Tensor,
    w31_scale: torch.Tensor,
    w2_packed: torch.Tensor,
    w2_scale: torch.Tensor,
) -> MoeDims:
    """Check the four expert tensors against the layout contract and return the dims.

    Raises ValueError on a dtype/shape mismatch or when K or N is not a multiple of 128
    (the kernels' tile; K3's real dims always are, so there is no padding path).
    """
    for name, t in (
        ("w31_packed", w31_packed),
        ("w31_scale", w31_scale),
        ("w2_packed", w2_packed),
        ("w2_scale", w2_scale),
    ):
        if t.dtype != torch.uint8:
            raise ValueError(f"{name} must be uint8 (packed FP4 / E8M0), got {t.dtype}")
        if t.dim() != 3:
            raise ValueError(f"{name} must be 3-D [E, rows, cols], got {tuple(t.shape)}")
    e, two_n, k_half = w31_packed.shape
    if two_n % 2:
        raise ValueError(f"w31 has an odd row count {two_n}: not an [up; gate] pair")
    n, k = two_n // 2, k_half * 2
    expected = {
        "w31_scale": (e, two_n, k // GROUP_SIZE),
        "w2_packed": (e, k, n // 2),
        "w2_scale": (e, k, n // GROUP_SIZE),
    }
    actual = {
        "w31_scale": tuple(w31_scale.shape),
        "w2_packed": tuple(w2_packed.shape),
        "w2_scale": tuple(w2_scale.shape),
    }
    bad = [f"{k_}: {actual[k_]} != {v}" for k_, v in expected.items() if actual[k_] != v]
    if bad:
        raise ValueError(f"expert tensor shapes disagree with w31 {(e, two_n, k_half)}: {bad}")
    if k % ALIGNMENT or n % ALIGNMENT:
        raise ValueError(
            f"K={k} and N={n} must be multiples of {ALIGNMENT} for the CUTLASS MXFP4 MoE "
            "(no padding path: Kimi-K3's dims always are)"
        )
    return MoeDims(num_local_experts=e, hidden_size=k, intermediate_size=n)


def prepare_sm90(
    w31_packed: torch.Tensor,
    w31_scale: torch.Tensor,
    w2_packed: torch.Tensor,
    w2_scale: torch.Tensor,
) -> PreparedMoeWeights:
    """SM90 W4A16 (bf16 activations x MXFP4 weights): FlashInfer's mixed-GEMM interleaves.

    Weights go through `interleave_moe_weights_for_sm90_mixed_gemm(w, "fp4")` (a CUDA op:
    inputs must be on the GPU) and scales through
    `interleave_moe_scales_for_sm90_mixed_gemm(s, group_size=32)`, exactly as SGLang's SM90
    path does, minus its gate/up reorder (the converted w31 is already `[up; gate]`).
    Returns new tensors; the caller may free the inputs.
    """
    from flashinfer.fused_moe import (
        interleave_moe_scales_for_sm90_mixed_gemm,
        interleave_moe_weights_for_sm90_mixed_gemm,
    )

    dims = moe_dims(w31_packed, w31_scale, w2_packed, w2_scale)
    use_plugin_kernels("sm90")
    fc1 = interleave_moe_weights_for_sm90_mixed_gemm(w31_packed.contiguous(), "fp4")
    fc2 = interleave_moe_weights_for_sm90_mixed_gemm(w2_packed.contiguous(), "fp4")
    s1 = interleave_moe_scales_for_sm90_mixed_gemm(w31_scale.contiguous(), group_size=GROUP_SIZE)
    s2 = interleave_moe_scales_for_sm90_mixed_gemm(w2_scale.contiguous(), group_size=GROUP_SIZE)
    # The kernel reads scales as int32 words (4 E8M0 bytes each); a view, not a copy.
    scales = (s1.view(torch.int32), s2.view(torch.int32))
    return PreparedMoeWeights(arch="sm90", dims=dims, fc1=fc1, fc2=fc2, quant_scales=scales)


# Humming keeps a fixed 2^6 FP4 -> FP8 exponent-bias compensation out of the folded weight
# scales; FlashInfer takes it multiplied into the per-local-expert residual scales.
HUMMING_RESIDUAL_FACTOR = 64.0

# FlashInfer's Humming weight preprocessing holds about 38 bytes of temporaries per packed
# weight byte it is given (the FP4 codes and the per-code scale deltas widened to int64, the
# LUT gather, the interleave): 22 GiB for one layer's fc1 at 56 experts x N 3072, more than a
# 16xH200 rank has left. Its E8M0 range clamp, residual and payload rewrite are per expert
# (FlashInfer: "computes this range clamp independently per expert"), so it runs on chunks of
# experts written into preallocated outputs, bit for bit what one call gives. BOUND: besides
# the outputs (as many bytes as the packed weights and scales), the transient is at most
# max(HUMMING_PREP_BUDGET, HUMMING_PREP_BYTES_PER_PACKED_BYTE x one expert's packed bytes):
# 1 GiB for every Kimi-K3 shape (one whole expert's fc1 is 11 MB, x 40 = 440 MB).
HUMMING_PREP_BYTES_PER_PACKED_BYTE = 40  # 38 measured, with some slack
HUMMING_PREP_BUDGET = 1 << 30


def experts_per_chunk(
    per_expert_packed_bytes: int,
    budget: int = HUMMING_PREP_BUDGET,
    bytes_per_packed_byte: int = HUMMING_PREP_BYTES_PER_PACKED_BYTE,
) -> int:
    """How many experts one preprocessing call may take within `budget` bytes of temporaries
    (at least one: a single expert is the smallest unit the preprocessing takes)."""
    if per_expert_packed_bytes <= 0 or budget <= 0 or bytes_per_packed_byte <= 0:
        raise ValueError(
            f"sizes must be positive: {per_expert_packed_bytes=}, {budget=}, "
            f"{bytes_per_packed_byte=}"
        )
    return max(1, budget // (bytes_per_packed_byte * per_expert_packed_bytes))


def map_expert_chunks(
    fn: Any, packed: torch.Tensor, scale: torch.Tensor, chunk: int
) -> tuple[torch.Tensor, ...]:
    """`fn(packed, scale)` over chunks of at most `chunk` experts (dim 0), with every output
    concatenated along dim 0 into one tensor allocated once. Equals `fn` on the whole only
    for an `fn` that treats each expert on its own, as Humming's preprocessing does."""
    e = packed.shape[0]
    if chunk <= 0:
        raise ValueError(f"chunk must be positive, got {chunk}")
    if chunk >= e:
        return tuple(fn(packed.contiguous(), scale.contiguous()))
    outs: list[torch.Tensor] = []
    for start in range(0, e, chunk):
        stop = min(start + chunk, e)
        parts = fn(packed[start:stop].contiguous(), scale[start:stop].contiguous())
        if not outs:
            outs = [torch.empty((e, *p.shape[1:]), dtype=p.dtype, device=p.device) for p in parts]
        for out, part in zip(outs, parts, strict=True):
            out[start:stop].copy_(part)
        del parts  # free this chunk's temporaries before the next call allocates its own
    return tuple(outs)


def _humming_prep_bounded(
    prep: Any, packed: torch.Tensor, scale: torch.Tensor, budget: int
) -> tuple[torch.Tensor, ...]:
    per_expert = packed[0].numel() * packed.element_size() if packed.shape[0] else 1
    return map_expert_chunks(prep, packed, scale, experts_per_chunk(per_expert, budget))


def prepare_sm90_humming(
    w31_packed: torch.Tensor,
    w31_scale: torch.Tensor,
    w2_packed: torch.Tensor,
    w2_scale: torch.Tensor,
    *,
    residual_factor: float = HUMMING_RESIDUAL_FACTOR,
    budget: int = HUMMING_PREP_BUDGET,
) -> PreparedMoeWeights:
    """SM90 W4A8 (FP8 activations x MXFP4 weights, Humming pre-MMA E8M0 scale folding).

    `preprocess_moe_weights_for_sm90_mixed_gemm_humming` rewrites each expert's FP4 payload
    and folds its scales (per-expert E8M0 range clamp), returning one fp32 residual per
    local expert; FlashInfer's quant-scale slots are then
    `[fc1 folded scales, fc1 residual x 64, fc2 activation scale (1), fc2 folded scales,
    fc2 residual x 64]`, as SGLang builds them for its SwiGLU models. The fc1 order stays
    `[up; gate]`. Prepared in chunks of experts so that the preprocessing's temporaries stay
    within `budget` (see HUMMING_PREP_BUDGET). `residual_factor` exists for the negative
    control only.
    """
    from flashinfer.fused_moe import preprocess_moe_weights_for_sm90_mixed_gemm_humming as prep

    dims = moe_dims(w31_packed, w31_scale, w2_packed, w2_scale)
    use_plugin_kernels("sm90", humming=True)
    fc1, s1, r1 = _humming_prep_bounded(prep, w31_packed, w31_scale, budget)
    fc2, s2, r2 = _humming_prep_bounded(prep, w2_packed, w2_scale, budget)
    act_scale = torch.ones((), dtype=torch.float32, device=w31_packed.device)
    scales = (
        s1.view(torch.int32),
        (r1.float() * residual_factor).contiguous(),
        act_scale,
        s2.view(torch.int32),
        (r2.float() * residual_factor).contiguous(),
    )
    return PreparedMoeWeights(
        arch="sm90", dims=dims, fc1=fc1, fc2=fc2, quant_scales=scales, humming=True
    )


def prepare_sm120(
    w31_packed: torch.Tensor,
    w31_scale: torch.Tensor,
    w2_packed: torch.Tensor,
    w2_scale: torch.Tensor,
) -> PreparedMoeWeights:
    """SM120 (MXFP8 activations x MXFP4 weights): `block_scale_interleave` of the scales.

    Packed FP4 weights are used as is (viewed as int64, 16 FP4 per element, as SGLang
    does); both scale tensors are swizzled with `block_scale_interleave` and reshaped back
    to their logical shape (rows are multiples of 128 and columns of 4, so the swizzled
    buffer has the same number of elements). The weight global scales are ones.
    """
    from flashinfer import block_scale_interleave

    dims = moe_dims(w31_packed, w31_scale, w2_packed, w2_scale)
    use_plugin_kernels("sm120")
    s1 = block_scale_interleave(w31_scale.contiguous()).reshape(w31_scale.shape)
    s2 = block_scale_interleave(w2_scale.contiguous()).reshape(w2_scale.shape)
    ones = torch.ones(dims.num_local_experts, dtype=torch.float32, device=w31_packed.device)
    return PreparedMoeWeights(
        arch="sm120",
        dims=dims,
        fc1=w31_packed.contiguous().view(torch.int64),
        fc2=w2_packed.contiguous().view(torch.int64),
        quant_scales=(s1.view(torch.int32), ones, s2.view(torch.int32), ones),
    )


def prepare_weights(
    arch: Arch,
    w31_packed: torch.Tensor,
    w31_scale: torch.Tensor,
    w2_packed: torch.Tensor,
    w2_scale: torch.Tensor,
) -> PreparedMoeWeights:
    """Dispatch to `prepare_sm90` or `prepare_sm120`."""
    if arch == "sm90":
        return prepare_sm90(w31_packed, w31_scale, w2_packed, w2_scale)
    if arch == "sm120":
        return prepare_sm120(w31_packed, w31_scale, w2_packed, w2_scale)
    raise ValueError(f"unsupported arch {arch!r}: the SiTU CUTLASS path covers sm90 and sm120")


def arch_of(device: torch.device | int | None = None) -> Arch:
    """Map the CUDA device's compute capability to the supported arch, or raise."""
    major, minor = torch.cuda.get_device_capability(device)
    arch = arch_name(major, minor)
    if is_served(arch):
        return arch  # type: ignore[return-value]  # one of ARCHES
    raise ValueError(
        f"compute capability {major}.{minor}: the adapter's SiTU CUTLASS MoE covers SM90 and "
        "SM120 only (SM100 uses SGLang's own trtllm-gen path)"
    )


# --------------------------------------------------------------------------------------
# The call
# --------------------------------------------------------------------------------------


def build_moe_kwargs(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    weights: PreparedMoeWeights,
    activation_type: Any,
    *,
    situ_beta: torch.Tensor | None,
    situ_linear_beta: torch.Tensor | None,
    output: torch.Tensor | None,
    input_sf: torch.Tensor | None = None,
    tp_size: int = 1,
    tp_rank: int = 0,
    ep_size: int = 1,
    ep_rank: int = 0,
    use_fused_finalize: bool = True,
    tune_max_num_tokens: int = 8192,
    workspace_buffer: torch.Tensor | None = None,
) -> dict[str, Any]:
    """The keyword arguments of `cutlass_fused_moe` for one call (pure: no FlashInfer import).

    - `topk_ids` are GLOBAL expert ids (int32); the kernel keeps the slice of rank
      `ep_rank` of `ep_size` (experts [ep_rank*E_local, (ep_rank+1)*E_local)) and ignores
      the other ids, so summing the ranks' outputs gives the full MoE.
    - No SwiGLU parameters and no biases: SiTU reads only `situ_beta`/`situ_linear_beta`.
    - SM90: `use_w4_group_scaling=True` (W4A16 with E8M0 group scales);
      SM120: `use_mxfp8_act_scaling=True` with `input_sf` from the caller's MXFP8 quant.
    """
    if topk_ids.dtype != torch.int32:
        raise ValueError(f"topk_ids must be int32 (global expert ids), got {topk_ids.dtype}")
    if topk_weights.dtype != torch.float32:
        raise ValueError(f"topk_weights must be float32, got {topk_weights.dtype}")
    if topk_ids.shape != topk_weights.shape or topk_ids.dim() != 2:
        raise ValueError(
            f"topk_ids {tuple(topk_ids.shape)} and topk_weights {tuple(topk_weights.shape)} "
            "must both be [M, top_k]"
        )
    if x.dim() != 2 or x.shape[0] != topk_ids.shape[0]:
        raise ValueError(f"x must be [M, K] with M = {topk_ids.shape[0]}, got {tuple(x.shape)}")
    if weights.arch == "sm120" and input_sf is None:
        raise ValueError("SM120 needs the MXFP8 activation scales (input_sf)")
    if weights.arch == "sm90" and input_sf is not None:
        raise ValueError("SM90 W4A16 takes bf16 activations: input_sf must be None")
    e_local = weights.dims.num_local_experts
    for name, t in (("situ_beta", situ_beta), ("situ_linear_beta", situ_linear_beta)):
        if t is not None and (t.dtype != torch.float32 or tuple(t.shape) != (e_local,)):
            raise ValueError(
                f"{name} must be float32 [{e_local}] (local experts), got {t.dtype} "
                f"{tuple(t.shape)}"
            )
    if not (0 <= ep_rank < ep_size and 0 <= tp_rank < tp_size):
        raise ValueError(f"bad parallel ranks: tp {tp_rank}/{tp_size}, ep {ep_rank}/{ep_size}")
    sm120 = weights.arch == "sm120"
    # Only the Humming call names the keyword (as SGLang does): the W4A16 and MXFP8 calls
    # stay valid for FlashInfer releases without it.
    humming = {"use_wfp4afp8_humming": True} if weights.humming else {}
    return {
        "input": x,
        "token_selected_experts": topk_ids,
        "token_final_scales": topk_weights,
        "fc1_expert_weights": weights.fc1,
        "fc2_expert_weights": weights.fc2,
        "output_dtype": torch.bfloat16,
        "quant_scales": list(weights.quant_scales),
        "input_sf": input_sf,
        "fc1_expert_biases": None,
        "fc2_expert_biases": None,
        "swiglu_alpha": None,
        "swiglu_beta": None,
        "swiglu_limit": None,
        "tp_size": tp_size,
        "tp_rank": tp_rank,
        "ep_size": ep_size,
        "ep_rank": ep_rank,
        "use_w4_group_scaling": not sm120,
        "use_mxfp8_act_scaling": sm120,
        "activation_type": activation_type,
        "tune_max_num_tokens": tune_max_num_tokens,
        "output": output,
        "use_fused_finalize": use_fused_finalize,
        "workspace_buffer": workspace_buffer,
        "situ_beta": situ_beta,
        "situ_linear_beta": situ_linear_beta,
        **humming,
    }


def run_situ_moe(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    weights: PreparedMoeWeights,
    situ_beta: torch.Tensor | None,
    situ_linear_beta: torch.Tensor | None,
    *,
    output: torch.Tensor | None = None,
    tp_size: int = 1,
    tp_rank: int = 0,
    ep_size: int = 1,
    ep_rank: int = 0,
    activation: Activation = "situ",
    use_fused_finalize: bool = True,
    tune_max_num_tokens: int = 8192,
    workspace_buffer: torch.Tensor | None = None,
) -> torch.Tensor:
    """Run FlashInfer's CUTLASS fused MoE with `ActivationType.Situ`; return [M, K] bf16.

    Args:
        x: [M, K] bf16 hidden states of this rank.
        topk_ids: [M, top_k] int32 GLOBAL expert ids (negative ids are not routed).
        topk_weights: [M, top_k] float32 routing weights (routed scaling already applied).
        weights: from `prepare_sm90`/`prepare_sm120`.
        situ_beta, situ_linear_beta: from `situ_params` (None = FlashInfer's compiled
            defaults, 4.0/25.0). Ignored (must be None) for the SwiGLU control.
        output: optional preallocated [M, K] bf16 output (CUDA-graph capture should pass one).
        activation: "situ" (the model) or "swiglu" (plain silu(gate)*up, a control).
        use_fused_finalize: False selects FlashInfer's deterministic finalize.
        workspace_buffer: optional preallocated scratch (see
            `flashinfer.fused_moe.cutlass_fused_moe_workspace_size`) to avoid a per-call
            workspace allocation.

    Beyond the output (when not given) and SM120's MXFP8 activation quantization, this
    allocates nothing: the SiTU tensors, weights and scale views are built at load time.
    """
    from flashinfer.fused_moe import ActivationType, cutlass_fused_moe

    if activation == "situ":
        act = ActivationType.Situ
    elif activation == "swiglu":
        if situ_beta is not None or situ_linear_beta is not None:
            raise ValueError("the SwiGLU control takes no SiTU parameters")
        act = ActivationType.Swiglu
    else:
        raise ValueError(f"unknown activation {activation!r}; expected 'situ' or 'swiglu'")

    input_sf = None
    if weights.arch == "sm120":
        from flashinfer import mxfp8_quantize

        x, input_sf = mxfp8_quantize(x, is_sf_swizzled_layout=True, alignment=GROUP_SIZE)
    elif x.dtype != torch.bfloat16:
        raise ValueError(f"SM90 W4A16 takes bf16 activations, got {x.dtype}")

    kwargs = build_moe_kwargs(
        x,
        topk_ids,
        topk_weights,
        weights,
        act,
        situ_beta=situ_beta,
        situ_linear_beta=situ_linear_beta,
        output=output,
        input_sf=input_sf,
        tp_size=tp_size,
        tp_rank=tp_rank,
        ep_size=ep_size,
        ep_rank=ep_rank,
        use_fused_finalize=use_fused_finalize,
        tune_max_num_tokens=tune_max_num_tokens,
        workspace_buffer=workspace_buffer,
    )
    result = cutlass_fused_moe(**kwargs)
    # Some FlashInfer versions return [output, *min_latency_tensors].
    return result[0] if isinstance(result, (list, tuple)) else result
