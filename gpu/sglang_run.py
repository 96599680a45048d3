"""The SGLang-in-the-loop suites (building blocks in gpu/sglang_layer.py).

    python -m gpu.sglang_run single --source SRC --converted CONV --out OUT [--prebuilt SO]
    python -m gpu.sglang_run dist --ep 1|2 --source SRC --converted CONV --out OUT [--prebuilt SO]
    python -m gpu.sglang_run dist --ep 1|2 --precision fp8 ... --prebuilt W4A8_SO

`single` (one GPU): the adapter's path on the converted checkpoint (M = 1..128), the
per-rank shapes of TP8 (N/tp 384) and TP2 (1536), eager vs CUDA graph, the negative
controls (unconverted checkpoint through SGLang's stock path; w31 halves swapped), the
stock path against the activation it really applies (the harness control), and the two
measurements of the review (the output copy; the fused route+quant TopK).
`dist` (two GPUs, NCCL): two processes, TP2 (`--ep 1`) or EP2 (`--ep 2`), each rank
loading what SGLang gives it, forward, SGLang's all-reduce, compared on rank 0; with
`--precision fp8` the W4A8 (Humming) path against the FP8-modelled reference and the W4A8
gate of `single-w4a8`, with the halves-swapped control.
Writes report-<suite>.json/.md under OUT; exit 0 only if the suite's verdict passes.
"""

from __future__ import annotations

import argparse
import datetime as dt
import gc
import hashlib
import json
import os
import platform
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from . import cases as C
from . import sglang_cases as S
from . import sglang_layer as L
from .graph_timing import capture, graph_replay_ms

SINGLE_MS = (1, 8, 32, 128)
DIST_MS = (8, 128)
TIMING_MS = (1, 8, 32, 128)


def _log_to(out: Path, name: str) -> Callable[[str], None]:
    fh = (out / f"{name}.log").open("a")

    def log(msg: str) -> None:
        line = f"[{time.strftime('%H:%M:%S')}] {msg}"
        print(line, flush=True)
        fh.write(line + "\n")
        fh.flush()

    return log


def prepare_process(prebuilt: Path | None, module: str = "w4a16") -> None:
    """Per process, before SGLang or FlashInfer's MoE is used: stub, module, plugins."""
    L.install_sgl_kernel_stub()
    from . import trimmed_build

    trimmed_build.install(prebuilt, trimmed_build.VARIANTS[module])
    L.load_plugins_checked()


def environment() -> dict[str, Any]:
    import torch

    env: dict[str, Any] = {
        "date_utc": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "gpus": torch.cuda.device_count(),
    }
    if torch.cuda.is_available():
        env["gpu"] = torch.cuda.get_device_name(0)
        env["capability"] = ".".join(map(str, torch.cuda.get_device_capability(0)))
    for mod in ("sglang", "flashinfer", "triton", "transformers"):
        try:
            env[mod] = __import__(mod).__version__
        except Exception as exc:  # reported, not fatal
            env[mod] = f"unavailable ({exc!r})"
    return env


def _case(
    name: str,
    kind: str,
    m: int,
    out: Any,
    want: np.ndarray,
    *,
    expect: str = "pass",
    note: str = "",
) -> C.CaseResult:
    stats = S_compare(out, want)
    return C.CaseResult(
        name=name,
        kind=kind,
        m=m,
        routing="kimi-topk",
        expect=expect,  # type: ignore[arg-type]
        note=note,
        **stats,
    )


def S_compare(out: Any, want: np.ndarray) -> dict[str, float]:  # noqa: N802
    from kimi_w31.converter import reference as ref

    got = out.float().cpu().numpy()
    if got.shape != want.shape:
        raise ValueError(f"shape mismatch {got.shape} vs {want.shape}")
    return ref.compare(got, want)


# --------------------------------------------------------------------------------------
# single GPU
# --------------------------------------------------------------------------------------


class Single:
    def __init__(self, args: argparse.Namespace, log: Callable[[str], None]) -> None:
        self.args, self.log = args, log
        self.layer_idx = L.first_moe_layer(args.converted)
        self.cases: list[C.CaseResult] = []
        self.checks: dict[str, bool] = {}
        self.report: dict[str, Any] = {}

    def ref_out(self, inp: L.Inputs, experts: dict[int, Any], beta: float, lb: float) -> np.ndarray:
        from kimi_w31.converter import reference as ref

        return ref.moe_forward(inp.x_host, inp.ids, inp.weights, experts, beta, lb)

    def inputs(self, layer: L.Layer, m: int, k: int, seed: int) -> L.Inputs:
        return L.make_inputs(
            m, k, layer.num_experts, layer.top_k, layer.rsf, bool(layer.info["renormalize"]), seed
        )

    def add(self, case: C.CaseResult) -> None:
        self.cases.append(case)
        self.log(
            f"{case.name}: cos {case.cosine:.7f} nrmse {100 * case.nrmse:.3f}% max "
            f"{case.max_abs:.4g} gate {'pass' if case.passes_gate else 'FAIL'} "
            f"(expected {case.expect}) {case.note}"
        )

    def run(self) -> dict[str, Any]:
        import torch

        a = self.args
        t0 = time.time()
        with L.sglang_rank(a.converted, tp=1, ep=1, rank=0):
            cfg = L.text_config()
            beta, lb = float(cfg.activation_situ_beta), float(cfg.activation_situ_linear_beta)
            k, n = int(cfg.routed_expert_hidden_size), int(cfg.moe_intermediate_size)
            self.report["dims"] = {
                "layer": self.layer_idx,
                "experts": cfg.num_experts,
                "top_k": cfg.num_experts_per_token,
                "K": k,
                "N": n,
                "routed_scaling_factor": cfg.routed_scaling_factor,
                "situ": [beta, lb],
            }
            t = time.time()
            experts = L.reference_experts(a.source, self.layer_idx, cfg.num_experts)
            self.log(f"reference experts dequantized from the source in {time.time() - t:.1f} s")
            conv = L.read_layer_tensors(a.converted, self.layer_idx)
            t = time.time()
            layer = L.build_layer(cfg, self.layer_idx)
            L.load_weights(layer, cfg, conv)
            self.report["adapter_layer"] = {
                **layer.info,
                "load_s": round(time.time() - t, 1),
                "w13_weight": list(layer.moe.w13_weight.shape),
                "backend": getattr(layer.moe, "_mxfp4_backend", None),
            }
            self.log(f"adapter layer: {self.report['adapter_layer']}")
            self.checks["adapter_engaged"] = layer.info["quant_method"] == "KimiW31SituMoEMethod"
            routing = []
            for m in SINGLE_MS:
                inp = self.inputs(layer, m, k, seed=100 + m)
                out, topk_out = L.forward(layer, inp.x, *L.to_cuda(inp.router))
                agree = S.same_routing(
                    topk_out.topk_ids.cpu().numpy(),
                    topk_out.topk_weights.float().cpu().numpy(),
                    inp.ids,
                    inp.weights,
                )
                routing.append({"m": m, **agree})
                self.add(
                    _case(
                        f"sglang-situ-M{m}",
                        "situ",
                        m,
                        out,
                        self.ref_out(inp, experts, beta, lb),
                        note=f"routing agrees: {agree['agree']}",
                    )
                )
            self.report["routing"] = routing
            self.checks["sglang_topk_matches_reference_router"] = all(r["agree"] for r in routing)
            if L.DEVICE == "cuda":  # graphs and timing need the GPU (CPU dry run skips them)
                self.graph_checks(layer, k)
                self.timing(layer, k)
            del layer
            gc.collect()
            torch.cuda.empty_cache()

            bad = L.build_layer(cfg, self.layer_idx)
            L.load_weights(bad, cfg, L.swap_w31_halves(conv))
            inp = self.inputs(bad, 32, k, seed=132)
            out, _ = L.forward(bad, inp.x, *L.to_cuda(inp.router))
            self.add(
                _case(
                    "neg-w31-halves-swapped",
                    "negative",
                    32,
                    out,
                    self.ref_out(inp, experts, beta, lb),
                    expect="fail",
                    note="converted w31 fed as [gate; up] through the adapter",
                )
            )
            del bad
            torch.cuda.empty_cache()
            self.per_rank_shapes(cfg, conv, experts, k, n, beta, lb)
            if L.DEVICE == "cuda":
                self.route_quant(cfg, k)
        del conv
        gc.collect()
        self.stock(experts, beta, lb)
        self.report["cases"], self.report["checks"] = self.cases, self.checks
        self.report["verdict"] = C.verdict(self.cases, self.checks)
        self.report["elapsed_s"] = round(time.time() - t0, 1)
        return self.report

    def graph_checks(self, layer: L.Layer, k: int) -> None:
        """Eager vs CUDA-graph capture and two replays of TopK + FusedMoE.forward."""
        import torch

        inp = self.inputs(layer, 32, k, seed=232)
        logits, bias = L.to_cuda(inp.router)
        static: dict[str, Any] = {}

        def call() -> None:
            static["out"], _ = L.forward(layer, inp.x, logits, bias)

        call()
        eager = static["out"].clone()
        graph = capture(call)
        replays = []
        for _ in range(2):
            static["out"].zero_()
            graph.replay()
            torch.cuda.synchronize()
            replays.append(static["out"].clone())
        ok = C.bitwise_equal([eager, *replays])
        self.checks["eager_vs_graph_bitwise"] = ok
        self.report["graph"] = {
            "m": 32,
            "bitwise": ok,
            "fused_finalize": os.environ.get("SGLANG_FLASHINFER_MOE_FUSED_FINALIZE", "default"),
        }
        self.log(f"eager == graph capture == 2 replays (bitwise): {ok}")

    def timing(self, layer: L.Layer, k: int) -> None:
        """Review item: `apply` allocates its output, so KimiK3MoE copies it into its latent
        buffer (kimi_k3.py _forward_routed) instead of the kernel writing there. Cost of
        that copy under CUDA graphs, against the layer's own time."""
        import torch

        rows = []
        for m in TIMING_MS:
            inp = self.inputs(layer, m, k, seed=300 + m)
            logits, bias = L.to_cuda(inp.router)
            latent = torch.empty(m, k, dtype=torch.bfloat16, device="cuda")

            def moe_only(inp: L.Inputs = inp, logits: Any = logits, bias: Any = bias) -> None:
                L.forward(layer, inp.x, logits, bias)

            def moe_and_copy(
                inp: L.Inputs = inp, logits: Any = logits, bias: Any = bias, latent: Any = latent
            ) -> None:
                out, _ = L.forward(layer, inp.x, logits, bias)
                latent.copy_(out)

            base, with_copy = graph_replay_ms(moe_only), graph_replay_ms(moe_and_copy)
            base2 = graph_replay_ms(moe_only)  # the same thing twice: the noise floor
            rows.append(
                {
                    "m": m,
                    "topk_moe_ms": base,
                    "topk_moe_copy_ms": with_copy,
                    "repeat_ms": base2,
                    "copy_share": (with_copy - base) / base,
                }
            )
            self.log(f"timing M={m}: {rows[-1]}")
        self.report["output_copy_timing"] = rows

    def per_rank_shapes(
        self,
        cfg: Any,
        conv: dict[str, Any],
        experts: dict[int, Any],
        k: int,
        n: int,
        beta: float,
        lb: float,
    ) -> None:
        """One GPU, the N each moe-TP rank holds: TP8 (N/tp 384) and TP2 (1536). Each rank
        against the reference of its slice; the ranks' sum against the whole layer."""
        import torch
        from kimi_w31.converter import reference as ref

        shapes = []
        for tp in (8, 2):
            total = None
            inp = None
            for rank in range(tp):

                def setup(moe: Any, tp: int = tp, rank: int = rank) -> None:
                    moe.moe_tp_size, moe.moe_tp_rank = tp, rank

                layer = L.build_layer(cfg, self.layer_idx, intermediate=n // tp, setup=setup)
                L.load_weights(layer, cfg, conv)
                if inp is None:
                    inp = self.inputs(layer, 32, k, seed=400 + tp)
                out, _ = L.forward(layer, inp.x, *L.to_cuda(inp.router))
                sliced = {e: S.tp_slice(w, tp, rank) for e, w in experts.items()}
                want = ref.moe_forward(inp.x_host, inp.ids, inp.weights, sliced, beta, lb)
                case = _case(
                    f"tp{tp}-rank{rank}-N{n // tp}",
                    "tp-rank",
                    32,
                    out,
                    want,
                    note=f"w13 {list(layer.moe.w13_weight.shape)}",
                )
                if rank in (0, tp - 1) or not case.passes_gate:
                    self.add(case)
                shapes.append(
                    {
                        "tp": tp,
                        "rank": rank,
                        "passes_gate": case.passes_gate,
                        "cosine": case.cosine,
                        "nrmse": case.nrmse,
                    }
                )
                part = out.float().cpu()
                total = part if total is None else total + part
                del layer
                torch.cuda.empty_cache()
            assert inp is not None and total is not None
            self.add(
                _case(
                    f"tp{tp}-sum-of-ranks",
                    "tp-sum",
                    32,
                    total,
                    self.ref_out(inp, experts, beta, lb),
                    note=f"host sum of the {tp} ranks' outputs",
                )
            )
        self.report["per_rank"] = shapes
        self.checks["every_tp_rank_passes"] = all(s["passes_gate"] for s in shapes)

    def route_quant(self, cfg: Any, k: int) -> None:
        """Review item: with the adapter's method, KimiK3MoE stages its routed activations
        and Kimi-K3's TopK (896 experts, top-16, M <= 64) runs the fused route+pack+MXFP8
        quant kernel, whose quant output the W4A16 path never reads. TopK time with and
        without the staging, under CUDA graphs."""
        import torch
        from sglang.srt.layers.moe import route_quant_handoff as rq
        from sglang.srt.layers.moe.topk import TopK, TopKOutputFormat

        rows: list[dict[str, Any]] = []
        try:
            with torch.device("cuda"):
                topk = TopK(
                    top_k=16,
                    layer_id=0,
                    renormalize=cfg.moe_renormalize,
                    use_grouped_topk=True,
                    num_expert_group=1,
                    topk_group=1,
                    scoring_func="sigmoid",
                    correction_bias=torch.zeros(896, dtype=torch.float32),
                    routed_scaling_factor=cfg.routed_scaling_factor,
                    apply_routed_scaling_factor_on_output=True,
                    output_format=TopKOutputFormat.STANDARD,
                )
            for m in (1, 8, 32, 64):
                router = S.make_router(m, 896, 500 + m)
                logits, bias = L.to_cuda(router)
                topk.topk_config.correction_bias.copy_(bias)
                x = torch.randn(m, k, device="cuda").to(torch.bfloat16)

                def plain(x: Any = x, logits: Any = logits) -> None:
                    topk(x, logits)

                def staged(x: Any = x, logits: Any = logits) -> None:
                    rq.stage(x)
                    try:
                        topk(x, logits)
                    finally:
                        rq.clear()

                rq.stage(x)
                ref_out = topk(x, logits)
                hit = rq._handoff.produced_x is not None
                rq.clear()
                plain_out = topk(x, logits)
                same = bool(
                    torch.equal(ref_out.topk_ids, plain_out.topk_ids)
                    and torch.equal(ref_out.topk_weights, plain_out.topk_weights)
                )
                row = {
                    "m": m,
                    "fused_kernel_hit": hit,
                    "same_routing": same,
                    "plain_ms": graph_replay_ms(plain),
                    "staged_ms": graph_replay_ms(staged),
                    "plain_repeat_ms": graph_replay_ms(plain),
                }
                rows.append(row)
                self.log(f"route+quant M={m}: {row}")
            self.report["route_quant"] = rows
        except Exception as exc:  # measured where it runs; the failure is the finding
            self.report["route_quant"] = {
                "error": f"{type(exc).__name__}: {exc}",
                "rows": rows,
                "trace": traceback.format_exc()[-2000:],
            }
            self.log(f"route+quant measurement failed: {exc!r}")

    def stock(self, experts: dict[int, Any], beta: float, lb: float) -> None:
        """The UNCONVERTED source through SGLang's stock SM90 path (no kimi_w31 block, no
        opt-in): a negative control against the SiTU reference, and the harness control
        against what that path really computes (SwigluBias with alpha=beta_situ, beta=1,
        limit=linear_beta_situ, fc1 reordered to [up; gate] by SGLang)."""
        a = self.args
        with L.sglang_rank(a.source, tp=1, ep=1, rank=0):
            cfg = L.text_config()
            k = int(cfg.routed_expert_hidden_size)
            layer = L.build_layer(cfg, self.layer_idx)
            L.load_weights(layer, cfg, L.read_layer_tensors(a.source, self.layer_idx))
            self.report["stock_layer"] = layer.info
            self.checks["stock_path_is_sglangs"] = layer.info["quant_method"] == "Mxfp4MoEMethod"
            inp = self.inputs(layer, 32, k, seed=632)
            out, _ = L.forward(layer, inp.x, *L.to_cuda(inp.router))
            self.add(
                _case(
                    "neg-unconverted-stock-path",
                    "negative",
                    32,
                    out,
                    self.ref_out(inp, experts, beta, lb),
                    expect="fail",
                    note="source checkpoint, SGLang's own SM90 CUTLASS path",
                )
            )
            # The stock path applies no routed scaling factor (nothing fuses or applies it).
            unscaled = inp.weights / np.float32(layer.rsf)
            for name, w in (("unscaled", unscaled), ("scaled", inp.weights)):
                want = S.moe_swiglu_bias(inp.x_host, inp.ids, w, experts, beta, 1.0, lb)
                stats = S_compare(out, want)
                self.report.setdefault("stock_control", {})[name] = stats
            ctrl = self.report["stock_control"]["unscaled"]
            self.add(
                C.CaseResult(
                    name="control-stock-swiglubias",
                    kind="control",
                    m=32,
                    routing="kimi-topk",
                    note="stock path vs SwigluBias(4, 1, 25) "
                    "reference, routing weights without the scaling factor",
                    **ctrl,
                )
            )


# --------------------------------------------------------------------------------------
# single GPU, --flashinfer-mxfp4-moe-precision fp8 (SM90 W4A8 "Humming")
# --------------------------------------------------------------------------------------


def single_w4a8(args: argparse.Namespace, log: Callable[[str], None]) -> dict[str, Any]:
    """The adapter's Humming path inside SGLang, against gpu/w4a8.py's FP8-modelled
    reference and W4A8 gate; the halves-swapped control; eager vs CUDA graph."""
    from kimi_w31.converter import reference as ref

    from . import w4a8 as W

    idx = L.first_moe_layer(args.converted)
    rows: list[dict[str, Any]] = []
    checks: dict[str, bool] = {}
    with L.sglang_rank(args.converted, tp=1, ep=1, rank=0, precision="fp8"):
        cfg = L.text_config()
        beta, lb = float(cfg.activation_situ_beta), float(cfg.activation_situ_linear_beta)
        k = int(cfg.routed_expert_hidden_size)
        experts = L.reference_experts(args.source, idx, cfg.num_experts)
        conv = L.read_layer_tensors(args.converted, idx)

        def run_case(name: str, layer: L.Layer, m: int, expect: str = "pass") -> None:
            inp = L.make_inputs(
                m, k, layer.num_experts, layer.top_k, layer.rsf, bool(cfg.moe_renormalize), 800 + m
            )
            out, _ = L.forward(layer, inp.x, *L.to_cuda(inp.router))
            row = S.gated_row(
                name,
                m,
                out.float().cpu().numpy(),
                W.w4a8_reference(inp.x_host, inp.ids, inp.weights, experts, beta, lb),
                ref.moe_forward(inp.x_host, inp.ids, inp.weights, experts, beta, lb),
                cosine_min=W.W4A8_COSINE_MIN,
                nrmse_max=W.W4A8_NRMSE_MAX,
                expect=expect,
            )
            rows.append(row)
            modelled, plain = row["vs_fp8_modelled"], row["vs_unquantized"]
            log(
                f"{name}: modelled cos {modelled['cosine']:.6f} nrmse "
                f"{100 * modelled['nrmse']:.3f}% | unquantized cos {plain['cosine']:.6f} nrmse "
                f"{100 * plain['nrmse']:.3f}% -> {'pass' if row['passes_gate'] else 'FAIL'} "
                f"(expected {expect})"
            )

        layer = L.build_layer(cfg, idx)
        L.load_weights(layer, cfg, conv)
        method = layer.moe.quant_method
        checks["adapter_humming_engaged"] = bool(getattr(method, "humming", False))
        log(f"layer: {layer.info}, humming {checks['adapter_humming_engaged']}")
        for m in SINGLE_MS:
            run_case(f"sglang-w4a8-situ-M{m}", layer, m)
        inp = L.make_inputs(32, k, layer.num_experts, layer.top_k, layer.rsf, True, 932)
        logits, bias = L.to_cuda(inp.router)
        static: dict[str, Any] = {}

        def call() -> None:
            static["out"], _ = L.forward(layer, inp.x, logits, bias)

        if L.DEVICE == "cuda":  # the CPU dry run has no graphs
            call()
            eager = static["out"].clone()
            graph_replay_ms(call, iters=1)  # captures `call` in a graph and replays it
            checks["eager_vs_graph_bitwise"] = C.bitwise_equal([eager, static["out"]])
        bad = L.build_layer(cfg, idx)
        L.load_weights(bad, cfg, L.swap_w31_halves(conv))
        run_case("neg-w31-halves-swapped", bad, 32, expect="fail")
    verdict = {"all_as_expected": all(r["ok"] for r in rows), **checks}
    verdict["overall"] = all(verdict.values())
    return {
        "cases": rows,
        "checks": checks,
        "verdict": verdict,
        "gate": {"cosine_min": W.W4A8_COSINE_MIN, "nrmse_max": W.W4A8_NRMSE_MAX},
    }


# --------------------------------------------------------------------------------------
# two GPUs
# --------------------------------------------------------------------------------------


def _dist_tag(args: argparse.Namespace) -> str:
    return f"dist{'-w4a8' if args.precision == 'fp8' else ''}-ep{args.ep}"


def _dist_worker(rank: int, args: argparse.Namespace, port: int) -> None:
    """One of the two ranks. With `--precision fp8` (SM90 W4A8 Humming) each rank prepares
    its own Humming weights and residuals, and rank 0 holds the all-reduced output to the
    FP8-modelled reference and the single-GPU W4A8 gate, with the halves-swapped control."""
    import torch

    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        NCCL_NVLS_ENABLE="0",
        TORCH_SYMM_MEM_DISABLE_MULTICAST="1",
        NVSHMEM_DISABLE_NVLS="1",
    )
    torch.cuda.set_device(rank)
    w4a8 = args.precision == "fp8"
    prepare_process(args.prebuilt, "w4a8" if w4a8 else "w4a16")
    tag = _dist_tag(args)
    log = _log_to(args.out, f"{tag}-rank{rank}")
    from sglang.srt.distributed import tensor_model_parallel_all_reduce
    from sglang.srt.runtime_context import get_parallel

    report: dict[str, Any] = {"rank": rank, "tp": 2, "ep": args.ep, "precision": args.precision}
    layer_idx = L.first_moe_layer(args.converted)
    with L.sglang_rank(args.converted, tp=2, ep=args.ep, rank=rank, precision=args.precision):
        par = get_parallel()
        cfg = L.text_config()
        k = int(cfg.routed_expert_hidden_size)
        conv = L.read_layer_tensors(args.converted, layer_idx)
        layer = L.build_layer(cfg, layer_idx)
        L.load_weights(layer, cfg, conv)
        moe = layer.moe
        report["rank_layer"] = {
            **layer.info,
            "w13_weight": list(moe.w13_weight.shape),
            "moe_tp": [moe.moe_tp_size, moe.moe_tp_rank],
            "moe_ep": [moe.moe_ep_size, moe.moe_ep_rank],
            "tp_group": [par.tp_size, par.tp_rank],
            "humming": bool(getattr(moe.quant_method, "humming", False)),
        }
        log(f"rank {rank}: {report['rank_layer']}")

        def reduced_output(lay: L.Layer, m: int, seed: int) -> dict[str, Any]:
            inp = L.make_inputs(
                m, k, lay.num_experts, lay.top_k, lay.rsf, bool(cfg.moe_renormalize), seed
            )
            out, _ = L.forward(lay, inp.x, *L.to_cuda(inp.router))
            host = tensor_model_parallel_all_reduce(out.clone())
            torch.cuda.synchronize()
            host = host.float().cpu().numpy()
            digest = hashlib.sha256(host.tobytes()).hexdigest()[:16]
            return {"m": m, "sha256": digest, "x": inp.x_host, "ids": inp.ids,
                    "w": inp.weights, "out": host}  # fmt: skip

        outs = [reduced_output(layer, m, 700 + m) for m in DIST_MS]
        control = None
        if w4a8:  # the halves-swapped conversion, loaded and run the same way on both ranks
            del layer
            torch.cuda.empty_cache()
            bad = L.build_layer(cfg, layer_idx)
            L.load_weights(bad, cfg, L.swap_w31_halves(conv))
            control = reduced_output(bad, 32, 732)
            del bad
        digests = [(o["m"], o["sha256"]) for o in outs + ([control] if control else [])]
        gathered: list[Any] = [None, None]
        torch.distributed.all_gather_object(gathered, digests)
        report["ranks_identical"] = gathered[0] == gathered[1]
        layers_info: list[Any] = [None, None]
        torch.distributed.all_gather_object(layers_info, report["rank_layer"])
    if rank != 0:
        return
    from kimi_w31.converter import reference as ref

    experts = L.reference_experts(args.source, layer_idx, cfg.num_experts)
    beta, lb = float(cfg.activation_situ_beta), float(cfg.activation_situ_linear_beta)
    report["rank_layers"] = layers_info
    report["environment"] = environment()
    kind = "ep2" if args.ep == 2 else "tp2"
    if w4a8:
        from . import w4a8 as W

        def row(o: dict[str, Any], name: str, expect: str = "pass", note: str = "") -> dict:
            r = S.gated_row(
                name,
                o["m"],
                o["out"],
                W.w4a8_reference(o["x"], o["ids"], o["w"], experts, beta, lb),
                ref.moe_forward(o["x"], o["ids"], o["w"], experts, beta, lb),
                cosine_min=W.W4A8_COSINE_MIN,
                nrmse_max=W.W4A8_NRMSE_MAX,
                expect=expect,
                note=note,
            )
            log(
                f"{name}: modelled cos {r['vs_fp8_modelled']['cosine']:.6f} nrmse "
                f"{100 * r['vs_fp8_modelled']['nrmse']:.3f}% -> "
                f"{'pass' if r['passes_gate'] else 'FAIL'} (expected {expect})"
            )
            return r

        rows = [row(o, f"{kind}-w4a8-2gpu-M{o['m']}", note="all-reduced over NCCL") for o in outs]
        assert control is not None
        rows.append(row(control, f"neg-{kind}-w4a8-halves-swapped", "fail", "w31 as [gate; up]"))
        report["cases"] = rows
        report["gate"] = {"cosine_min": W.W4A8_COSINE_MIN, "nrmse_max": W.W4A8_NRMSE_MAX}
        report["verdict"] = v = S.dist_w4a8_verdict(rows, report["ranks_identical"])
        C.write_report(args.out / f"report-{tag}.json", report)
        log(f"verdict: {json.dumps(v)}")
        return
    cases = []
    for o in outs:
        want = ref.moe_forward(o["x"], o["ids"], o["w"], experts, beta, lb)
        stats = ref.compare(o["out"], want)
        name = f"{kind}-2gpu-M{o['m']}"
        cases.append(
            C.CaseResult(
                name=name,
                kind="dist",
                m=o["m"],
                routing="kimi-topk",
                note="all-reduced over NCCL",
                **stats,
            )
        )
        log(f"{name}: cos {stats['cosine']:.7f} nrmse {100 * stats['nrmse']:.3f}%")
    report["cases"] = cases
    checks = {"ranks_identical_after_all_reduce": bool(report["ranks_identical"])}
    report["checks"] = checks
    v = C.verdict(cases, checks)
    v.pop("negative_controls_fail")  # the single-GPU suite carries the negative controls
    v["overall"] = all(val for key, val in v.items() if key != "overall")
    report["verdict"] = v
    C.write_report(args.out / f"report-{tag}.json", report)
    (args.out / f"report-{tag}.md").write_text(C.markdown_table(cases) + "\n")
    log(f"verdict: {json.dumps(v)}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("suite", choices=("single", "single-w4a8", "dist"))
    p.add_argument("--source", type=Path, required=True)
    p.add_argument("--converted", type=Path, required=True)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument(
        "--prebuilt",
        type=Path,
        default=None,
        help="the trimmed FlashInfer module built earlier (skips the JIT build)",
    )
    p.add_argument("--ep", type=int, choices=(1, 2), default=1, help="dist: 1 = TP2, 2 = EP2")
    p.add_argument(
        "--precision",
        choices=("default", "fp8"),
        default="default",
        help="dist: --flashinfer-mxfp4-moe-precision (fp8: SM90 W4A8 Humming; --prebuilt is "
        "then the W4A8 module)",
    )
    args = p.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    if args.suite == "dist":
        import socket

        import torch.multiprocessing as mp

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        mp.spawn(_dist_worker, args=(args, port), nprocs=2, join=True)
        report = json.loads((args.out / f"report-{_dist_tag(args)}.json").read_text())
        return 0 if report["verdict"]["overall"] else 1
    if args.suite == "single-w4a8":
        log = _log_to(args.out, "single-w4a8")
        prepare_process(args.prebuilt, "w4a8")
        report = {"environment": environment(), **single_w4a8(args, log)}
        C.write_report(args.out / "report-single-w4a8.json", report)
        log(f"verdict: {json.dumps(report['verdict'])}")
        return 0 if report["verdict"]["overall"] else 1
    log = _log_to(args.out, "single")
    prepare_process(args.prebuilt)
    env = environment()
    log(f"environment: {env}")
    report = {
        "environment": env,
        "command": " ".join(["python -m gpu.sglang_run", *sys.argv[1:]]),
        "gate": {"cosine_min": C.COSINE_MIN, "nrmse_max": C.NRMSE_MAX},
        **Single(args, log).run(),
    }
    C.write_report(args.out / "report-single.json", report)
    (args.out / "report-single.md").write_text(C.markdown_table(report["cases"]) + "\n")
    log(f"verdict: {json.dumps(report['verdict'])}")
    return 0 if report["verdict"]["overall"] else 1


if __name__ == "__main__":
    sys.exit(main())
