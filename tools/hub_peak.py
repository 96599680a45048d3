"""Peak disk of a streamed Hub conversion, measured, against source + output.

Serves a synthetic checkpoint from a loopback fake Hub (tests/hub_server.py), converts it
with `--download --delete-source-shards` through the real `huggingface_hub` client, and
reports the converter's own high-water mark of (download storage + output), sampled while
downloads run and at every point where disk use peaks (after each source shard arrives and
each output shard lands, before any source is freed).

With `--interrupts N` the conversion is first interrupted N times while its downloads are
partly on disk (Ctrl-C, or `--signal KILL`), over a slowed link; the figures are then those
of the run that resumes it, and the partial downloads left behind are counted too.

    python tools/hub_peak.py --layers 4 --experts 8 --shards 8 --real-dims --window 3
    python tools/hub_peak.py --real-dims --interrupts 3 --signal KILL
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))

from hub_server import FakeHub  # noqa: E402
from kimi_w31.converter.synth import REAL_K, REAL_N, SynthSpec, synth_checkpoint  # noqa: E402

REPO = "org/kimi"
CONVERT = "from kimi_w31.cli import main; main(prog_name='kimi-convert')"


def _partials(storage: Path) -> list[Path]:
    return sorted(storage.rglob("*.incomplete")) if storage.exists() else []


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:  # renamed into place, or removed, since it was listed
        return 0


def _interrupt(
    argv: list[str], env: dict[str, str], storage: Path, sig: signal.Signals, after: float
) -> None:
    """Start a run, stop it with `sig` `after` seconds after a partial download holds data."""
    proc = subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 300
    try:
        while not any(_size(p) for p in _partials(storage)):
            if proc.poll() is not None or time.monotonic() > deadline:
                sys.exit("the run ended before it could be interrupted: lower --rate")
            time.sleep(0.02)
        time.sleep(after)
    finally:
        proc.send_signal(sig)
        proc.wait()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--shards", type=int, default=8)
    ap.add_argument("--real-dims", action="store_true")
    ap.add_argument("--window", type=int, default=3)
    ap.add_argument("--max-shard-size", default="100MB")
    ap.add_argument(
        "--interrupts", type=int, default=0, help="interrupted runs before the measured one"
    )
    ap.add_argument("--signal", choices=["INT", "KILL"], default="INT")
    ap.add_argument(
        "--rate",
        type=int,
        default=40_000_000,
        help="bytes/s per download during the interrupted runs",
    )
    ap.add_argument(
        "--after",
        type=float,
        default=1.0,
        help="seconds an interrupted run goes on once a partial download holds data",
    )
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        k, n = (REAL_K, REAL_N) if args.real_dims else (128, 64)
        spec = SynthSpec(
            layers=args.layers,
            experts=args.experts,
            shards=args.shards,
            k=k,
            n=n,
            hidden=1024 if args.real_dims else 256,
        )
        src = tmp / "src"
        synth_checkpoint(src, spec)
        source_bytes = sum(p.stat().st_size for p in src.iterdir())
        storage = tmp / "cache" / "models--org--kimi"
        argv = [
            sys.executable,
            "-c",
            CONVERT,
            REPO,
            str(tmp / "out"),
            "--download",
            "--delete-source-shards",
            "--max-source-window",
            str(args.window),
            "--manifest",
            "kimi-k3-any",
            "--max-shard-size",
            args.max_shard_size,
        ]
        with FakeHub({REPO: src}) as hub:
            env = {k: v for k, v in os.environ.items() if not k.startswith("HF_")}
            env.update(
                HF_ENDPOINT=hub.endpoint,
                HF_HUB_CACHE=str(tmp / "cache"),
                HF_HOME=str(tmp / "home"),
                HF_HUB_DISABLE_TELEMETRY="1",
            )
            hub.rate = args.rate
            for _ in range(args.interrupts):
                _interrupt(argv, env, storage, getattr(signal, f"SIG{args.signal}"), args.after)
            left = _partials(storage)
            left_bytes = sum(_size(p) for p in left)
            hub.rate = None
            started = time.perf_counter()
            proc = subprocess.run(
                [*argv, "--json"], env=env, capture_output=True, text=True, check=False
            )
            seconds = time.perf_counter() - started
        if proc.returncode:
            sys.exit(f"exit {proc.returncode}\n{proc.stdout}\n{proc.stderr}")
        summary = json.loads(proc.stdout)
        output_bytes = sum(p.stat().st_size for p in (tmp / "out").iterdir())
        h = summary["hub"]
        print(
            json.dumps(
                {
                    "source_shards": args.shards,
                    "output_shards": summary["output_shards"],
                    "window": args.window,
                    "source_bytes": source_bytes,
                    "output_bytes": output_bytes,
                    "source_plus_output": source_bytes + output_bytes,
                    "peak_measured": h["peak_disk_measured"],
                    "peak_bound": h["peak_disk_bound"],
                    "peak_over_source_plus_output": round(
                        h["peak_disk_measured"] / (source_bytes + output_bytes), 3
                    ),
                    "peak_over_output": round(h["peak_disk_measured"] / output_bytes, 3),
                    "interrupts": args.interrupts,
                    "signal": args.signal if args.interrupts else None,
                    "partials_before_resume": len(left),
                    "partial_bytes_before_resume": left_bytes,
                    "partials_removed_by_resume": h["partial_downloads_removed"],
                    "partials_after": len(_partials(storage)),
                    "partial_bytes_after": sum(_size(p) for p in _partials(storage)),
                    "seconds": round(seconds, 1),
                },
                indent=2,
            )
        )


if __name__ == "__main__":
    main()
