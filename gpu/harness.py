"""GPU proof: the converted checkpoint computes the source model's MoE through the adapter.

Flow (see gpu/README.md for the full procedure on a fresh H200 machine):

1. load the converted checkpoint's `w31`/`w2` for E experts of one MoE layer and prepare
   them through `kimi_w31.adapter.flashinfer_moe` (the module the SGLang method calls);
2. load the SOURCE checkpoint's `w1`/`w3`/`w2` and build the fp32 reference
   (`kimi_w31.converter.reference`, numpy on the host: dequant, routing, GEMM1, SiTU,
   GEMM2, weighted sum);
3. run every case through the kernel and compare; run the negative controls, the
   CUDA-graph and determinism checks, and the SiTU vs SwiGLU timing;
4. write the JSON report (and a markdown table) to --out.

The kernel sits behind a small `Backend` interface so that the same case logic runs on
CPU with the torch reference standing in for the kernel (tests/test_gpu_harness.py).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch
from kimi_w31.converter import reference as ref

from . import cases as C

SITU_BETA = 4.0
SITU_LINEAR_BETA = 25.0
TOP_K = 16
SITU_MS = (1, 2, 8, 32, 128)
TIMING_MS = (1, 8, 32, 128, 512)
TUNE_BUCKETS = (1, 2, 8, 32, 128, 512)  # every M the harness uses
_DEFAULT: Any = object()  # "use the harness's own situ tensors"


def np_u8(t: torch.Tensor) -> np.ndarray:
    """A uint8 (or integer) tensor on any device as a host numpy array for the reference."""
    return t.detach().cpu().numpy()


def np_f32(t: torch.Tensor) -> np.ndarray:
    """A float tensor of any dtype (bf16 too) as a host fp32 numpy array."""
    return t.detach().float().cpu().numpy()


# --------------------------------------------------------------------------------------
# Backends
# --------------------------------------------------------------------------------------


class Backend(Protocol):
    name: str
    device: torch.device
    supports_graphs: bool

    def prepare(
        self, w31: tuple[torch.Tensor, torch.Tensor], w2: tuple[torch.Tensor, torch.Tensor]
    ) -> Any: ...  # noqa: E501

    def situ_params(self, e_local: int, beta: float, linear_beta: float) -> Any: ...

    def run(
        self,
        x: torch.Tensor,
        ids: torch.Tensor,
        weights: torch.Tensor,
        prepared: Any,
        betas: Any,
        *,
        ep_size: int = 1,
        ep_rank: int = 0,
        activation: str = "situ",
        use_fused_finalize: bool = True,
        output: torch.Tensor | None = None,
    ) -> torch.Tensor: ...


class FlashInferBackend:
    """The adapter's module on a CUDA GPU (SM90 here)."""

    supports_graphs = True

    def __init__(self, device: torch.device, tune_max_num_tokens: int = 512) -> None:
        from kimi_w31.adapter import flashinfer_moe as fm

        self.fm = fm
        self.device = device
        self.arch = fm.arch_of(device)
        self.name = f"flashinfer-cutlass-{self.arch}"
        self.tune_max_num_tokens = tune_max_num_tokens

    def prepare(self, w31, w2):
        dev = self.device
        return self.fm.prepare_weights(
            self.arch, w31[0].to(dev), w31[1].to(dev), w2[0].to(dev), w2[1].to(dev)
        )

    def situ_params(self, e_local, beta, linear_beta):
        return self.fm.situ_params(e_local, beta, linear_beta, device=self.device)

    def run(
        self,
        x,
        ids,
        weights,
        prepared,
        betas,
        *,
        ep_size=1,
        ep_rank=0,
        activation="situ",
        use_fused_finalize=True,
        output=None,
    ):
        beta, linear_beta = betas if betas is not None else (None, None)
        return self.fm.run_situ_moe(
            x.to(self.device),
            ids.to(self.device),
            weights.to(self.device),
            prepared,
            beta,
            linear_beta,
            output=output,
            ep_size=ep_size,
            ep_rank=ep_rank,
            activation=activation,
            use_fused_finalize=use_fused_finalize,
            tune_max_num_tokens=self.tune_max_num_tokens,
        )


class ReferenceBackend:
    """The torch reference standing in for the kernel (CPU tests of the harness logic).

    It consumes the CONVERTED tensors exactly as the kernel does (w31 read as [up; gate],
    low nibble first, situ tensors per local expert, global ids with an EP slice), and
    rounds the output to bf16 like the kernel's output.
    """

    name = "torch-reference"
    supports_graphs = False

    def __init__(self, device: torch.device | str = "cpu") -> None:
        self.device = torch.device(device)

    def prepare(self, w31, w2):
        e = w31[0].shape[0]
        return [
            ref.dequant_converted_expert(
                (np_u8(w31[0][i]), np_u8(w31[1][i])), (np_u8(w2[0][i]), np_u8(w2[1][i]))
            )
            for i in range(e)
        ]

    def situ_params(self, e_local, beta, linear_beta):
        return (torch.full((e_local,), beta), torch.full((e_local,), linear_beta))

    def run(
        self,
        x,
        ids,
        weights,
        prepared,
        betas,
        *,
        ep_size=1,
        ep_rank=0,
        activation="situ",
        use_fused_finalize=True,
        output=None,
    ):
        e_local = len(prepared)
        experts = {ep_rank * e_local + j: w for j, w in enumerate(prepared)}
        if activation == "swiglu":
            beta, linear_beta = SITU_BETA, SITU_LINEAR_BETA  # unused by SwiGLU
        elif betas is None:  # FlashInfer's compiled defaults
            beta, linear_beta = SITU_BETA, SITU_LINEAR_BETA
        else:
            # One value per local expert in the kernel; the harness always passes uniform ones.
            beta, linear_beta = float(betas[0][0]), float(betas[1][0])
        out = ref.moe_forward(
            np_f32(x),
            ids.detach().cpu().numpy(),
            np_f32(weights),
            experts,
            beta,
            linear_beta,
            activation,
        )
        out = torch.from_numpy(out).to(torch.bfloat16)
        if output is not None:
            output.copy_(out)
            return output
        return out


# --------------------------------------------------------------------------------------
# Data
# --------------------------------------------------------------------------------------


@dataclass
class LayerData:
    """One MoE layer: the converted tensors the kernel gets, the source reference experts."""

    w31: tuple[torch.Tensor, torch.Tensor]  # [E, 2N, K/2], [E, 2N, K/32]
    w2: tuple[torch.Tensor, torch.Tensor]  # [E, K, N/2], [E, K, N/32]
    reference: dict[int, ref.ExpertWeights]  # from the SOURCE w1/w3/w2
    num_experts: int
    hidden: int
    intermediate: int
    source_prefix: str
    converted_prefix: str


def load_layer(source: Path, converted: Path, num_experts: int) -> LayerData:
    """Converted w31/w2 for the kernel; the source's w1/w3/w2 dequantized for the reference."""
    cprefix, conv = C.load_experts(converted, ("w31", "w2"), num_experts)
    sprefix, src = C.load_experts(source, ("w1", "w3", "w2"), num_experts)
    reference = {}
    for e in range(num_experts):

        def pick(proj: str, e: int = e) -> tuple[np.ndarray, np.ndarray]:
            return np_u8(src[proj][0][e]), np_u8(src[proj][1][e])

        reference[e] = ref.dequant_expert(pick("w1"), pick("w3"), pick("w2"))
    e_, two_n, k_half = conv["w31"][0].shape
    return LayerData(
        w31=conv["w31"],
        w2=conv["w2"],
        reference=reference,
        num_experts=e_,
        hidden=k_half * 2,
        intermediate=two_n // 2,
        source_prefix=sprefix,
        converted_prefix=cprefix,
    )


# --------------------------------------------------------------------------------------
# Cases
# --------------------------------------------------------------------------------------


@dataclass
class Harness:
    backend: Backend
    layer: LayerData
    x_scale: float = 1.0
    top_k: int = TOP_K
    seed: int = 1234
    log: Callable[[str], None] = print

    def __post_init__(self) -> None:
        e = self.layer.num_experts
        self.prepared = self.backend.prepare(self.layer.w31, self.layer.w2)
        self.betas = self.backend.situ_params(e, SITU_BETA, SITU_LINEAR_BETA)
        self.empty_experts = (3, 2 * e // 3)  # (3, 18) for 28 experts

    # -- inputs and reference ------------------------------------------------------------
    def inputs(self, m: int, routing: C.Routing, seed_offset: int = 0):
        seed = self.seed + 1000 * m + seed_offset
        x = C.make_hidden(m, self.layer.hidden, seed, self.x_scale)
        r = C.make_routing(
            m,
            self.layer.num_experts,
            self.top_k,
            routing,
            seed + 1,
            empty_experts=self.empty_experts if routing == "empty_expert" else (),
        )
        return x, r

    def reference(
        self,
        x,
        r: C.RoutingTable,
        activation: str = "situ",
        beta: float = SITU_BETA,
        linear_beta: float = SITU_LINEAR_BETA,
    ) -> torch.Tensor:
        return torch.from_numpy(
            ref.moe_forward(
                np_f32(x),
                r.ids.numpy(),
                r.weights.numpy(),
                self.layer.reference,
                beta,
                linear_beta,
                activation,
            )
        )

    def gate_stats(self, m: int = 128) -> dict[str, float]:
        """Std of the gate/up pre-activations on the harness's inputs (realism check)."""
        x, r = self.inputs(m, "uniform")
        xf = np_f32(x)
        gates, ups = [], []
        for e in sorted(set(r.ids.flatten().tolist()))[:8]:
            w = self.layer.reference[e]
            gates.append(xf @ w.gate.T)
            ups.append(xf @ w.up.T)
        g, u = np.concatenate(gates), np.concatenate(ups)
        return {
            "gate_std": float(g.std(ddof=1)),
            "up_std": float(u.std(ddof=1)),
            "gate_frac_abs_gt_beta": float((np.abs(g) > SITU_BETA).mean()),
        }

    def case(
        self,
        name: str,
        kind: str,
        m: int,
        routing: C.Routing,
        *,
        expect: C.Expect = "pass",  # noqa: E501
        activation: str = "situ",
        note: str = "",
        prepared: Any = None,
        betas: Any = _DEFAULT,  # noqa: E501
        ref_kwargs: dict | None = None,
    ) -> C.CaseResult:
        x, r = self.inputs(m, routing)
        out = self.backend.run(
            x,
            r.ids,
            r.weights,
            self.prepared if prepared is None else prepared,
            self.betas if betas is _DEFAULT else betas,
            activation=activation,
        )
        stats = C.compare(out, self.reference(x, r, activation, **(ref_kwargs or {})))
        res = C.CaseResult(
            name=name, kind=kind, m=m, routing=routing, expect=expect, note=note, **stats
        )
        self.log(
            f"{name}: cos {res.cosine:.7f} nrmse {100 * res.nrmse:.3f}% "
            f"max {res.max_abs:.4g} gate {'pass' if res.passes_gate else 'FAIL'}"
            f" (expected {expect})"
        )
        return res

    def situ_cases(self) -> list[C.CaseResult]:
        out = []
        for m in SITU_MS:
            for routing in ("uniform", "skewed"):
                out.append(self.case(f"situ-M{m}-{routing}", "situ", m, routing))
        # Experts 3 and 17 receive no token at all.
        out.append(
            self.case(
                "situ-M32-empty-experts",
                "situ",
                32,
                "empty_expert",
                note=f"experts {list(self.empty_experts)} get no token",
            )
        )
        # No situ tensors: FlashInfer's compiled defaults must equal 4/25.
        out.append(
            self.case(
                "situ-M32-default-betas",
                "situ",
                32,
                "uniform",
                betas=None,
                note="situ_beta/situ_linear_beta = None (compiled defaults)",
            )
        )
        return out

    def masked_slot_case(self) -> tuple[C.CaseResult | None, str]:
        """A -1 in the top-k ids: does the kernel skip the slot like the reference does?"""
        try:
            res = self.case(
                "situ-M32-masked-slot",
                "situ",
                32,
                "masked_slot",
                note=f"slot {self.top_k - 1} of every other token is -1",
            )
        except Exception as exc:  # the kernel may reject negative ids: report, not crash
            return None, f"rejected: {type(exc).__name__}: {exc}"
        behaviour = (
            "skipped (contributes nothing), same as the reference"
            if res.passes_gate
            else "differs from skipping the slot"
        )
        return res, behaviour

    def swiglu_cases(self) -> list[C.CaseResult]:
        return [
            self.case(
                f"swiglu-M{m}-uniform",
                "swiglu",
                m,
                "uniform",
                activation="swiglu",
                betas=None,
                note="control: plain silu(gate)*up on the same data",
            )
            for m in (8, 128)
        ]

    def ep_cases(self, ep_size: int = 2) -> list[C.CaseResult]:
        """Each rank gets its contiguous slice of experts with global ids; sum = full MoE."""
        slices = C.ep_slices(self.layer.num_experts, ep_size)
        prepared = [
            self.backend.prepare(
                tuple(t[s.start : s.stop] for t in self.layer.w31),
                tuple(t[s.start : s.stop] for t in self.layer.w2),
            )
            for s in slices
        ]
        betas = [self.backend.situ_params(len(s), SITU_BETA, SITU_LINEAR_BETA) for s in slices]
        results = []
        for m, routing in ((8, "uniform"), (128, "skewed")):
            x, r = self.inputs(m, routing)
            total = torch.zeros(m, self.layer.hidden)
            for rank in range(ep_size):
                y = self.backend.run(
                    x, r.ids, r.weights, prepared[rank], betas[rank], ep_size=ep_size, ep_rank=rank
                )
                total += y.float().cpu()
            single = self.backend.run(x, r.ids, r.weights, self.prepared, self.betas)
            diff = (total - single.float().cpu()).abs().max().item()
            stats = C.compare(total, self.reference(x, r))
            res = C.CaseResult(
                name=f"ep{ep_size}-M{m}-{routing}",
                kind="ep",
                m=m,
                routing=routing,
                note=f"sum of {ep_size} ranks; max |sum - single-rank| = {diff:.4g}",
                **stats,
            )
            self.log(f"{res.name}: cos {res.cosine:.7f} nrmse {100 * res.nrmse:.3f}% ({res.note})")
            results.append(res)
        return results

    def negative_controls(self) -> list[C.CaseResult]:
        w31, w2 = self.layer.w31, self.layer.w2
        swapped = self.backend.prepare((C.swap_fc1_halves(w31[0]), C.swap_fc1_halves(w31[1])), w2)
        nibbles = self.backend.prepare(
            (C.swap_nibbles(w31[0]), w31[1]), (C.swap_nibbles(w2[0]), w2[1])
        )
        e = self.layer.num_experts
        beta_swap = self.backend.situ_params(e, SITU_LINEAR_BETA, SITU_BETA)
        out = [
            self.case(
                "neg-fc1-halves-swapped",
                "negative",
                32,
                "uniform",
                expect="fail",
                prepared=swapped,
                note="w31 fed as [gate; up]",
            ),
            self.case(
                "neg-betas-swapped",
                "negative",
                32,
                "uniform",
                expect="fail",
                betas=beta_swap,
                note="situ_beta 25, situ_linear_beta 4",
            ),
            self.case(
                "neg-nibble-order",
                "negative",
                32,
                "uniform",
                expect="fail",
                prepared=nibbles,
                note="FP4 codes read high nibble first",
            ),
        ]
        del swapped, nibbles
        return out

    # -- GPU-only checks -----------------------------------------------------------------
    def determinism(self, m: int = 32, runs: int = 3) -> dict[str, Any]:
        x, r = self.inputs(m, "skewed")
        outs = {
            ff: [
                self.backend.run(
                    x, r.ids, r.weights, self.prepared, self.betas, use_fused_finalize=ff
                ).clone()
                for _ in range(runs)
            ]
            for ff in (False, True)
        }
        return {
            "deterministic_finalize_bitwise": C.bitwise_equal(outs[False]),
            "fused_finalize_bitwise_informational": C.bitwise_equal(outs[True]),
        }

    def graph_replay(self, m: int = 32) -> dict[str, Any]:
        """Eager vs CUDA-graph capture + two replays, deterministic finalize: bit-identical."""
        dev = self.backend.device
        x, r = self.inputs(m, "uniform")
        sx, sids, sw = x.to(dev), r.ids.to(dev), r.weights.to(dev)
        out = torch.empty(m, self.layer.hidden, dtype=torch.bfloat16, device=dev)

        def call():
            return self.backend.run(
                sx, sids, sw, self.prepared, self.betas, use_fused_finalize=False, output=out
            )

        eager = call().clone()
        stream = torch.cuda.Stream(device=dev)
        stream.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(stream):
            for _ in range(2):
                call()  # warm-up on the capture stream, as CUDA-graph users do
        torch.cuda.current_stream(dev).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        out.zero_()
        with torch.cuda.graph(graph):
            call()
        replays = []
        for _ in range(2):
            out.zero_()
            graph.replay()
            torch.cuda.synchronize(dev)
            replays.append(out.clone())
        return {
            "graph_replay_bitwise": C.bitwise_equal([eager, *replays]),
            "graph_replay_vs_reference_cosine": C.compare(replays[0], self.reference(x, r))[
                "cosine"
            ],
        }

    def autotune(self, buckets: Sequence[int] = TUNE_BUCKETS) -> dict[str, Any]:
        """Profile tactics for both activations over `buckets` tokens, as SGLang's warm-up
        does, so that every later call (correctness, graphs, timing) uses tuned tactics."""
        from flashinfer.autotuner import autotune

        dev = self.backend.device
        t0 = time.time()
        for m in sorted(buckets, reverse=True):
            x, r = self.inputs(m, "uniform", seed_offset=7)
            for act in ("situ", "swiglu"):
                with autotune(True):
                    self.backend.run(
                        x,
                        r.ids,
                        r.weights,
                        self.prepared,
                        self.betas if act == "situ" else None,
                        activation=act,
                    )
        torch.cuda.synchronize(dev)
        return {"buckets": list(buckets), "seconds": round(time.time() - t0, 1)}

    def timing(self, ms: Sequence[int] = TIMING_MS, iters: int = 50) -> list[dict[str, Any]]:
        """SiTU vs SwiGLU per call at the real per-rank shape: CUDA events, after autotuning.

        Both eager calls (what a non-graph forward pays, Python included) and CUDA-graph
        replays (what decode under graphs pays: kernels only) are timed.
        """
        dev = self.backend.device
        rows = []
        for m in ms:
            x, r = self.inputs(m, "uniform")
            sx, sids, sw = x.to(dev), r.ids.to(dev), r.weights.to(dev)
            out = torch.empty(m, self.layer.hidden, dtype=torch.bfloat16, device=dev)
            row: dict[str, Any] = {"m": m}
            for act in ("situ", "swiglu"):
                betas = self.betas if act == "situ" else None

                def call(act=act, betas=betas, sx=sx, sids=sids, sw=sw, out=out):
                    return self.backend.run(
                        sx, sids, sw, self.prepared, betas, activation=act, output=out
                    )

                row[f"{act}_eager_ms"] = time_events(call, iters, dev)
                graph = torch.cuda.CUDAGraph()
                stream = torch.cuda.Stream(device=dev)
                stream.wait_stream(torch.cuda.current_stream(dev))
                with torch.cuda.stream(stream):
                    call()
                torch.cuda.current_stream(dev).wait_stream(stream)
                with torch.cuda.graph(graph):
                    call()
                row[f"{act}_graph_ms"] = time_events(graph.replay, iters, dev)
            row["ratio_eager"] = row["situ_eager_ms"] / row["swiglu_eager_ms"]
            row["ratio_graph"] = row["situ_graph_ms"] / row["swiglu_graph_ms"]
            self.log(
                f"timing M={m}: " + ", ".join(f"{k} {v:.4f}" for k, v in row.items() if k != "m")
            )
            rows.append(row)
        return rows


def time_events(fn: Callable[[], Any], iters: int, dev: torch.device) -> float:
    """Median ms per call over `iters` CUDA-event-timed calls after 5 warm-ups."""
    for _ in range(5):
        fn()
    torch.cuda.synchronize(dev)
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    times.sort()
    return times[len(times) // 2]


def run_all(
    h: Harness,
    *,
    gpu_checks: bool,
    timing: bool,
    checkpoint: Callable[[dict[str, Any]], None] = lambda report: None,
) -> dict[str, Any]:
    """Every case, check and timing; returns the report dict (see write_report).

    The masked-slot case runs last: if the kernel faulted on a -1 id, the CUDA context
    would be lost, so everything else is measured (and checkpointed) before it.
    """
    t0 = time.time()
    report: dict[str, Any] = {
        "backend": h.backend.name,
        "x_scale": h.x_scale,
        "input_stats": h.gate_stats(),
    }
    h.log(f"input stats: {report['input_stats']}")
    if timing:
        try:
            report["autotune"] = h.autotune()
        except Exception as exc:  # measured untuned then, and said so in the report
            report["autotune"] = {"error": f"{type(exc).__name__}: {exc}"}
        h.log(f"autotune: {report['autotune']}")
    results = h.situ_cases()
    results += h.ep_cases()
    results += h.swiglu_cases()
    results += h.negative_controls()
    checks: dict[str, bool] = {}
    if gpu_checks:
        det = h.determinism()
        graph = h.graph_replay()
        report["determinism"], report["graph"] = det, graph
        checks["deterministic_finalize_bitwise"] = det["deterministic_finalize_bitwise"]
        checks["graph_replay_bitwise"] = graph["graph_replay_bitwise"]
    if timing:
        report["timing"] = h.timing()
    report["cases"], report["checks"] = results, checks
    report["verdict"] = C.verdict(results, checks)
    checkpoint(report)
    masked, behaviour = h.masked_slot_case()
    report["masked_slot"] = {"behaviour": behaviour, "in_gate": masked is not None}
    if masked is not None:
        results.append(masked)
    report["cases"] = results
    report["checks"] = checks
    report["verdict"] = C.verdict(results, checks)
    report["elapsed_s"] = round(time.time() - t0, 1)
    return report


def environment() -> dict[str, Any]:
    env: dict[str, Any] = {
        "date_utc": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
    }
    if torch.cuda.is_available():
        env["gpu"] = torch.cuda.get_device_name(0)
        env["capability"] = ".".join(map(str, torch.cuda.get_device_capability(0)))
    try:
        import flashinfer

        env["flashinfer"] = flashinfer.__version__
    except Exception as exc:  # reported, not fatal: the CPU stand-in needs no FlashInfer
        env["flashinfer"] = f"unavailable ({exc!r})"
    return env


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="GPU proof of the converted checkpoint (issue 5)")
    p.add_argument("--source", type=Path, required=True, help="source checkpoint (w1/w3/w2)")
    p.add_argument("--converted", type=Path, required=True, help="kimi-convert output (w31/w2)")
    p.add_argument("--out", type=Path, required=True, help="directory for report.json/.md")
    p.add_argument("--experts", type=int, default=28)
    p.add_argument("--top-k", type=int, default=TOP_K)
    p.add_argument("--x-scale", type=float, default=1.0, help="std of the random activations")
    p.add_argument("--backend", choices=("flashinfer", "reference"), default="flashinfer")
    p.add_argument(
        "--trimmed-flashinfer",
        action="store_true",
        help="use the trimmed W4A16 FlashInfer module (gpu/trimmed_build.py)",
    )
    p.add_argument("--no-timing", action="store_true")
    args = p.parse_args(argv)

    args.out.mkdir(parents=True, exist_ok=True)
    log_file = (args.out / "harness.log").open("a")

    def log(msg: str) -> None:
        line = f"[{time.strftime('%H:%M:%S')}] {msg}"
        print(line, flush=True)
        log_file.write(line + "\n")
        log_file.flush()

    gpu = args.backend == "flashinfer"
    if gpu:
        if not torch.cuda.is_available():
            log("no CUDA device: use --backend reference for the CPU stand-in")
            return 2
        if args.trimmed_flashinfer:
            from . import trimmed_build

            prebuilt = os.environ.get("KIMI_W31_PREBUILT_MOE_SO")
            trimmed_build.install(Path(prebuilt) if prebuilt else None)
        from kimi_w31.adapter.flashinfer_moe import check_situ_support

        log(f"flashinfer SiTU support: {check_situ_support()}")
        backend: Backend = FlashInferBackend(torch.device("cuda", 0))
    else:
        backend = ReferenceBackend()
    env = environment()
    log(f"environment: {env}")
    t = time.time()
    layer = load_layer(args.source, args.converted, args.experts)
    log(
        f"loaded {layer.num_experts} experts (K {layer.hidden}, N {layer.intermediate}) "
        f"from {layer.converted_prefix} in {time.time() - t:.1f} s"
    )
    h = Harness(backend, layer, x_scale=args.x_scale, top_k=args.top_k, log=log)
    meta = {
        "environment": env,
        "command": " ".join(["python -m gpu.harness", *(sys.argv[1:] if argv is None else argv)]),
        "dims": {
            "experts": layer.num_experts,
            "top_k": args.top_k,
            "K": layer.hidden,
            "N": layer.intermediate,
            "prefix": layer.converted_prefix,
        },
        "gate": {"cosine_min": C.COSINE_MIN, "nrmse_max": C.NRMSE_MAX},
        "trimmed_flashinfer": bool(args.trimmed_flashinfer),
    }

    def save(report: dict[str, Any]) -> None:
        C.write_report(args.out / "report.json", {**meta, **report})
        (args.out / "report.md").write_text(C.markdown_table(report["cases"]) + "\n")

    report = run_all(h, gpu_checks=gpu, timing=gpu and not args.no_timing, checkpoint=save)
    save(report)
    log(f"verdict: {json.dumps(report['verdict'])}")
    return 0 if report["verdict"]["overall"] else 1


if __name__ == "__main__":
    sys.exit(main())
