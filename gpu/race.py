"""The race on one GPU: Kimi-K3's MoE layer, per rank, through SGLang's own code.

Three arms, the same router logits and hidden states, the same fp32 reference:

- `marlin`: the UNCONVERTED source checkpoint under `--moe-runner-backend marlin`, the route
  SGLang's Kimi-K3 recipes use on Hopper: SGLang's Mxfp4 quant method, its Marlin weight
  processing and its `fused_marlin_moe` (Triton SiTU);
- `w4a16`: the converted checkpoint under `flashinfer_mxfp4` with the plugin (FlashInfer's
  SM90 CUTLASS W4A16, SiTU fused), its module from the bundle (`KIMI_W31_KERNELS`) or a
  library (`--w4a16-so`);
- `w4a8`: the same with `--flashinfer-mxfp4-moe-precision fp8` (Humming W4A8).

Each layout (gpu/race_cases.LAYOUTS) is one rank of a deployment: EP16 (56 local experts of
896, full N) and TP16/EP2 (448 local experts, N 384 = moe-TP8). The rank's experts come
from a checkpoint that holds exactly them (`synth --experts 56` / `--experts 448 --n 384`);
SGLang builds the layer with the global 896 experts and that rank's EP size, so its
dispatcher masks the other ranks' experts as in a deployment. The router runs over all 896.
Speed: `TopK` + `FusedMoE.forward` captured in a CUDA graph per (routing, M, arm), replays
timed with CUDA events, arms interleaved, median of the round medians. FlashInfer's
autotuner profiles the plugin's arms at the race's M first (as SGLang's warm-up does).

    python -m gpu.race --root DIR --out OUT [--layouts ep16,moetp8] [--ms all]
        [--arms marlin,w4a16,w4a8] [--w4a8-so SO] [--w4a16-so SO] [--wait-for FILE]

DIR/<layout>/src and DIR/<layout>/conv are the checkpoints (gpu/race_h200.sh makes them).
Writes OUT/report-race.json and OUT/report-race.md after each layout.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from . import race_cases as R
from . import sglang_cases as S
from . import sglang_layer as L
from .graph_timing import capture


@dataclass(frozen=True)
class ArmSpec:
    key: str
    checkpoint: str  # "src" (unconverted) or "conv"
    backend: str  # --moe-runner-backend
    precision: str  # --flashinfer-mxfp4-moe-precision
    module: str | None  # the plugin's FlashInfer module variant (gpu/trimmed_build.VARIANTS)


ARM_SPECS = {
    "marlin": ArmSpec("marlin", "src", "marlin", "default", None),
    "w4a16": ArmSpec("w4a16", "conv", "flashinfer_mxfp4", "default", "w4a16"),
    "w4a8": ArmSpec("w4a8", "conv", "flashinfer_mxfp4", "fp8", "w4a8"),
}

_KEEP: list[Any] = []  # loaded FlashInfer modules stay alive while graphs use their kernels


def _log_to(out: Path) -> Callable[[str], None]:
    fh = (out / "race.log").open("a")

    def log(msg: str) -> None:
        line = f"[{time.strftime('%H:%M:%S')}] {msg}"
        print(line, flush=True)
        fh.write(line + "\n")
        fh.flush()

    return log


@contextlib.contextmanager
def rank_of(layout: R.Layout) -> Iterator[None]:
    """While SGLang builds and loads the layer: the parallel widths of rank 0 of `layout`
    (SGLang's own override; the one-process groups stand in for the wider ones, which
    the layer does not use before forward)."""
    from sglang.srt.runtime_context import get_parallel

    par = get_parallel()
    w = widths_for(layout)

    class _Width:  # what the width checks read of a process group
        def __init__(self, size: int) -> None:
            self.world_size = size

    with par.override(
        tp_size=w["tp"],
        tp_rank=0,
        attn_tp_size=w["tp"],
        attn_tp_rank=0,
        moe_ep_size=w["ep"],
        moe_ep_rank=0,
        moe_tp_size=w["moe_tp"],
        moe_tp_rank=0,
        tp_group=_Width(w["tp"]),
        attn_tp_group=_Width(w["tp"]),
        moe_ep_group=_Width(w["ep"]),
    ):
        yield


def widths_for(layout: R.Layout) -> dict[str, int]:
    """tp_size must equal moe_ep x moe_dp x moe_tp for SGLang's check; a checkpoint that
    already holds the moe-TP slice (N 384) is loaded with moe_tp 1 and tp = ep."""
    moe_tp = layout.moe_tp if layout.n_local == R.N else 1
    return {"tp": layout.ep * moe_tp, "ep": layout.ep, "moe_tp": moe_tp}


def install_module(spec: ArmSpec, args: argparse.Namespace) -> None:
    """Point FlashInfer's SM90 fused-MoE lookup at the arm's module (gpu/trimmed_build)."""
    if spec.module is None:
        return
    from . import trimmed_build

    lib = {"w4a16": args.w4a16_so, "w4a8": args.w4a8_so}[spec.module]
    trimmed_build.install(lib, trimmed_build.VARIANTS[spec.module])


def keep_module() -> None:
    from flashinfer.fused_moe import core

    _KEEP.append(core.get_cutlass_fused_moe_module("90"))


@dataclass
class Batch:
    routing: str
    m: int
    x: Any  # bf16 [M, K] (GPU)
    x_host: np.ndarray
    logits: Any  # fp32 [M, 896] (GPU)
    bias: Any
    ids: np.ndarray  # the reference router's choice (global ids)
    weights: np.ndarray
    load: R.Load


def make_batches(
    layout: R.Layout, ms: tuple[int, ...], routings: tuple[str, ...], rsf: float, renorm: bool
) -> dict[tuple[str, int], Batch]:
    import torch

    out = {}
    for ri, routing in enumerate(routings):
        for m in ms:
            seed = 7000 + 97 * ri + m
            g = torch.Generator().manual_seed(seed)
            x = torch.randn(m, R.K, generator=g).to(torch.bfloat16)
            router = S.make_router(
                m, R.EXPERTS, seed + 1, R.skew_of(routing), R.LOGIT_STD, R.BIAS_STD
            )
            ids, w = S.route(router, R.TOP_K, renorm, rsf)
            out[(routing, m)] = Batch(
                routing=routing,
                m=m,
                x=x.to(L.DEVICE),
                x_host=x.float().numpy(),
                logits=torch.from_numpy(router.logits).to(L.DEVICE),
                bias=torch.from_numpy(router.bias).to(L.DEVICE),
                ids=ids,
                weights=w,
                load=R.rank_load(ids, layout),
            )
    return out


class LazyExperts(dict):
    """Reference experts dequantized from the source on first use (only those a case needs)."""

    def __init__(self, repo: Path, layer_idx: int, count: int) -> None:
        super().__init__()
        self.tensors = L.read_layer_tensors(repo, layer_idx)
        self.prefix = next(n for n in self.tensors if ".experts.0.w1." in n).split("experts.0.")[0]
        self.count = count

    def __contains__(self, e: object) -> bool:
        return isinstance(e, int) and 0 <= e < self.count

    def __missing__(self, e: int) -> Any:
        from kimi_w31.converter import reference as ref

        def pair(w: str) -> tuple[np.ndarray, np.ndarray]:
            t = self.tensors
            return (
                t[f"{self.prefix}experts.{e}.{w}.weight_packed"].numpy(),
                t[f"{self.prefix}experts.{e}.{w}.weight_scale"].numpy(),
            )

        value = ref.dequant_expert(pair("w1"), pair("w3"), pair("w2"))
        self[e] = value
        return value


class Race:
    def __init__(self, args: argparse.Namespace, log: Callable[[str], None]) -> None:
        self.args, self.log = args, log
        self.rows: list[R.Row] = []
        self.report: dict[str, Any] = {"layouts": {}, "errors": []}

    # --- one arm of one layout: build, load, tune, eager outputs, graphs ------------------

    def arm(
        self, layout: R.Layout, spec: ArmSpec, batches: dict[tuple[str, int], Batch]
    ) -> dict[str, Any]:
        import torch

        a = self.args
        repo = a.root / layout.key / spec.checkpoint
        layer_idx = L.first_moe_layer(repo)
        install_module(spec, a)
        t0 = time.time()
        res: dict[str, Any] = {"graphs": {}, "eager": {}}
        w = widths_for(layout)
        with L.sglang_rank(
            repo, tp=1, ep=1, rank=0, precision=spec.precision, backend=spec.backend
        ):
            cfg = L.text_config()
            with rank_of(layout):
                layer = L.build_layer(
                    cfg, layer_idx, intermediate=layout.n_local, num_experts=R.EXPERTS
                )
                L.load_weights(layer, cfg, L.read_layer_tensors(repo, layer_idx))
            res["info"] = {
                **layer.info,
                "backend": getattr(layer.moe, "_mxfp4_backend", spec.backend),
                "w13_weight": list(layer.moe.w13_weight.shape),
                "local_experts": int(layer.moe.num_local_experts),
                "widths": w,
                "load_s": round(time.time() - t0, 1),
            }
            self.log(f"{layout.key}/{spec.key}: {res['info']}")
            if spec.module is not None:
                keep_module()

            def call(b: Batch) -> Any:
                return layer.moe(b.x, layer.topk(b.x, b.logits))

            if spec.module is not None and a.autotune:
                from flashinfer.autotuner import AutoTuner, autotune

                AutoTuner.get().clear_cache()
                t = time.time()
                big = batches[(a.routings[0], max(a.ms))]
                layer.topk.topk_config.correction_bias.copy_(big.bias)
                with autotune(True, tuning_buckets=tuple(a.ms)):
                    call(big)
                torch.cuda.synchronize()
                res["autotune_s"] = round(time.time() - t, 1)
                self.log(f"{layout.key}/{spec.key}: autotuned M {a.ms} in {res['autotune_s']} s")
            # Graphs share the correction bias buffer: one per routing is written before the
            # routing's graphs are captured and replayed (the biases differ per batch seed,
            # so each batch's is copied in before its capture and its timing).
            for (routing, m), b in batches.items():
                layer.topk.topk_config.correction_bias.copy_(b.bias)
                out = call(b)
                if m in a.accuracy_ms:
                    res["eager"][(routing, m)] = out.float().cpu().numpy()
                res["graphs"][(routing, m)] = self.capture(lambda b=b: call(b))
            res["bias_buffer"] = layer.topk.topk_config.correction_bias
            res["layer"] = layer
        res["setup_s"] = round(time.time() - t0, 1)
        return res

    @staticmethod
    def capture(fn: Callable[[], Any]) -> Any:
        import torch

        graph = capture(fn)
        graph.replay()
        torch.cuda.synchronize()
        return graph

    # --- timing and accuracy ----------------------------------------------------------

    def time_layout(
        self, arms: dict[str, dict[str, Any]], batches: dict[tuple[str, int], Batch]
    ) -> dict[tuple[str, int, str], list[list[float]]]:
        import torch

        a = self.args
        names = list(arms)
        rounds: dict[tuple[str, int, str], list[list[float]]] = {}
        for rnd in range(a.rounds):
            order = names[rnd % len(names) :] + names[: rnd % len(names)]
            for key, b in batches.items():
                for arm in order:
                    arms[arm]["bias_buffer"].copy_(b.bias)
                    graph = arms[arm]["graphs"][key]
                    graph.replay()
                    times = []
                    for _ in range(a.iters):
                        t0 = torch.cuda.Event(enable_timing=True)
                        t1 = torch.cuda.Event(enable_timing=True)
                        t0.record()
                        graph.replay()
                        t1.record()
                        t1.synchronize()
                        times.append(t0.elapsed_time(t1))
                    rounds.setdefault((*key, arm), []).append(times)
        return rounds

    def layout(self, layout: R.Layout) -> None:
        import torch

        a = self.args
        src = a.root / layout.key / "src"
        layer_idx = L.first_moe_layer(src)
        with L.sglang_rank(src, tp=1, ep=1, rank=0):
            cfg = L.text_config()
            rsf, renorm = float(cfg.routed_scaling_factor), bool(cfg.moe_renormalize)
            beta, lb = float(cfg.activation_situ_beta), float(cfg.activation_situ_linear_beta)
        batches = make_batches(layout, a.ms, a.routings, rsf, renorm)
        info: dict[str, Any] = {"title": layout.title, "arms": {}}
        self.report["layouts"][layout.key] = info
        arms: dict[str, dict[str, Any]] = {}
        for key in a.arms:
            spec = ARM_SPECS[key]
            if spec.module == "w4a16" and a.wait_for is not None:
                self.wait_for(a.wait_for)
            try:
                arms[key] = self.arm(layout, spec, batches)
                info["arms"][key] = {
                    **arms[key]["info"],
                    "setup_s": arms[key]["setup_s"],
                    "autotune_s": arms[key].get("autotune_s"),
                }
            except Exception as exc:  # the other arms still run; the failure is reported
                tb = traceback.format_exc()
                self.log(f"{layout.key}/{key} FAILED: {exc!r}\n{tb}")
                self.report["errors"].append(
                    {"layout": layout.key, "arm": key, "error": repr(exc), "trace": tb[-3000:]}
                )
                gc.collect()
                torch.cuda.empty_cache()
        if not arms:
            return
        t = time.time()
        rounds = self.time_layout(arms, batches)
        self.log(
            f"{layout.key}: timed {len(rounds)} graphs x {a.rounds} rounds in "
            f"{time.time() - t:.0f} s"
        )
        t = time.time()
        experts = LazyExperts(src, layer_idx, layout.local_experts)
        refs = {
            key: R_moe(b, experts, beta, lb)
            for key, b in batches.items()
            if key[1] in a.accuracy_ms
        }
        self.log(f"{layout.key}: reference outputs in {time.time() - t:.0f} s")
        for (routing, m, arm), rs in sorted(rounds.items()):
            b = batches[(routing, m)]
            fl = R.floor_ms(layout, b.load)
            row = R.Row(
                layout=layout.key,
                routing=routing,
                m=m,
                arm=arm,
                ms=R.median_of_rounds(rs),
                spread=R.spread(rs),
                pairs=b.load.pairs,
                touched=b.load.touched,
                floor_ms=fl["floor_ms"],
                bound=fl["bound"],
            )
            got = arms[arm]["eager"].get((routing, m))
            if got is not None:
                from kimi_w31.converter import reference as ref

                want = refs[(routing, m)]
                stats = ref.compare(got, want)
                row.cosine, row.nrmse, row.max_abs = (
                    stats["cosine"],
                    stats["nrmse"],
                    stats["max_abs"],
                )
                norm = float(np.linalg.norm(want))
                info.setdefault("norm_ratio", {})[f"{arm}/{routing}/{m}"] = (
                    float(np.linalg.norm(got)) / norm if norm > 0 else None
                )
                if not arms[arm]["info"]["fuse_rsf_in_topk"] and rsf != 1.0:
                    # The layer returns sum_j w_j f_j without the factor (nothing in it
                    # applies it); KimiK3MoE's latent RMSNorm removes any uniform scale.
                    row.nrmse_rescaled = ref.compare(got * np.float32(rsf), want)["nrmse"]
            self.rows.append(row)
        del arms
        gc.collect()
        torch.cuda.empty_cache()

    def wait_for(self, path: Path) -> None:
        t = time.time()
        while not path.exists():
            if time.time() - t > self.args.wait_s:
                raise SystemExit(f"{path} did not appear in {self.args.wait_s} s")
            time.sleep(2)
        if time.time() - t > 1:
            self.log(f"waited {time.time() - t:.0f} s for {path}")

    def write(self, env: dict[str, Any]) -> None:
        a = self.args
        self.report["environment"] = env
        self.report["ms"] = list(a.ms)
        self.report["rounds"], self.report["iters"] = a.rounds, a.iters
        self.report["rows"] = [R.row_dict(r) for r in self.rows]
        self.report["link_bytes_per_token"] = R.link_bytes_per_token()
        self.report["link_bytes_per_token_fp8_dispatch"] = R.link_bytes_per_token(
            dispatch_bytes_per_value=1.0 + 1.0 / 32
        )
        (a.out / "report-race.json").write_text(json.dumps(self.report, indent=1, default=str))
        (a.out / "report-race.md").write_text(R.markdown(self.rows, env))


def R_moe(b: Batch, experts: LazyExperts, beta: float, lb: float) -> np.ndarray:  # noqa: N802
    """The fp32 reference of the rank: only its local experts contribute (global ids mapped
    to the checkpoint's local numbering; rank 0 holds ids 0 ... local-1)."""
    from kimi_w31.converter import reference as ref

    return ref.moe_forward(b.x_host, b.ids, b.weights, experts, beta, lb)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--root", type=Path, required=True)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--layouts", default="ep16,moetp8")
    p.add_argument("--arms", default=",".join(R.ARMS))
    p.add_argument("--ms", default="all")
    p.add_argument("--routings", default=",".join(R.ROUTINGS))
    p.add_argument("--accuracy-ms", default="1,16,256,2048")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--no-autotune", dest="autotune", action="store_false")
    p.add_argument("--w4a16-so", type=Path, default=None, help="else the bundle's")
    p.add_argument("--w4a8-so", type=Path, default=None, help="else the bundle's")
    p.add_argument("--wait-for", type=Path, default=None, help="file to wait for before W4A16")
    p.add_argument("--wait-s", type=float, default=420.0)
    args = p.parse_args(argv)
    args.layouts = [R.LAYOUTS[k] for k in args.layouts.split(",")]
    args.arms = [k for k in args.arms.split(",") if k]
    unknown = set(args.arms) - set(ARM_SPECS)
    if unknown:
        p.error(f"unknown arms {sorted(unknown)}")
    args.ms = R.parse_ms(args.ms)
    args.routings = tuple(r for r in args.routings.split(",") if r)
    for r in args.routings:
        R.skew_of(r)
    args.accuracy_ms = set(R.parse_ms(args.accuracy_ms))
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    log = _log_to(args.out)
    L.install_sgl_kernel_stub()  # a real sgl_kernel (the Marlin route needs one) is kept
    L.load_plugins_checked()
    from .sglang_run import environment

    env = environment()
    try:
        import sgl_kernel

        env["sgl_kernel"] = getattr(sgl_kernel, "__version__", "?")
    except Exception as exc:
        env["sgl_kernel"] = f"unavailable ({exc!r})"
    log(f"environment: {env}")
    race = Race(args, log)
    for layout in args.layouts:
        t = time.time()
        race.layout(layout)
        log(f"{layout.key}: done in {time.time() - t:.0f} s")
        race.write(env)
    return 0 if not race.report["errors"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
