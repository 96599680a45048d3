"""Numerical reference for Kimi-K3 MXFP4 experts: dequantization and the SiTU expert MLP.

Everything here is plain numpy in fp32 (comparisons in fp64), written for clarity rather
than speed: the converter and `verify` must not need torch. It is the ground truth that
`verify --numerics`, the adapter tests and the GPU harness all compare against, so it stays
small and has its own unit tests (tests/test_reference.py).

Inputs are numpy arrays (uint8 for packed FP4 and E8M0 scales, float for activations);
anything `np.asarray` accepts works (a CPU torch tensor too, except bf16: pass
`t.float().numpy()`). Outputs are float32 arrays.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

GROUP_SIZE = 32

# OCP MX e2m1: sign bit 3, exponent bits 2..1, mantissa bit 0. Index = the 4-bit code.
E2M1_VALUES = (
    0.0,
    0.5,
    1.0,
    1.5,
    2.0,
    3.0,
    4.0,
    6.0,
    -0.0,
    -0.5,
    -1.0,
    -1.5,
    -2.0,
    -3.0,
    -4.0,
    -6.0,
)
_E2M1_LUT = np.array(E2M1_VALUES, dtype=np.float32)


def _uint8(a: object, what: str) -> np.ndarray:
    arr = np.asarray(a)
    if arr.dtype != np.uint8:
        raise TypeError(f"{what} must be uint8, got {arr.dtype}")
    return arr


def unpack_fp4(packed: np.ndarray, low_nibble_first: bool = True) -> np.ndarray:
    """[R, K/2] uint8 -> [R, K] fp32 e2m1 values (no scale applied)."""
    packed = _uint8(packed, "packed FP4")
    lo = packed & 0x0F
    hi = packed >> 4
    first, second = (lo, hi) if low_nibble_first else (hi, lo)
    codes = np.stack([first, second], axis=-1).reshape(*packed.shape[:-1], packed.shape[-1] * 2)
    return _E2M1_LUT[codes]


def e8m0_to_float(scale: np.ndarray) -> np.ndarray:
    """E8M0 bytes -> fp32 2^(e-127). Byte 0 is 2^-127 (valid); 0xFF is NaN."""
    scale = _uint8(scale, "E8M0 scales")
    # ldexp is exact for every byte (2^-127 is an fp32 subnormal, 2^127 the largest power).
    exps = np.minimum(scale, 254).astype(np.int32) - 127  # 0xFF is replaced by NaN below
    out = np.ldexp(np.ones(scale.shape, dtype=np.float32), exps)
    return np.where(scale == 0xFF, np.float32(np.nan), out).astype(np.float32)


def dequant_mxfp4(
    packed: np.ndarray,
    scale: np.ndarray,
    group_size: int = GROUP_SIZE,
    low_nibble_first: bool = True,
) -> np.ndarray:
    """Packed MXFP4 [R, K/2] with E8M0 scales [R, K/group] -> fp32 [R, K]."""
    values = unpack_fp4(packed, low_nibble_first)
    scale = _uint8(scale, "E8M0 scales")
    rows, k = values.shape
    if scale.shape != (rows, k // group_size):
        raise ValueError(
            f"scale shape {tuple(scale.shape)} does not match packed {tuple(np.shape(packed))} "
            f"(expected {(rows, k // group_size)})"
        )
    # fp32, as the spec requires: a value of magnitude >= 2^128 (scale byte 0xFE with a code
    # of magnitude >= 2) is +-inf, the IEEE result, not an error.
    with np.errstate(over="ignore"):
        return values * np.repeat(e8m0_to_float(scale), group_size, axis=1)


def _f32(a: object) -> np.ndarray:
    return np.asarray(a, dtype=np.float32)


def _sigmoid(x: np.ndarray) -> np.ndarray:
    # exp(-x) overflows to inf for very negative x, and 1/(1+inf) = 0 is the right limit.
    with np.errstate(over="ignore"):
        return (np.float32(1.0) / (np.float32(1.0) + np.exp(-x))).astype(np.float32)


def situ(gate: np.ndarray, up: np.ndarray, beta: float, linear_beta: float) -> np.ndarray:
    """SiTU in fp32: beta*tanh(g/beta)*sigmoid(g) * linear_beta*tanh(u/linear_beta).

    The sigmoid is of the *uncapped* gate; only the gate's magnitude is soft-capped.
    """
    g, u = _f32(gate), _f32(up)
    b, lb = np.float32(beta), np.float32(linear_beta)
    gate_act = b * np.tanh(g / b) * _sigmoid(g)
    up_act = lb * np.tanh(u / lb)
    return (gate_act * up_act).astype(np.float32)


def swiglu(gate: np.ndarray, up: np.ndarray) -> np.ndarray:
    """Plain SwiGLU, silu(gate) * up, in fp32 (the control activation)."""
    g, u = _f32(gate), _f32(up)
    return (g * _sigmoid(g) * u).astype(np.float32)


@dataclass(frozen=True)
class ExpertWeights:
    """Dequantized fp32 weights of one expert: gate/up [N, K], down [K, N]."""

    gate: np.ndarray
    up: np.ndarray
    down: np.ndarray


def split_w31(w31: np.ndarray, fc1_order: tuple[str, str] | list[str] = ("up", "gate")):
    """Split a fused fc1 tensor [2N, ...] into (up, gate) according to `fc1_order`."""
    if len(fc1_order) != 2 or set(fc1_order) != {"up", "gate"}:
        raise ValueError(f"fc1_order must name 'up' and 'gate' once each, got {fc1_order!r}")
    if w31.shape[0] % 2:
        raise ValueError(f"fused fc1 tensor has an odd row count {w31.shape[0]}")
    half = w31.shape[0] // 2
    parts = {fc1_order[0]: w31[:half], fc1_order[1]: w31[half:]}
    return parts["up"], parts["gate"]


def expert_forward(
    x: np.ndarray,
    expert: ExpertWeights,
    beta: float,
    linear_beta: float,
    activation: str = "situ",
) -> np.ndarray:
    """One expert MLP in fp32: down @ act(gate @ x, up @ x). x [M, K] -> [M, K]."""
    xf = _f32(x)
    gate = xf @ expert.gate.T
    up = xf @ expert.up.T
    if activation == "situ":
        hidden = situ(gate, up, beta, linear_beta)
    elif activation == "swiglu":
        hidden = swiglu(gate, up)
    else:
        raise ValueError(f"unknown activation {activation!r}; expected 'situ' or 'swiglu'")
    return (hidden @ expert.down.T).astype(np.float32)


def moe_forward(
    x: np.ndarray,
    topk_ids: np.ndarray,
    topk_weights: np.ndarray,
    experts: Mapping[int, ExpertWeights],
    beta: float,
    linear_beta: float,
    activation: str = "situ",
) -> np.ndarray:
    """Routed MoE in fp32: sum_j w_j * expert_{id_j}(x) per token.

    Slots whose id is negative or not in `experts` (another EP rank's) contribute nothing,
    so summing the outputs of disjoint expert sets gives the full-model output.
    """
    xf = _f32(x)
    ids = np.asarray(topk_ids)
    weights = _f32(topk_weights)
    out = np.zeros((xf.shape[0], xf.shape[1]), dtype=np.float32)
    for eid in np.unique(ids).tolist():
        if eid < 0 or eid not in experts:
            continue
        rows, slots = np.nonzero(ids == eid)
        y = expert_forward(xf[rows], experts[eid], beta, linear_beta, activation)
        np.add.at(out, rows, y * weights[rows, slots][:, None])
    return out


def dequant_expert(
    w1: tuple[np.ndarray, np.ndarray],
    w3: tuple[np.ndarray, np.ndarray],
    w2: tuple[np.ndarray, np.ndarray],
    group_size: int = GROUP_SIZE,
) -> ExpertWeights:
    """Source semantics: w1 = gate, w3 = up, w2 = down; each a (packed, scale) pair."""
    return ExpertWeights(
        gate=dequant_mxfp4(*w1, group_size=group_size),
        up=dequant_mxfp4(*w3, group_size=group_size),
        down=dequant_mxfp4(*w2, group_size=group_size),
    )


def dequant_converted_expert(
    w31: tuple[np.ndarray, np.ndarray],
    w2: tuple[np.ndarray, np.ndarray],
    fc1_order: tuple[str, str] | list[str] = ("up", "gate"),
    group_size: int = GROUP_SIZE,
) -> ExpertWeights:
    """Converted semantics: split the fused w31 (packed, scale) by `fc1_order`."""
    up_p, gate_p = split_w31(w31[0], fc1_order)
    up_s, gate_s = split_w31(w31[1], fc1_order)
    return ExpertWeights(
        gate=dequant_mxfp4(gate_p, gate_s, group_size=group_size),
        up=dequant_mxfp4(up_p, up_s, group_size=group_size),
        down=dequant_mxfp4(*w2, group_size=group_size),
    )


def compare(actual: np.ndarray, expected: np.ndarray) -> dict[str, float]:
    """Cosine similarity, NRMSE (rms error / rms expected) and max abs error (in fp64)."""
    a = np.asarray(actual, dtype=np.float64).ravel()
    e = np.asarray(expected, dtype=np.float64).ravel()
    d = a - e
    denom = max(float(np.linalg.norm(a) * np.linalg.norm(e)), 1e-8)
    rms_e = float(np.sqrt(np.mean(e * e))) if e.size else 0.0
    rms_d = float(np.sqrt(np.mean(d * d))) if d.size else 0.0
    return {
        "cosine": float(np.dot(a, e)) / denom,
        "nrmse": rms_d / rms_e if rms_e > 0 else (0.0 if rms_d == 0 else float("inf")),
        "max_abs": float(np.abs(d).max()) if d.size else 0.0,
    }
