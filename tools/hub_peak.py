"""Peak disk of a streamed Hub conversion, measured, against source + output.

Serves a synthetic checkpoint from a loopback fake Hub (tests/hub_server.py), converts it
with `--download --delete-source-shards` through the real `huggingface_hub` client, and
reports the converter's own high-water mark of (download storage + output), sampled at every
point where disk use peaks (after each output shard lands, before any source is freed).

    python tools/hub_peak.py --layers 4 --experts 8 --shards 8 --real-dims --window 3
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))

from hub_server import FakeHub  # noqa: E402
from kimi_w31.converter.synth import REAL_K, REAL_N, SynthSpec, synth_checkpoint  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--shards", type=int, default=8)
    ap.add_argument("--real-dims", action="store_true")
    ap.add_argument("--window", type=int, default=3)
    ap.add_argument("--max-shard-size", default="100MB")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        k, n = (REAL_K, REAL_N) if args.real_dims else (128, 64)
        spec = SynthSpec(layers=args.layers, experts=args.experts, shards=args.shards, k=k, n=n,
                         hidden=1024 if args.real_dims else 256)  # fmt: skip
        src = tmp / "src"
        synth_checkpoint(src, spec)
        source_bytes = sum(p.stat().st_size for p in src.iterdir())
        with FakeHub({"org/kimi": src}) as hub:
            env = {k: v for k, v in os.environ.items() if not k.startswith("HF_")}
            env.update(HF_ENDPOINT=hub.endpoint, HF_HUB_CACHE=str(tmp / "cache"),
                       HF_HOME=str(tmp / "home"), HF_HUB_DISABLE_TELEMETRY="1")  # fmt: skip
            started = time.perf_counter()
            proc = subprocess.run(
                [sys.executable, "-m", "kimi_w31.converter", "org/kimi", str(tmp / "out"),
                 "--download", "--delete-source-shards", "--max-source-window",
                 str(args.window), "--manifest", "kimi-k3-any", "--max-shard-size",
                 args.max_shard_size, "--json"],
                env=env, capture_output=True, text=True, check=False,
            )  # fmt: skip
            seconds = time.perf_counter() - started
        if proc.returncode:
            sys.exit(f"exit {proc.returncode}\n{proc.stdout}\n{proc.stderr}")
        summary = json.loads(proc.stdout)
        output_bytes = sum(p.stat().st_size for p in (tmp / "out").iterdir())
        h = summary["hub"]
        print(json.dumps({
            "source_shards": args.shards, "output_shards": summary["output_shards"],
            "window": args.window, "source_bytes": source_bytes, "output_bytes": output_bytes,
            "source_plus_output": source_bytes + output_bytes,
            "peak_measured": h["peak_disk_measured"], "peak_bound": h["peak_disk_bound"],
            "peak_over_source_plus_output": round(
                h["peak_disk_measured"] / (source_bytes + output_bytes), 3),
            "peak_over_output": round(h["peak_disk_measured"] / output_bytes, 3),
            "seconds": round(seconds, 1),
        }, indent=2))  # fmt: skip


if __name__ == "__main__":
    main()
