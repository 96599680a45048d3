"""Numerical reference for Kimi-K3 MXFP4 experts: dequantization and the SiTU expert MLP.

Everything here is plain fp32 torch on any device, written for clarity rather than speed.
It is the ground truth that `verify --numerics`, the adapter tests and the GPU harness all
compare against, so it stays small and has its own unit tests (tests/test_reference.py).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

GROUP_SIZE = 32

# OCP MX e2m1: sign bit 3, exponent bits 2..1, mantissa bit 0. Index = the 4-bit code.
E2M1_VALUES = (
    0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
    -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0,
)  # fmt: skip


def unpack_fp4(packed: torch.Tensor, low_nibble_first: bool = True) -> torch.Tensor:
    """[R, K/2] uint8 -> [R, K] fp32 e2m1 values (no scale applied)."""
    if packed.dtype != torch.uint8:
        raise TypeError(f"packed FP4 must be uint8, got {packed.dtype}")
    lut = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=packed.device)
    lo = (packed & 0x0F).long()
    hi = (packed >> 4).long()
    first, second = (lo, hi) if low_nibble_first else (hi, lo)
    codes = torch.stack([first, second], dim=-1).reshape(*packed.shape[:-1], packed.shape[-1] * 2)
    return lut[codes]


def e8m0_to_float(scale: torch.Tensor) -> torch.Tensor:
    """E8M0 bytes -> fp32 2^(e-127). Byte 0 is 2^-127 (valid); 0xFF is NaN."""
    if scale.dtype != torch.uint8:
        raise TypeError(f"E8M0 scales must be uint8, got {scale.dtype}")
    exps = scale.to(torch.float32) - 127.0
    out = torch.exp2(exps)
    return torch.where(scale == 0xFF, torch.full_like(out, float("nan")), out)


def dequant_mxfp4(
    packed: torch.Tensor,
    scale: torch.Tensor,
    group_size: int = GROUP_SIZE,
    low_nibble_first: bool = True,
) -> torch.Tensor:
    """Packed MXFP4 [R, K/2] with E8M0 scales [R, K/group] -> fp32 [R, K]."""
    values = unpack_fp4(packed, low_nibble_first)
    rows, k = values.shape
    if scale.shape != (rows, k // group_size):
        raise ValueError(
            f"scale shape {tuple(scale.shape)} does not match packed {tuple(packed.shape)} "
            f"(expected {(rows, k // group_size)})"
        )
    scales = e8m0_to_float(scale).repeat_interleave(group_size, dim=1)
    return values * scales


def situ(gate: torch.Tensor, up: torch.Tensor, beta: float, linear_beta: float) -> torch.Tensor:
    """SiTU in fp32: beta*tanh(g/beta)*sigmoid(g) * linear_beta*tanh(u/linear_beta).

    The sigmoid is of the *uncapped* gate; only the gate's magnitude is soft-capped.
    """
    g = gate.float()
    u = up.float()
    gate_act = beta * torch.tanh(g / beta) * torch.sigmoid(g)
    up_act = linear_beta * torch.tanh(u / linear_beta)
    return gate_act * up_act


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """Plain SwiGLU, silu(gate) * up, in fp32 (the control activation)."""
    return torch.nn.functional.silu(gate.float()) * up.float()


@dataclass(frozen=True)
class ExpertWeights:
    """Dequantized fp32 weights of one expert: gate/up [N, K], down [K, N]."""

    gate: torch.Tensor
    up: torch.Tensor
    down: torch.Tensor


def split_w31(w31: torch.Tensor, fc1_order: tuple[str, str] | list[str] = ("up", "gate")):
    """Split a fused fc1 tensor [2N, ...] into (up, gate) according to `fc1_order`."""
    if len(fc1_order) != 2 or set(fc1_order) != {"up", "gate"}:
        raise ValueError(f"fc1_order must name 'up' and 'gate' once each, got {fc1_order!r}")
    if w31.shape[0] % 2:
        raise ValueError(f"fused fc1 tensor has an odd row count {w31.shape[0]}")
    half = w31.shape[0] // 2
    parts = {fc1_order[0]: w31[:half], fc1_order[1]: w31[half:]}
    return parts["up"], parts["gate"]


def expert_forward(
    x: torch.Tensor,
    expert: ExpertWeights,
    beta: float,
    linear_beta: float,
    activation: str = "situ",
) -> torch.Tensor:
    """One expert MLP in fp32: down @ act(gate @ x, up @ x). x [M, K] -> [M, K]."""
    xf = x.float()
    gate = xf @ expert.gate.T
    up = xf @ expert.up.T
    if activation == "situ":
        hidden = situ(gate, up, beta, linear_beta)
    elif activation == "swiglu":
        hidden = swiglu(gate, up)
    else:
        raise ValueError(f"unknown activation {activation!r}; expected 'situ' or 'swiglu'")
    return hidden @ expert.down.T


def moe_forward(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    experts: Mapping[int, ExpertWeights],
    beta: float,
    linear_beta: float,
    activation: str = "situ",
) -> torch.Tensor:
    """Routed MoE in fp32: sum_j w_j * expert_{id_j}(x) per token.

    Slots whose id is negative or not in `experts` (another EP rank's) contribute nothing,
    so summing the outputs of disjoint expert sets gives the full-model output.
    """
    out = torch.zeros(x.shape[0], x.shape[1], dtype=torch.float32, device=x.device)
    for eid in torch.unique(topk_ids).tolist():
        if eid < 0 or eid not in experts:
            continue
        rows, slots = torch.nonzero(topk_ids == eid, as_tuple=True)
        y = expert_forward(x[rows], experts[eid], beta, linear_beta, activation)
        out.index_add_(0, rows, y * topk_weights[rows, slots].float().unsqueeze(1))
    return out


def dequant_expert(
    w1: tuple[torch.Tensor, torch.Tensor],
    w3: tuple[torch.Tensor, torch.Tensor],
    w2: tuple[torch.Tensor, torch.Tensor],
    group_size: int = GROUP_SIZE,
) -> ExpertWeights:
    """Source semantics: w1 = gate, w3 = up, w2 = down; each a (packed, scale) pair."""
    return ExpertWeights(
        gate=dequant_mxfp4(*w1, group_size=group_size),
        up=dequant_mxfp4(*w3, group_size=group_size),
        down=dequant_mxfp4(*w2, group_size=group_size),
    )


def dequant_converted_expert(
    w31: tuple[torch.Tensor, torch.Tensor],
    w2: tuple[torch.Tensor, torch.Tensor],
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


def compare(actual: torch.Tensor, expected: torch.Tensor) -> dict[str, float]:
    """Cosine similarity, NRMSE (rms error / rms expected) and max abs error."""
    a = actual.double().flatten()
    e = expected.double().flatten()
    cos = torch.nn.functional.cosine_similarity(a, e, dim=0).item()
    rms_e = e.pow(2).mean().sqrt().item()
    rms_d = (a - e).pow(2).mean().sqrt().item()
    return {
        "cosine": cos,
        "nrmse": rms_d / rms_e if rms_e > 0 else (0.0 if rms_d == 0 else float("inf")),
        "max_abs": (a - e).abs().max().item() if a.numel() else 0.0,
    }
