"""Pure pieces of the SGLang-in-the-loop run (gpu/sglang_layer.py), numpy only.

The router reference, the per-rank slices of the reference experts, and the activation
that SGLang's stock SM90 CUTLASS path applies (the harness control) are written here from
their definitions, independently of SGLang, and unit-tested on CPU
(tests/test_gpu_harness.py), and the summary of the suites' outcomes that
`gpu/sglang_h200.sh wait` prints and exits with.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
from kimi_w31.converter import reference as ref


@dataclass(frozen=True)
class Router:
    """Kimi-K3's router inputs for one batch: fp32 logits [M, E] and the correction bias [E]."""

    logits: np.ndarray
    bias: np.ndarray


def make_router(
    m: int,
    num_experts: int,
    seed: int,
    skew: float = 0.0,
    logit_std: float = 2.0,
    bias_std: float = 0.1,
) -> Router:
    """Random fp32 logits and a small correction bias; `skew` > 0 favours low ids.

    With the defaults the bias (std 0.1) outweighs the gaps between the saturated sigmoid
    scores of a token's best experts, so most tokens pick the same few high-bias experts:
    fine for checking numerics, not a load. For a load spread like a trained router's
    (which the bias exists to balance), use logit_std 1 and a bias that only breaks ties.
    """
    rng = np.random.default_rng(seed)
    logits = rng.standard_normal((m, num_experts)).astype(np.float32) * np.float32(logit_std)
    logits -= np.float32(skew) * np.log1p(np.arange(num_experts, dtype=np.float32))
    bias = (rng.standard_normal(num_experts) * bias_std).astype(np.float32)
    return Router(logits=logits, bias=bias)


def route(
    router: Router, top_k: int, renormalize: bool, routed_scaling_factor: float
) -> tuple[np.ndarray, np.ndarray]:
    """DeepSeek-V3-style biased top-k with sigmoid scores, one expert group (Kimi-K3).

    The bias only ranks experts; the weights are the unbiased sigmoid scores of the chosen
    experts, renormalized to sum 1 when asked, times the routed scaling factor.
    Returns (ids int32 [M, k] in descending biased score, weights fp32 [M, k]).
    """
    with np.errstate(over="ignore"):
        sig = (1.0 / (1.0 + np.exp(-router.logits.astype(np.float64)))).astype(np.float32)
    biased = sig + router.bias[None, :]
    ids = np.argsort(-biased, axis=1, kind="stable")[:, :top_k]
    weights = np.take_along_axis(sig, ids, axis=1)
    if renormalize:
        weights = weights / weights.sum(axis=1, keepdims=True)
    return ids.astype(np.int32), (weights * np.float32(routed_scaling_factor)).astype(np.float32)


def same_routing(
    ids_a: np.ndarray, w_a: np.ndarray, ids_b: np.ndarray, w_b: np.ndarray, rtol: float = 1e-4
) -> dict[str, float]:
    """How far two routings agree: tokens with the same expert set, and the largest relative
    weight difference over experts both chose (slot order is ignored)."""
    same_sets = 0
    worst = 0.0
    for t in range(ids_a.shape[0]):
        da = dict(zip(ids_a[t].tolist(), w_a[t].tolist(), strict=True))
        db = dict(zip(ids_b[t].tolist(), w_b[t].tolist(), strict=True))
        same_sets += set(da) == set(db)
        for e in set(da) & set(db):
            worst = max(worst, abs(da[e] - db[e]) / max(abs(db[e]), 1e-12))
    return {
        "tokens": int(ids_a.shape[0]),
        "same_expert_sets": same_sets,
        "max_rel_weight_diff": worst,
        "agree": same_sets == ids_a.shape[0] and worst <= rtol,
    }


def tp_slice(expert: ref.ExpertWeights, tp_size: int, tp_rank: int) -> ref.ExpertWeights:
    """What moe-TP rank `tp_rank` of `tp_size` computes: gate/up rows and down columns of its
    slice of N. Summing the slices' outputs over the ranks gives the whole expert."""
    n = expert.gate.shape[0]
    if n % tp_size:
        raise ValueError(f"N={n} does not split over {tp_size} ranks")
    sl = slice(tp_rank * n // tp_size, (tp_rank + 1) * n // tp_size)
    return ref.ExpertWeights(gate=expert.gate[sl], up=expert.up[sl], down=expert.down[:, sl])


def swiglu_bias(
    gate: np.ndarray, up: np.ndarray, alpha: float, beta: float, limit: float
) -> np.ndarray:
    """The activation FlashInfer runs for SGLang's stock SM90 path (`ActivationType.SwigluBias`,
    GPT-OSS style): min(g, limit) * sigmoid(alpha * min(g, limit)) * (clamp(u, +-limit) + beta)."""
    g = np.minimum(np.asarray(gate, dtype=np.float32), np.float32(limit))
    u = np.clip(np.asarray(up, dtype=np.float32), -limit, limit)
    with np.errstate(over="ignore"):
        sig = np.float32(1.0) / (np.float32(1.0) + np.exp(-np.float32(alpha) * g))
    return (g * sig * (u + np.float32(beta))).astype(np.float32)


def moe_swiglu_bias(
    x: np.ndarray,
    ids: np.ndarray,
    weights: np.ndarray,
    experts: Mapping[int, ref.ExpertWeights],
    alpha: float,
    beta: float,
    limit: float,
) -> np.ndarray:
    """The routed MoE of `reference.moe_forward` with `swiglu_bias` as the activation."""
    xf = np.asarray(x, dtype=np.float32)
    out = np.zeros_like(xf)
    for eid in np.unique(ids).tolist():
        if eid < 0 or eid not in experts:
            continue
        rows, slots = np.nonzero(ids == eid)
        w = experts[eid]
        h = swiglu_bias(xf[rows] @ w.gate.T, xf[rows] @ w.up.T, alpha, beta, limit)
        np.add.at(out, rows, (h @ w.down.T) * weights[rows, slots][:, None])
    return out


# --- what `gpu/sglang_h200.sh wait` reports ---------------------------------------------


@dataclass(frozen=True)
class SuiteOutcome:
    name: str
    state: str  # "passed", "failed", "not-run", "unfinished"
    detail: str = ""


def suite_outcomes(status: str | None, finished: bool) -> list[SuiteOutcome]:
    """Read the pipeline's status lines ("plan A B ...", then "NAME RC" or
    "NAME not-run WHY") into one outcome per suite: each planned suite, in plan order, then
    any other step that reported (synth, convert). A planned suite with no line did not
    finish (pipeline still running or killed) or did not run (the pipeline stopped first)."""
    plan: list[str] = []
    seen: dict[str, SuiteOutcome] = {}
    for raw in (status or "").splitlines():
        words = raw.split()
        if not words:
            continue
        if words[0] == "plan":
            plan = words[1:]
            continue
        name, rest = words[0], words[1:]
        if rest[:1] == ["not-run"]:
            seen[name] = SuiteOutcome(name, "not-run", " ".join(rest[1:]))
        elif len(rest) == 1 and rest[0].lstrip("-").isdigit():
            rc = int(rest[0])
            seen[name] = SuiteOutcome(name, "passed" if rc == 0 else "failed", f"exit {rc}")
        else:
            seen[name] = SuiteOutcome(name, "failed", f"unreadable status line {raw!r}")
    out = []
    for name in plan:
        missing = "did not finish" if not finished else "did not run (the pipeline stopped)"
        out.append(seen.pop(name, SuiteOutcome(name, "unfinished", missing)))
    return out + list(seen.values())


def suite_summary(status: str | None, finished: bool) -> tuple[int, list[str]]:
    """(exit code, lines): 0 only when a plan was recorded and every suite in it passed."""
    outcomes = suite_outcomes(status, finished)
    lines = [f"{o.name}: {o.state}{f' ({o.detail})' if o.detail else ''}" for o in outcomes]
    bad = [o.name for o in outcomes if o.state != "passed"]
    if not outcomes:
        why = "the pipeline did not start" if status is None else "no suite was planned"
        return 1, [f"suites: none ran ({why})"]
    if bad:
        lines.append(f"suites: {len(bad)} of {len(outcomes)} did not pass: {', '.join(bad)}")
        return 1, lines
    lines.append(f"suites: all {len(outcomes)} passed")
    return 0, lines


def _main(argv: list[str] | None = None) -> int:
    import argparse
    from pathlib import Path

    p = argparse.ArgumentParser(description="summarize gpu/sglang_h200.sh's suite status")
    p.add_argument("command", choices=("status",))
    p.add_argument("file", type=Path)
    p.add_argument("--finished", choices=("yes", "no"), required=True)
    args = p.parse_args(argv)
    text = args.file.read_text() if args.file.is_file() else None
    code, lines = suite_summary(text, args.finished == "yes")
    print("\n".join(lines))
    return code


if __name__ == "__main__":
    raise SystemExit(_main())


# --- W4A8 rows and the two-GPU verdict ---------------------------------------------------


def gated_row(
    name: str,
    m: int,
    got: np.ndarray,
    modelled: np.ndarray,
    unquantized: np.ndarray,
    *,
    cosine_min: float,
    nrmse_max: float,
    expect: str = "pass",
    note: str = "",
) -> dict:
    """One W4A8 case: the output against the FP8-modelled reference (the gate) and against
    the unquantized one (for the record); `ok` when the gate's outcome is the expected one."""
    vs_modelled = ref.compare(got, modelled)
    vs_plain = ref.compare(got, unquantized)
    passes = bool(vs_modelled["cosine"] >= cosine_min and vs_modelled["nrmse"] <= nrmse_max)
    return {
        "name": name,
        "m": m,
        "expect": expect,
        "note": note,
        "vs_fp8_modelled": vs_modelled,
        "vs_unquantized": vs_plain,
        "passes_gate": passes,
        "ok": passes == (expect == "pass"),
    }


def dist_w4a8_verdict(rows: list[dict], ranks_identical: bool) -> dict:
    """Every case as expected, at least one positive case and one negative control among
    them, and both ranks holding the same bytes after the all-reduce."""
    v = {
        "all_as_expected": bool(rows) and all(r["ok"] for r in rows),
        "has_positive_cases": any(r["expect"] == "pass" for r in rows),
        "negative_controls_fail": any(r["expect"] == "fail" for r in rows)
        and all(not r["passes_gate"] for r in rows if r["expect"] == "fail"),
        "ranks_identical_after_all_reduce": bool(ranks_identical),
    }
    v["overall"] = all(v.values())
    return v
