"""What checking a kernel bundle's recipe costs a serving process, both ways.

    python tools/bundle_check_cost.py [--variant w4a16] [--runs 5] [--bundle DIR]

Each run is a fresh interpreter (FlashInfer fixes its target and cache folders at import),
with FlashInfer imported before the clock starts (a serving process imports it anyway):

- `key`:  `kernels.recipe_key` (this plugin's recipe code and FlashInfer's installed-file
  record hashed; what a start-up compares by default);
- `full`: `kernels.regenerated_source_hash` (FlashInfer's CUTLASS generator run, which
  writes its generated `.cu` files, the recipe derived, every source hashed; what
  KIMI_W31_KERNELS_FULL_CHECK=1 runs, and what every start ran before the key).

With `--bundle DIR`, the whole check of that bundle is timed instead (`bundle_library`: the
manifest, the stack, the recipe either way, the library hashed from its descriptor). Needs
FlashInfer (and torch); `FLASHINFER_CUDA_ARCH_LIST` defaults to the variant's target.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

_RUN = """
import json, os, sys, time
from pathlib import Path
from kimi_w31.adapter import kernels as K
import flashinfer.jit.fused_moe  # noqa: F401  imported before the clock, as in a server
variant, bundle = K.VARIANTS[sys.argv[1]], sys.argv[2]
out = {}
for way in ("key", "full"):
    t0 = time.perf_counter()
    if bundle:
        os.environ[K.ENV_FULL_CHECK] = "1" if way == "full" else ""
        K.bundle_library(Path(bundle), variant).close()
    elif way == "key":
        K.recipe_key(variant, "13.0")
    else:
        K.regenerated_source_hash(variant)
    out[way] = time.perf_counter() - t0
print(json.dumps(out))
"""


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--variant", default="w4a16")
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--bundle", default="")
    args = p.parse_args(argv)
    arch = {"sm120": "12.0"}.get(args.variant, "9.0a")
    times: dict[str, list[float]] = {"key": [], "full": []}
    with tempfile.TemporaryDirectory() as ws:
        env = {**os.environ, "FLASHINFER_WORKSPACE_BASE": ws, "XDG_CACHE_HOME": ws}
        env.setdefault("FLASHINFER_CUDA_ARCH_LIST", arch)
        for _ in range(args.runs):
            done = subprocess.run(
                [sys.executable, "-c", _RUN, args.variant, args.bundle],
                env=env,
                capture_output=True,
                text=True,
                check=False,
            )
            if done.returncode != 0:
                print(done.stderr[-2000:], file=sys.stderr)
                return 1
            for way, seconds in json.loads(done.stdout.strip().splitlines()[-1]).items():
                times[way].append(seconds)
    for way, values in times.items():
        ms = sorted(1000 * v for v in values)
        print(
            f"{args.variant} {way}: median {statistics.median(ms):.1f} ms "
            f"(min {ms[0]:.1f}, max {ms[-1]:.1f}, {len(ms)} fresh processes)"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
