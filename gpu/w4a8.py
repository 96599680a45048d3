"""SM90 W4A8 ("Humming": FP8 activations x MXFP4 weights) with SiTU, on the H200.

    python -m gpu.w4a8 --module w4a8 --source SRC --converted CONV --out OUT
    python -m gpu.w4a8 --module w4a16 --source SRC --converted CONV --out OUT --prebuilt SO
    python -m gpu.w4a8 --module w4a8 --memory --out OUT --prebuilt SO

`--module w4a8` loads the trimmed Humming module (gpu/trimmed_build.py --variant w4a8),
prepares the converted layer through `adapter/flashinfer_moe.prepare_sm90_humming`, checks
SiTU against the reference (the activation FP8 quantization modelled, see
`fp8_rows`), runs the negative controls and times SiTU W4A8. `--module w4a16` times SiTU and
SwiGLU W4A16 on the same weights and inputs. FlashInfer caches one SM90 module per process,
so the two run as two processes; `merge` puts their timings into one table. `--no-timing`
runs the checks alone. `--memory` measures the Humming preparation's GPU memory (whole, as
one FlashInfer call, against chunked, as the adapter prepares it) at per-rank shapes, and
checks that both give the same bytes.

What the reference models: the kernel quantizes its activations to FP8 E4M3 per row (the
layer input per token; the SiTU output per routed (token, expert) row) with a dynamic scale;
we model amax/448 per row, round-to-nearest-even (torch's float8_e4m3fn cast). The weights
need no model: Humming's payload rewrite is exact for groups within an expert's E8M0 range.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from kimi_w31.converter import reference as ref

from . import cases as C
from . import harness as H

# The W4A8 gate, fixed before the first GPU run. The seeds' MXFP8 x MXFP4 path reached cosine
# 0.99962 / NRMSE 2.8 % against an unquantized reference; ours models the activation
# quantization, so a correct kernel should do at least as well, and every layout or
# activation mistake we know of misses by an order of magnitude (halves swapped: ~100 %,
# betas swapped: ~48 %, residual without x64: ~98 %).
W4A8_COSINE_MIN = 0.9995
W4A8_NRMSE_MAX = 0.035
FP8_MAX = 448.0
CHECK_MS = (1, 8, 32, 128)
TIMING_MS = (1, 8, 32, 128, 512, 2048, 4096, 8192)


def fp8_rows(a: np.ndarray) -> np.ndarray:
    """Per-row dynamic FP8 E4M3 quantize-dequantize: scale amax/448, round to nearest even."""
    t = torch.from_numpy(np.ascontiguousarray(a, dtype=np.float32))
    scale = t.abs().amax(dim=1, keepdim=True).clamp_min(1e-30) / FP8_MAX
    q = (t / scale).to(torch.float8_e4m3fn).float() * scale
    return q.numpy()


def w4a8_reference(
    x: np.ndarray,
    ids: np.ndarray,
    weights: np.ndarray,
    experts: dict[int, ref.ExpertWeights],
    beta: float,
    linear_beta: float,
) -> np.ndarray:
    """`reference.moe_forward` with the kernel's two FP8 activation quantizations modelled."""
    xq = fp8_rows(x)
    out = np.zeros_like(xq)
    for eid in np.unique(ids).tolist():
        if eid < 0 or eid not in experts:
            continue
        rows, slots = np.nonzero(ids == eid)
        w = experts[eid]
        hidden = ref.situ(xq[rows] @ w.gate.T, xq[rows] @ w.up.T, beta, linear_beta)
        np.add.at(out, rows, (fp8_rows(hidden) @ w.down.T) * weights[rows, slots][:, None])
    return out


def w4a8_gate(cos: float, nrmse: float) -> bool:
    return bool(cos >= W4A8_COSINE_MIN and nrmse <= W4A8_NRMSE_MAX)


def tp_rank_tensors(layer: H.LayerData, tp: int, rank: int) -> tuple[tuple, tuple]:
    """What moe-TP rank `rank` of `tp` holds: [up_r; gate_r] rows of w31, w2 columns."""
    n = layer.intermediate
    r0, r1 = rank * n // tp, (rank + 1) * n // tp
    w31 = tuple(
        torch.cat([t[:, r0:r1], t[:, n + r0 : n + r1]], dim=1).contiguous() for t in layer.w31
    )
    w2 = (
        layer.w2[0][:, :, r0 // 2 : r1 // 2].contiguous(),
        layer.w2[1][:, :, r0 // 32 : r1 // 32].contiguous(),
    )
    return w31, w2


class W4A8:
    def __init__(self, layer: H.LayerData, log: Callable[[str], None], seed: int = 1234) -> None:
        from kimi_w31.adapter import flashinfer_moe as fm

        self.fm, self.layer, self.log, self.seed = fm, layer, log, seed
        self.dev = torch.device("cuda", 0)
        self.prepared = self.prepare(layer.w31, layer.w2)
        self.betas = fm.situ_params(layer.num_experts, 4.0, 25.0, device=self.dev)

    def prepare(self, w31: tuple, w2: tuple, **kw: Any) -> Any:
        d = self.dev
        return self.fm.prepare_sm90_humming(
            w31[0].to(d), w31[1].to(d), w2[0].to(d), w2[1].to(d), **kw
        )

    def inputs(self, m: int) -> tuple[torch.Tensor, C.RoutingTable]:
        x = C.make_hidden(m, self.layer.hidden, self.seed + m)
        return x, C.make_routing(m, self.layer.num_experts, 16, "uniform", self.seed + m + 1)

    def run(
        self, x: torch.Tensor, r: C.RoutingTable, prepared: Any = None, betas: Any = None
    ) -> torch.Tensor:
        beta, lb = betas or self.betas
        return self.fm.run_situ_moe(
            x.to(self.dev),
            r.ids.to(self.dev),
            r.weights.to(self.dev),
            prepared or self.prepared,
            beta,
            lb,
        )

    def case(
        self,
        name: str,
        m: int,
        *,
        expect: str = "pass",
        prepared: Any = None,
        betas: Any = None,
        experts: dict | None = None,
        note: str = "",
    ) -> dict[str, Any]:
        x, r = self.inputs(m)
        out = self.run(x, r, prepared, betas).float().cpu().numpy()
        xs, ids, w = x.float().numpy(), r.ids.numpy(), r.weights.numpy()
        experts = experts or self.layer.reference
        modelled = ref.compare(out, w4a8_reference(xs, ids, w, experts, 4.0, 25.0))
        plain = ref.compare(out, ref.moe_forward(xs, ids, w, experts, 4.0, 25.0))
        row = {
            "name": name,
            "m": m,
            "expect": expect,
            "note": note,
            "vs_fp8_modelled": modelled,
            "vs_unquantized": plain,
            "passes_gate": w4a8_gate(modelled["cosine"], modelled["nrmse"]),
        }
        row["ok"] = row["passes_gate"] == (expect == "pass")
        self.log(
            f"{name}: modelled cos {modelled['cosine']:.6f} nrmse "
            f"{100 * modelled['nrmse']:.3f}% | unquantized cos {plain['cosine']:.6f} "
            f"nrmse {100 * plain['nrmse']:.3f}% -> {'pass' if row['passes_gate'] else 'FAIL'}"
            f" (expected {expect})"
        )
        return row

    def checks(self) -> list[dict[str, Any]]:
        rows = [self.case(f"w4a8-situ-M{m}", m) for m in CHECK_MS]
        for tp in (8, 2):
            w31, w2 = tp_rank_tensors(self.layer, tp, 0)
            sliced = {e: _slice(w, tp, 0) for e, w in self.layer.reference.items()}
            rows.append(
                self.case(
                    f"w4a8-tp{tp}-rank0-N{self.layer.intermediate // tp}",
                    32,
                    prepared=self.prepare(w31, w2),
                    experts=sliced,
                )
            )
        swap = tuple(C.swap_fc1_halves(t) for t in self.layer.w31)
        e = self.layer.num_experts
        rows += [
            self.case(
                "neg-halves-swapped",
                32,
                expect="fail",
                prepared=self.prepare(swap, self.layer.w2),
                note="w31 as [gate; up]",
            ),
            self.case(
                "neg-betas-swapped",
                32,
                expect="fail",
                betas=self.fm.situ_params(e, 25.0, 4.0, device=self.dev),
                note="situ_beta 25, situ_linear_beta 4",
            ),
            self.case(
                "neg-residual-without-x64",
                32,
                expect="fail",
                prepared=self.prepare(self.layer.w31, self.layer.w2, residual_factor=1.0),
                note="Humming residual scales passed without the 2^6 factor",
            ),
        ]
        return rows


# Per-rank expert shapes for the preparation-memory measurement: (name, local experts, K,
# N per rank). The gate's shapes (28 experts, TP8 / TP2 slices of N) and the deployments'
# (every expert at moe-TP 8 and 2; 56 experts whole at EP16, the 16xH200 layout).
MEMORY_SHAPES = (
    ("gate-tp8", 28, 3584, 384),
    ("gate-tp2", 28, 3584, 1536),
    ("tp8-rank", 896, 3584, 384),
    ("tp2-rank", 896, 3584, 1536),
    ("ep16-rank", 56, 3584, 3072),
)
UNCHUNKED = 1 << 62  # a budget no layer reaches: one preprocessing call per tensor (before)


def random_layer(e: int, k: int, n: int, seed: int, dev: Any) -> tuple[torch.Tensor, ...]:
    """Random packed FP4 and E8M0 scales spread over 20 binades, so that Humming's
    per-expert range clamp (11) is active and differs between experts."""
    g = torch.Generator(device=dev).manual_seed(seed)

    def u8(shape: tuple[int, ...], lo: int, hi: int) -> torch.Tensor:
        return torch.randint(lo, hi, shape, generator=g, device=dev, dtype=torch.uint8)

    return (
        u8((e, 2 * n, k // 2), 0, 256),
        u8((e, 2 * n, k // 32), 110 + seed % 3, 131),
        u8((e, k, n // 2), 0, 256),
        u8((e, k, n // 32), 112, 131),
    )


def _prepared_equal(a: Any, b: Any) -> bool:
    pairs = [(a.fc1, b.fc1), (a.fc2, b.fc2), *zip(a.quant_scales, b.quant_scales, strict=True)]
    return all(x.shape == y.shape and torch.equal(x, y) for x, y in pairs)


def prep_memory(log: Callable[[str], None], shapes: tuple = MEMORY_SHAPES) -> dict[str, Any]:
    """torch.cuda.max_memory_allocated around `prepare_sm90_humming`, above the inputs, for
    one call per tensor (before) and the chunked preparation (after); bytes compared."""
    from kimi_w31.adapter import flashinfer_moe as fm

    dev = torch.device("cuda", 0)
    gib = float(1 << 30)
    rows = []
    for i, (name, e, k, n) in enumerate(shapes):
        torch.cuda.empty_cache()
        inputs = random_layer(e, k, n, 40 + i, dev)
        fc1_bytes = inputs[0].numel()
        row: dict[str, Any] = {
            "shape": name,
            "experts": e,
            "K": k,
            "N_rank": n,
            "fc1_packed_gib": fc1_bytes / gib,
            "fc2_packed_gib": inputs[2].numel() / gib,
            "experts_per_chunk_fc1": fm.experts_per_chunk(2 * n * k // 2),
            "experts_per_chunk_fc2": fm.experts_per_chunk(k * n // 2),
        }
        results = {}
        for mode, budget in (("unchunked", UNCHUNKED), ("chunked", fm.HUMMING_PREP_BUDGET)):
            torch.cuda.synchronize()
            base = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            t = time.time()
            try:
                results[mode] = fm.prepare_sm90_humming(*inputs, budget=budget)
            except torch.cuda.OutOfMemoryError as exc:
                row[mode] = {"oom": str(exc).split("\n")[0][:200]}
                log(f"{name} {mode}: out of memory")
                torch.cuda.empty_cache()
                continue
            torch.cuda.synchronize()
            peak = torch.cuda.max_memory_allocated() - base
            kept = torch.cuda.memory_allocated() - base
            row[mode] = {
                "peak_above_inputs_gib": peak / gib,
                "outputs_gib": kept / gib,
                "transient_gib": (peak - kept) / gib,
                "peak_over_fc1_packed": peak / fc1_bytes,
                "seconds": round(time.time() - t, 3),
            }
            log(f"{name} {mode}: {row[mode]}")
        if len(results) == 2:
            same = _prepared_equal(results["unchunked"], results["chunked"])
            row["chunked_equals_unchunked"] = same
            log(f"{name}: chunked == unchunked bit for bit: {same}")
        del results, inputs
        rows.append(row)
    bound = fm.HUMMING_PREP_BUDGET / gib
    return {
        "budget_gib": bound,
        "bytes_per_packed_byte": fm.HUMMING_PREP_BYTES_PER_PACKED_BYTE,
        "rows": rows,
        "verdict": {
            "chunked_equals_unchunked": all(r.get("chunked_equals_unchunked", True) for r in rows),
            # the stated bound: the outputs plus at most the budget above the inputs
            "chunked_peak_within_outputs_plus_budget": all(
                "peak_above_inputs_gib" in r.get("chunked", {})
                and r["chunked"]["peak_above_inputs_gib"] <= r["chunked"]["outputs_gib"] + bound
                for r in rows
            ),
        },
    }


def _slice(w: ref.ExpertWeights, tp: int, rank: int) -> ref.ExpertWeights:
    n = w.gate.shape[0]
    sl = slice(rank * n // tp, (rank + 1) * n // tp)
    return ref.ExpertWeights(gate=w.gate[sl], up=w.up[sl], down=w.down[:, sl])


def timing(
    run: Callable[[int, str], Callable[[], Any]],
    acts: tuple[str, ...],
    log: Callable[[str], None],
    ms: tuple[int, ...] = TIMING_MS,
) -> list[dict[str, Any]]:
    from .graph_timing import graph_replay_ms

    rows = []
    for m in ms:
        row: dict[str, Any] = {"m": m}
        for act in acts:
            row[f"{act}_graph_ms"] = graph_replay_ms(run(m, act), iters=30)
        log(f"timing M={m}: {row}")
        rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--module", choices=("w4a8", "w4a16"), required=True)
    p.add_argument("--source", type=Path)
    p.add_argument("--converted", type=Path)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--prebuilt", type=Path, default=None)
    p.add_argument("--experts", type=int, default=28)
    p.add_argument("--no-checks", action="store_true")
    p.add_argument("--no-timing", action="store_true", help="the checks alone, no timing")
    p.add_argument(
        "--memory",
        action="store_true",
        help="measure the Humming preparation's memory (whole vs chunked) and nothing else",
    )
    p.add_argument(
        "--autotune",
        action="store_true",
        help="profile FlashInfer's tactics at every timed M first (as SGLang's warm-up)",
    )
    p.add_argument("--ms", default=",".join(map(str, TIMING_MS)), help="timed token counts")
    args = p.parse_args(argv)
    timing_ms = tuple(int(m) for m in args.ms.split(","))
    args.out.mkdir(parents=True, exist_ok=True)
    fh = (args.out / f"w4a8-{args.module}.log").open("a")

    def log(msg: str) -> None:
        line = f"[{time.strftime('%H:%M:%S')}] {msg}"
        print(line, flush=True)
        fh.write(line + "\n")
        fh.flush()

    from . import trimmed_build as T

    T.install(args.prebuilt, T.VARIANTS[args.module])
    from kimi_w31.adapter import flashinfer_moe as fm

    if args.memory:
        mem = {"environment": H.environment(), **prep_memory(log)}
        (args.out / "report-w4a8-memory.json").write_text(json.dumps(mem, indent=1))
        log(f"memory verdict: {mem['verdict']}")
        return 0 if all(mem["verdict"].values()) else 1
    t = time.time()
    layer = H.load_layer(args.source, args.converted, args.experts)
    log(f"loaded {layer.num_experts} experts in {time.time() - t:.1f} s")
    report: dict[str, Any] = {
        "module": args.module,
        "environment": H.environment(),
        "gate": {"cosine_min": W4A8_COSINE_MIN, "nrmse_max": W4A8_NRMSE_MAX},
    }
    dev = torch.device("cuda", 0)
    if args.module == "w4a8":
        w = W4A8(layer, log)
        if not args.no_checks:
            rows = w.checks()
            report["cases"] = rows
            report["verdict"] = {"all_as_expected": all(r["ok"] for r in rows)}
        prepared, betas = w.prepared, w.betas
        acts: tuple[str, ...] = ("situ",)
    else:
        prepared = fm.prepare_sm90(*(t_.to(dev) for t_ in (*layer.w31, *layer.w2)))
        betas = fm.situ_params(layer.num_experts, 4.0, 25.0, device=dev)
        acts = ("situ", "swiglu")

    def make(m: int, act: str) -> Callable[[], Any]:
        x, r = (
            C.make_hidden(m, layer.hidden, 77 + m).to(dev),
            C.make_routing(m, layer.num_experts, 16, "uniform", 78 + m),
        )
        ids, wts = r.ids.to(dev), r.weights.to(dev)
        out = torch.empty(m, layer.hidden, dtype=torch.bfloat16, device=dev)
        b = betas if act == "situ" else (None, None)
        return lambda: fm.run_situ_moe(x, ids, wts, prepared, *b, output=out, activation=act)

    if args.no_timing:
        (args.out / f"report-w4a8-{args.module}-checks.json").write_text(
            json.dumps(report, indent=1)
        )
        log(f"verdict: {report.get('verdict')}")
        return 0 if report.get("verdict", {}).get("all_as_expected", False) else 1
    if args.autotune:
        from flashinfer.autotuner import autotune

        t = time.time()
        for m in sorted(timing_ms, reverse=True):
            for act in acts:
                with autotune(True):
                    make(m, act)()
        torch.cuda.synchronize()
        report["autotune_s"] = round(time.time() - t, 1)
        log(f"autotuned {timing_ms} in {report['autotune_s']} s")
    report["timing"] = timing(make, acts, log, timing_ms)
    report["timing_note"] = "CUDA-graph replays, median of 30, " + (
        "after FlashInfer's autotuner" if args.autotune else "FlashInfer's default tactic"
    )
    tag = "-tuned" if args.autotune else ""
    (args.out / f"report-w4a8-{args.module}{tag}.json").write_text(json.dumps(report, indent=1))
    ok = report.get("verdict", {}).get("all_as_expected", True)
    log(f"verdict: {report.get('verdict')}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
