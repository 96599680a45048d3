"""Pure parts of the race (gpu/race.py): layouts, case lists, floors, link bytes, report.

The race times one Kimi-K3 MoE layer per GPU rank, as each deployment holds it, through
SGLang's own code: the upstream Hopper route (Marlin W4A16 on the unconverted checkpoint)
against the plugin's W4A16 and W4A8 paths on the converted one. Everything here is numpy
and arithmetic, unit-tested on CPU (tests/test_gpu_race.py).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass

import numpy as np

# Kimi-K3's routed experts (docs/inventory.md) and the H200's datasheet peaks.
EXPERTS, TOP_K, K, N = 896, 16, 3584, 3072
HIDDEN = 7168  # the shared experts' output width (the routed ones work in K, the latent)
HBM_BYTES_PER_S = 4.8e12
BF16_FLOPS_PER_S = 989e12  # dense bf16 tensor cores, SXM datasheet
MS = tuple(2**i for i in range(14))  # 1 ... 8192 tokens per rank
ROUTINGS = ("uniform", "skewed")
SKEW = 0.5  # gpu/sglang_layer.SKEW: log-rank penalty, a few experts get many tokens
# The race's router (gpu/sglang_cases.make_router): logits N(0, 1) and a correction bias
# that only breaks ties, so "uniform" spreads tokens over all 896 experts as a balanced
# router does (the gate suites' bias of std 0.1 concentrates them on a few).
LOGIT_STD, BIAS_STD = 1.0, 1e-3
ARMS = ("marlin", "w4a16", "w4a8")


@dataclass(frozen=True)
class Layout:
    """One rank of a deployment: which experts it holds and how wide they are."""

    key: str
    title: str
    tp: int  # tensor-parallel size of the deployment (attention and MoE together)
    ep: int  # expert-parallel size
    n_local: int  # intermediate width per local expert (N / moe-TP)

    @property
    def moe_tp(self) -> int:
        return self.tp // self.ep

    @property
    def local_experts(self) -> int:
        return EXPERTS // self.ep

    def local_range(self, rank: int = 0) -> tuple[int, int]:
        return rank * self.local_experts, (rank + 1) * self.local_experts


LAYOUTS: dict[str, Layout] = {
    "ep16": Layout("ep16", "TP16/EP16 (upstream's H200 recipe): 56 experts, N 3072", 16, 16, N),
    "moetp8": Layout(
        "moetp8", "TP16/EP2 (MoE-TP8, the README's): 448 experts, N 384", 16, 2, N // 8
    ),
}


def parse_ms(text: str) -> tuple[int, ...]:
    """'1,8,64' or 'all' (1 ... 8192); sorted, unique, positive."""
    if text.strip() == "all":
        return MS
    ms = sorted({int(t) for t in text.split(",") if t.strip()})
    if not ms or ms[0] < 1:
        raise ValueError(f"bad M list {text!r}")
    return tuple(ms)


def skew_of(routing: str) -> float:
    if routing not in ROUTINGS:
        raise ValueError(f"routing {routing!r} not in {ROUTINGS}")
    # the gate suites' skew relative to their logits' spread (0.5 on std 2)
    return SKEW * LOGIT_STD / 2.0 if routing == "skewed" else 0.0


# --- what a batch touches on one rank, and the floor --------------------------------------


@dataclass(frozen=True)
class Load:
    pairs: int  # (token, local expert) pairs the rank computes
    touched: int  # distinct local experts with at least one token


def rank_load(ids: np.ndarray, layout: Layout, rank: int = 0) -> Load:
    """The rank's share of a global routing (ids in [0, 896))."""
    lo, hi = layout.local_range(rank)
    local = ids[(ids >= lo) & (ids < hi)]
    return Load(pairs=int(local.size), touched=int(np.unique(local).size))


def expert_bytes(n_local: int, k: int = K) -> int:
    """MXFP4 weights + E8M0 scales (one per 32) of one expert: fc1 [2N, K] and fc2 [K, N]."""
    values = 3 * n_local * k
    return values // 2 + values // 32


def floor_ms(layout: Layout, load: Load) -> dict[str, float]:
    """The larger of: the touched experts' bytes read once from HBM, and the pairs' bf16
    tensor-core work (2 x pairs x 3 x N x K FLOPs) at peak."""
    hbm = load.touched * expert_bytes(layout.n_local) / HBM_BYTES_PER_S * 1e3
    flops = 2.0 * load.pairs * 3 * layout.n_local * K
    tc = flops / BF16_FLOPS_PER_S * 1e3
    return {
        "hbm_ms": hbm,
        "tensor_core_ms": tc,
        "floor_ms": max(hbm, tc),
        "bound": "hbm" if hbm >= tc else "tensor-core",
    }


# --- bytes between GPUs, on paper ---------------------------------------------------------


def expected_distinct(picks: int, bins: int) -> float:
    """Expected number of distinct bins hit by `picks` uniform draws over `bins` bins (the
    top-16 experts of a token are distinct, which this slightly undercounts)."""
    return bins * (1.0 - (1.0 - 1.0 / bins) ** picks)


def link_bytes_per_token(gpus: int = 16, dispatch_bytes_per_value: float = 2.0) -> dict[str, float]:
    """Bytes one MoE layer moves between GPUs per token of the batch, summed over the GPUs.

    all-reduce (TP attention; SGLang's standard dispatcher, both TP16/EP16 and TP16/EP2):
    every GPU holds every token and the layer ends in one ring all-reduce of the routed
    latent (K) and the shared experts' output (HIDDEN), bf16: each GPU sends 2(p-1)/p of it.
    all-to-all (DP attention + an EP16 dispatcher, e.g. DeepEP): a token goes, as its
    latent, to each other GPU that holds one of its 16 experts and comes back bf16; the
    shared experts run where the token is.
    """
    reduce_payload = (K + HIDDEN) * 2
    all_reduce = gpus * 2 * (gpus - 1) / gpus * reduce_payload
    remote = expected_distinct(TOP_K, gpus) * (gpus - 1) / gpus
    dispatch = remote * K * dispatch_bytes_per_value
    combine = remote * K * 2
    return {
        "all_reduce": all_reduce,
        "all_to_all": dispatch + combine,
        "remote_ranks_per_token": remote,
        "all_reduce_payload_bytes": reduce_payload,
    }


# --- timing summary ----------------------------------------------------------------------


def median_of_rounds(rounds: Sequence[Sequence[float]]) -> float:
    """Each round's median, then the median of those (robust to one noisy round)."""
    if not rounds or any(not r for r in rounds):
        raise ValueError("empty timing round")
    return float(statistics.median(statistics.median(r) for r in rounds))


def spread(rounds: Sequence[Sequence[float]]) -> float:
    """(max - min) / median of the round medians: how much the rounds disagree."""
    meds = [statistics.median(r) for r in rounds]
    mid = statistics.median(meds)
    return (max(meds) - min(meds)) / mid if mid > 0 else math.inf


@dataclass
class Row:
    layout: str
    routing: str
    m: int
    arm: str
    ms: float
    spread: float
    pairs: int
    touched: int
    floor_ms: float
    bound: str
    cosine: float | None = None
    nrmse: float | None = None
    max_abs: float | None = None
    # An arm whose layer leaves the routed scaling factor out (SGLang's Marlin route on
    # MXFP4): its NRMSE with the factor applied, which Kimi-K3's latent RMSNorm makes moot.
    nrmse_rescaled: float | None = None

    @property
    def floor_fraction(self) -> float:
        return self.floor_ms / self.ms if self.ms > 0 else 0.0


def speedups(rows: Iterable[Row], base: str = "marlin") -> dict[tuple[str, str, int, str], float]:
    """base ms / arm ms per (layout, routing, M, arm): > 1 means faster than `base`."""
    rows = list(rows)
    base_ms = {(r.layout, r.routing, r.m): r.ms for r in rows if r.arm == base}
    out = {}
    for r in rows:
        b = base_ms.get((r.layout, r.routing, r.m))
        if b is not None and r.ms > 0:
            out[(r.layout, r.routing, r.m, r.arm)] = b / r.ms
    return out


def winners(rows: Iterable[Row]) -> dict[tuple[str, str, int], str]:
    """The fastest arm of each (layout, routing, M)."""
    best: dict[tuple[str, str, int], Row] = {}
    for r in rows:
        key = (r.layout, r.routing, r.m)
        if key not in best or r.ms < best[key].ms:
            best[key] = r
    return {k: v.arm for k, v in best.items()}


def _fmt(v: float | None, spec: str) -> str:
    return "-" if v is None else format(v, spec)


def markdown(rows: Sequence[Row], meta: Mapping[str, object]) -> str:
    """The report's table: one line per (layout, routing, M), the three arms side by side."""
    ratio = speedups(rows)
    win = winners(rows)
    by = {(r.layout, r.routing, r.m, r.arm): r for r in rows}
    keys = sorted({(r.layout, r.routing, r.m) for r in rows}, key=lambda k: (k[0], k[1], k[2]))
    lines = [
        f"# The race: Kimi-K3 MoE layer per rank, {meta.get('date_utc', '')}",
        "",
        "TopK + FusedMoE.forward through SGLang, CUDA-graph replays; ms = median of the "
        "round medians; x = Marlin ms / arm ms (> 1: faster than Marlin); floor = the "
        "larger of the touched experts' bytes at 4.8 TB/s and the bf16 FLOPs at 989 "
        "TFLOP/s, as a fraction of the measured time; accuracy (cosine / NRMSE) against "
        "the fp32 reference from the source checkpoint where measured.",
        "",
        "| layout | routing | M | pairs | experts touched | floor ms | "
        + " | ".join(f"{a} ms | {a} x | {a} floor | {a} cos / NRMSE" for a in ARMS)
        + " | fastest |",
        "|---|---|---|---|---|---|" + "---|---|---|---|" * len(ARMS) + "---|",
    ]
    for key in keys:
        first = next(by[(*key, a)] for a in ARMS if (*key, a) in by)
        cells = [key[0], key[1], str(key[2]), str(first.pairs), str(first.touched)]
        cells.append(f"{first.floor_ms:.4f}")
        for arm in ARMS:
            r = by.get((*key, arm))
            if r is None:
                cells += ["-", "-", "-", "-"]
                continue
            acc = "-" if r.cosine is None else f"{r.cosine:.6f} / {100 * (r.nrmse or 0):.2f}%"
            cells += [
                f"{r.ms:.4f}",
                _fmt(ratio.get((*key, arm)), ".2f"),
                f"{100 * r.floor_fraction:.0f}%",
                acc,
            ]
        cells.append(win[key])
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def rescaled_nrmse(cosine: float, norm_ratio: float, scale: float) -> float:
    """NRMSE of `scale` x actual against expected, from the unscaled comparison's cosine and
    |actual| / |expected| (|s a - e|^2 = s^2 |a|^2 + |e|^2 - 2 s a.e, divided by |e|^2)."""
    sr = scale * norm_ratio
    return math.sqrt(max(sr * sr + 1.0 - 2.0 * sr * cosine, 0.0))


def summary(rows: Sequence[Row], layout: str, routing: str) -> dict[str, object]:
    """Where each arm stands against Marlin on one layout and routing: the M range each arm
    wins, its speed-up range, and its floor fraction over decode (M 8-256)."""
    sp = speedups(rows)
    win = winners(rows)
    mine = [r for r in rows if r.layout == layout and r.routing == routing]
    out: dict[str, object] = {
        "marlin_fastest_at": sorted(
            m
            for (lay, rt, m), arm in win.items()
            if (lay, rt) == (layout, routing) and arm == "marlin"
        )
    }
    for arm in ARMS[1:]:
        xs = {r.m: sp[(layout, routing, r.m, arm)] for r in mine if r.arm == arm}
        dec = [r.floor_fraction for r in mine if r.arm == arm and 8 <= r.m <= 256]
        if not xs:
            continue
        out[arm] = {
            "x_min": min(xs.values()),
            "x_max": max(xs.values()),
            "slower_than_marlin_at": sorted(m for m, x in xs.items() if x < 1.0),
            "x_at_512_and_up_min": min((x for m, x in xs.items() if m >= 512), default=None),
            "decode_floor_fraction": [min(dec), max(dec)] if dec else None,
        }
    return out


def row_dict(row: Row) -> dict[str, object]:
    return {**asdict(row), "floor_fraction": row.floor_fraction}
