"""Pure, device-agnostic pieces of the GPU harness: inputs, routing, corruptions, gate.

Nothing here needs a GPU or FlashInfer, so all of it is unit-tested on CPU.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch

COSINE_MIN = 0.99999
NRMSE_MAX = 0.005  # 0.5 %

Routing = Literal["uniform", "skewed", "empty_expert", "masked_slot"]
Expect = Literal["pass", "fail"]

_EXPERT_RE = re.compile(
    r"^(?P<prefix>.*\bexperts)\.(?P<e>\d+)\.(?P<proj>w1|w2|w3|w31)\.(?P<part>weight_packed|weight_scale)$"
)  # noqa: E501


# --------------------------------------------------------------------------------------
# Routing and activations
# --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class RoutingTable:
    """Top-k routing of M tokens: global expert ids (int32, -1 = masked) and fp32 weights."""

    ids: torch.Tensor
    weights: torch.Tensor


def make_routing(
    m: int,
    num_experts: int,
    top_k: int,
    kind: Routing,
    seed: int,
    empty_experts: Iterable[int] = (),
    masked_slot: int | None = None,
) -> RoutingTable:
    """Distinct experts per token, weights positive and summing to 1 per token.

    - uniform: every expert equally likely;
    - skewed: probability ~ 1/(rank+1)^2 over a random expert order, so a few experts
      get most tokens and several get one or none (load imbalance);
    - empty_expert: uniform over all experts except `empty_experts`, which get no token;
    - masked_slot: uniform, then slot `masked_slot` of every other token is -1 (the
      weight stays: a masked slot must contribute nothing whatever its weight).
    """
    excluded = set(empty_experts)
    if kind == "empty_expert" and not excluded:
        raise ValueError("empty_expert routing needs at least one expert to leave empty")
    allowed = [e for e in range(num_experts) if e not in excluded]
    if top_k > len(allowed):
        raise ValueError(f"top_k {top_k} > {len(allowed)} routable experts")
    g = torch.Generator().manual_seed(seed)
    probs = torch.zeros(num_experts)
    probs[allowed] = 1.0
    if kind == "skewed":
        order = torch.randperm(num_experts, generator=g)
        ranks = torch.empty(num_experts)
        ranks[order] = torch.arange(num_experts, dtype=torch.float32)
        probs = probs / (ranks + 1.0) ** 2
    ids = torch.multinomial(probs.expand(m, -1), top_k, replacement=False, generator=g)
    weights = torch.rand(m, top_k, generator=g) + 0.05
    weights = weights / weights.sum(dim=1, keepdim=True)
    ids = ids.to(torch.int32)
    if kind == "masked_slot":
        slot = top_k - 1 if masked_slot is None else masked_slot
        ids[::2, slot] = -1
    return RoutingTable(ids=ids, weights=weights.float())


def make_hidden(m: int, k: int, seed: int, scale: float = 1.0) -> torch.Tensor:
    """[M, K] bf16 activations, N(0, scale^2). The reference reads the same bf16 values."""
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(m, k, generator=g) * scale).to(torch.bfloat16)


def ep_slices(num_experts: int, ep_size: int) -> list[range]:
    """Global expert ids owned by each EP rank (contiguous blocks, as FlashInfer assumes)."""
    if num_experts % ep_size:
        raise ValueError(f"{num_experts} experts do not split over {ep_size} ranks")
    per = num_experts // ep_size
    return [range(r * per, (r + 1) * per) for r in range(ep_size)]


# --------------------------------------------------------------------------------------
# Corruptions for the negative controls
# --------------------------------------------------------------------------------------


def swap_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """Exchange the two FP4 codes of every byte (reading high-nibble-first)."""
    return ((packed >> 4) | (packed << 4)).to(torch.uint8)


def swap_fc1_halves(t: torch.Tensor) -> torch.Tensor:
    """[..., 2N, C] -> rows [N, 2N) first: turns [up; gate] into [gate; up] (dim -2)."""
    n = t.shape[-2] // 2
    return torch.cat([t[..., n:, :], t[..., :n, :]], dim=-2)


# --------------------------------------------------------------------------------------
# Loading expert tensors from a safetensors repo
# --------------------------------------------------------------------------------------


def expert_index(weight_map: Mapping[str, str]) -> dict[str, dict[int, set[str]]]:
    """prefix -> expert id -> {"w1", "w2", "w3", "w31"} present (from an index's weight_map)."""
    out: dict[str, dict[int, set[str]]] = {}
    for name in weight_map:
        m = _EXPERT_RE.match(name)
        if m:
            out.setdefault(m["prefix"], {}).setdefault(int(m["e"]), set()).add(m["proj"])
    return out


def pick_moe_layer(
    index: Mapping[str, Mapping[int, set[str]]], projs: set[str], min_experts: int
) -> str:  # noqa: E501
    """The first (sorted) experts prefix whose experts 0..min_experts-1 all have `projs`."""
    for prefix in sorted(index):
        experts = index[prefix]
        if all(projs <= experts.get(e, set()) for e in range(min_experts)):
            return prefix
    raise ValueError(f"no MoE layer with {min_experts} experts carrying {sorted(projs)}")


def load_experts(
    repo: Path, projs: tuple[str, ...], num_experts: int, prefix: str | None = None
) -> tuple[str, dict[str, tuple[torch.Tensor, torch.Tensor]]]:
    """Stack `(packed, scale)` per projection over experts 0..num_experts-1: [E, rows, cols].

    Reads through the repo's `model.safetensors.index.json`, so it works the same on the
    source and on the converted checkpoint.
    """
    from safetensors import safe_open

    weight_map: dict[str, str] = json.loads((repo / "model.safetensors.index.json").read_text())[
        "weight_map"
    ]
    if prefix is None:
        prefix = pick_moe_layer(expert_index(weight_map), set(projs), num_experts)
    names = {
        (proj, part, e): f"{prefix}.{e}.{proj}.{part}"
        for proj in projs
        for part in ("weight_packed", "weight_scale")
        for e in range(num_experts)
    }
    by_file: dict[str, list[tuple[str, str, int]]] = {}
    for key, name in names.items():
        if name not in weight_map:
            raise KeyError(f"{repo}: tensor {name} not in the index")
        by_file.setdefault(weight_map[name], []).append(key)
    tensors: dict[tuple[str, str, int], torch.Tensor] = {}
    for fname, keys in by_file.items():
        with safe_open(str(repo / fname), framework="pt") as f:
            for key in keys:
                tensors[key] = f.get_tensor(names[key])
    out = {
        proj: tuple(
            torch.stack([tensors[(proj, part, e)] for e in range(num_experts)])
            for part in ("weight_packed", "weight_scale")
        )
        for proj in projs
    }
    return prefix, out  # type: ignore[return-value]


# --------------------------------------------------------------------------------------
# Comparison, gate and report
# --------------------------------------------------------------------------------------


@dataclass
class CaseResult:
    """One compared case. `expect` says whether the gate should pass (a negative control
    is expected to fail); `ok` is whether the outcome matched the expectation."""

    name: str
    kind: str  # situ | swiglu | ep | negative
    m: int
    routing: str
    cosine: float
    nrmse: float
    max_abs: float
    expect: Expect = "pass"
    note: str = ""
    passes_gate: bool = field(init=False)
    ok: bool = field(init=False)

    def __post_init__(self) -> None:
        self.passes_gate = gate(self.cosine, self.nrmse)
        self.ok = self.passes_gate == (self.expect == "pass")


def gate(cosine: float, nrmse: float) -> bool:
    """The numerical gate: cosine >= 0.99999 and NRMSE <= 0.5 % (NaN fails)."""
    return bool(cosine >= COSINE_MIN and nrmse <= NRMSE_MAX)


def compare(actual: torch.Tensor, expected: torch.Tensor) -> dict[str, float]:
    """cosine / NRMSE / max abs of `actual` against the fp32 reference (via the reference
    module, so the harness and `verify` measure the same way)."""
    from kimi_w31.converter.reference import compare as ref_compare

    if actual.shape != expected.shape:
        raise ValueError(f"shape mismatch {tuple(actual.shape)} vs {tuple(expected.shape)}")
    return ref_compare(actual.float().cpu().numpy(), expected.float().cpu().numpy())


def bitwise_equal(tensors: list[torch.Tensor]) -> bool:
    """All tensors have identical bytes (NaN-safe: compares bit patterns)."""
    first = tensors[0].contiguous().view(torch.uint8)
    return all(torch.equal(first, t.contiguous().view(torch.uint8)) for t in tensors[1:])


def verdict(cases: list[CaseResult], checks: Mapping[str, bool]) -> dict[str, bool]:
    """The overall gate of issue 5: every expected-pass case passes, every negative
    control fails, and every boolean check (graph replay, determinism) holds."""
    situ = [c for c in cases if c.expect == "pass"]
    negatives = [c for c in cases if c.expect == "fail"]
    out = {
        "expected_pass_cases_pass": bool(situ) and all(c.passes_gate for c in situ),
        "negative_controls_fail": bool(negatives) and not any(c.passes_gate for c in negatives),
        **{k: bool(v) for k, v in checks.items()},
    }
    out["overall"] = all(out.values())
    return out


def write_report(path: Path, report: Mapping[str, Any]) -> None:
    """Write the JSON report (cases as dicts), atomically."""

    def default(o: Any) -> Any:
        if isinstance(o, CaseResult):
            return asdict(o)
        if isinstance(o, Path):
            return str(o)
        raise TypeError(f"not JSON serialisable: {type(o).__name__}")

    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(report, indent=2, default=default, allow_nan=True) + "\n")
    tmp.replace(path)


def markdown_table(cases: list[CaseResult]) -> str:
    """The gate table for docs/gpu-validation.md."""
    rows = [
        "| case | kind | M | routing | cosine | NRMSE | max abs | expected | gate | ok |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for c in cases:
        rows.append(
            f"| {c.name} | {c.kind} | {c.m} | {c.routing} | {c.cosine:.7f} | "
            f"{100 * c.nrmse:.3f}% | {c.max_abs:.4g} | {c.expect} | "
            f"{'pass' if c.passes_gate else 'FAIL'} | {'yes' if c.ok else 'NO'} |"
        )
    return "\n".join(rows)
