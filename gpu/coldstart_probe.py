"""Cold start of the plugin's MoE path: process start -> first MoE forward, in a fresh process.

    python -m gpu.coldstart_probe --t0 $(date +%s.%N) --out report.json [--humming]

What runs is the adapter's own sequence on one Kimi-K3 MoE layer's per-rank shapes (28 local
experts, K 3584, N 3072, random MXFP4 bytes): import torch and the adapter, put the weights
on the GPU, `prepare_sm90` (which routes FlashInfer to the plugin's module: from the bundle
`KIMI_W31_KERNELS` names, checked against the stack, or from FlashInfer's JIT cache) and one
`run_situ_moe` (M = 8, no autotuning), synchronized. `--t0` is the shell's clock just before
the interpreter started, so interpreter start-up is counted. Checkpoint reading is not.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--t0", type=float, required=True)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--humming", action="store_true", help="SM90 W4A8 instead of W4A16")
    args = p.parse_args(argv)
    marks = {"python_started": time.time() - args.t0}

    import torch
    from kimi_w31.adapter import flashinfer_moe as fm
    from kimi_w31.adapter import kernels

    marks["imports"] = time.time() - args.t0
    g = torch.Generator(device="cuda").manual_seed(0)
    e, k, n = 28, 3584, 3072

    def u8(*shape: int, lo: int = 0, hi: int = 256) -> torch.Tensor:
        return torch.randint(lo, hi, shape, generator=g, device="cuda", dtype=torch.uint8)

    w31, s31 = u8(e, 2 * n, k // 2), u8(e, 2 * n, k // 32, lo=118, hi=124)
    w2, s2 = u8(e, k, n // 2), u8(e, k, n // 32, lo=118, hi=124)
    torch.cuda.synchronize()
    marks["weights_on_gpu"] = time.time() - args.t0
    prep = fm.prepare_sm90_humming if args.humming else fm.prepare_sm90
    weights = prep(w31, s31, w2, s2)
    torch.cuda.synchronize()
    marks["module_loaded_and_weights_prepared"] = time.time() - args.t0
    beta, linear_beta = fm.situ_params(e, device="cuda")
    x = torch.randn(8, k, generator=g, device="cuda").to(torch.bfloat16)
    ids = torch.randint(0, e, (8, 16), generator=g, device="cuda", dtype=torch.int32)
    topw = torch.full((8, 16), 1 / 16, device="cuda", dtype=torch.float32)
    out = fm.run_situ_moe(x, ids, topw, weights, beta, linear_beta)
    torch.cuda.synchronize()
    marks["first_moe_forward"] = time.time() - args.t0
    report = {
        "marks_s": {k_: round(v, 3) for k_, v in marks.items()},
        "finite": bool(torch.isfinite(out.float()).all()),
        "installed": {a: [v, str(lib)] for a, (v, lib) in kernels._installed.items()},
        "bundle": os.environ.get(kernels.ENV_BUNDLE),
        "flashinfer_workspace": os.environ.get("FLASHINFER_WORKSPACE_BASE"),
    }
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
