"""`make bench`: conversion and verify speed against `cp`/`sha256sum` of the same bytes,
peak memory, and planning at the real model's scale. Writes benchmarks.md + JSON (to
.reports/ unless --out says otherwise; `make bench UPDATE_DOCS=1` updates docs/).

Every figure is a median of repeated runs and is reported as a ratio to a baseline measured
in the same run on the same files. "warm": inputs in the page cache; "cold": every input
and output file evicted first (sync + POSIX_FADV_DONTNEED). Conversion fsyncs each shard,
so its physical reference is `cp -r && sync`; plain `cp -r` is shown too.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from replica import write_converted_replica, write_source_replica  # noqa: E402

from kimi_w31 import __version__  # noqa: E402

CLI = [sys.executable, "-m", "kimi_w31"]
DOCS = HERE.parent / "docs"

# Runs a command and reports its wall time and the peak RSS of the largest process in its
# tree (RUSAGE_CHILDREN covers every descendant that was waited for).
_MEASURE = r"""
import json, resource, subprocess, sys, time
t = time.perf_counter()
rc = subprocess.call(sys.argv[1:], stdout=subprocess.DEVNULL)
dt = time.perf_counter() - t
print(json.dumps({"rc": rc, "seconds": dt,
                  "peak_rss": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024}))
"""


def measure(cmd: list[str], shell: bool = False, ok: tuple[int, ...] = (0,)) -> dict:
    argv = ["/bin/sh", "-c", cmd[0]] if shell else cmd
    out = subprocess.run(
        [sys.executable, "-c", _MEASURE, *argv], capture_output=True, text=True, check=True
    )
    result = json.loads(out.stdout.strip().splitlines()[-1])
    if result["rc"] not in ok:
        raise RuntimeError(f"benchmark command failed: {' '.join(argv)}")
    return result


def evict(*roots: Path) -> None:
    os.sync()
    for root in roots:
        if not root.exists():
            continue
        for p in root.rglob("*"):
            if p.is_file():
                fd = os.open(p, os.O_RDONLY)
                try:
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                finally:
                    os.close(fd)


def warm(root: Path) -> None:
    for p in root.rglob("*"):
        if p.is_file():
            with open(p, "rb") as fh:
                while fh.read(16 << 20):
                    pass


def timed_run(cmd: list[str], cache: str, src: Path, dst: Path, shell: bool = False) -> dict:
    shutil.rmtree(dst, ignore_errors=True)
    os.sync()
    if cache == "cold":
        evict(src)
    else:
        warm(src)
    result = measure(cmd, shell=shell)
    shutil.rmtree(dst, ignore_errors=True)
    return result


def du(root: Path) -> int:
    return sum(p.stat().st_size for p in root.rglob("*") if p.is_file())


def machine_facts(work: Path) -> dict:
    import huggingface_hub
    import numpy
    import safetensors

    fs = subprocess.run(["df", "-T", str(work)], capture_output=True, text=True).stdout
    meminfo = Path("/proc/meminfo").read_text().splitlines()
    cpuinfo = Path("/proc/cpuinfo").read_text().splitlines()
    mem = next((ln.split()[1] for ln in meminfo if ln.startswith("MemTotal")), "0")
    cpu = next(
        (ln.split(":", 1)[1].strip() for ln in cpuinfo if ln.startswith("model name")),
        platform.processor(),
    )
    return {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "cores": os.cpu_count(),
        "cpu": cpu,
        "memory_gib": round(int(mem) / 2**20, 1),
        "filesystem": fs.strip().splitlines()[-1].split()[1] if fs.strip() else "?",
        "python": platform.python_version(),
        "kimi_w31": __version__,
        "safetensors": safetensors.__version__,
        "huggingface_hub": huggingface_hub.__version__,
        "numpy": numpy.__version__,
        "kernel": platform.release(),
    }


def bench_throughput(work: Path, src: Path, repeats: int, workers: list[int]) -> dict:
    """Interleaved rounds (cp, cp && sync, convert per worker count), ratios taken within a
    round: this machine's disk speed drifts by 2-3x over minutes, so only runs measured side
    by side are compared; the figure reported is the median of the per-round ratios."""
    dst = work / "dst"
    rows = {}
    for cache in ("warm", "cold"):
        runs: dict[str, list[float]] = {"cp": [], "cp_sync": []}
        runs.update({f"w{w}": [] for w in workers})
        commands: dict[str, tuple[list[str], bool]] = {
            "cp": ([f"cp -r {src} {dst}"], True),
            "cp_sync": ([f"cp -r {src} {dst} && sync"], True),
        }
        for w in workers:
            commands[f"w{w}"] = (
                [*CLI, str(src), str(dst), "--manifest", "kimi-k3-any", "--workers", str(w), "-q"],
                False,
            )
        order = list(commands)
        for r in range(repeats):
            # Rotate the order each round: the first command of a round was seen to pay for
            # the previous round's deletes, so every command takes every position in turn.
            for key in order[r % len(order) :] + order[: r % len(order)]:
                cmd, shell = commands[key]
                runs[key].append(timed_run(cmd, cache, src, dst, shell)["seconds"])
        med = statistics.median
        row = {
            "cp": {"median_s": med(runs["cp"]), "runs_s": runs["cp"]},
            "cp_sync": {"median_s": med(runs["cp_sync"]), "runs_s": runs["cp_sync"]},
            "convert": {},
        }
        for w in workers:
            t = runs[f"w{w}"]
            row["convert"][w] = {
                "median_s": med(t),
                "runs_s": t,
                "vs_cp_sync": med(a / b for a, b in zip(t, runs["cp_sync"], strict=True)),
                "vs_cp": med(a / b for a, b in zip(t, runs["cp"], strict=True)),
            }
        rows[cache] = row
    return rows


def bench_memory(work: Path, src: Path) -> dict:
    dst = work / "dst"
    rows = {}
    for label, size in (("0.5GB", "500MB"), ("4GB", "4GB")):
        shutil.rmtree(dst, ignore_errors=True)
        r = measure(
            [*CLI, str(src), str(dst), "--manifest", "kimi-k3-any", "--max-shard-size", size, "-q"]
        )
        rows[label] = {
            "peak_rss": r["peak_rss"],
            "seconds": r["seconds"],
            "shards": len(list(dst.glob("*.safetensors"))),
        }
    shutil.rmtree(dst, ignore_errors=True)
    return rows


def bench_verify(work: Path, src: Path, repeats: int, workers: list[int]) -> dict:
    out = work / "verify-out"
    shutil.rmtree(out, ignore_errors=True)
    subprocess.run([*CLI, str(src), str(out), "--manifest", "kimi-k3-any", "-q"], check=True)
    files = sorted(str(p) for p in out.glob("*.safetensors"))
    warm(out)
    sha = [measure(["sha256sum", *files])["seconds"] for _ in range(repeats)]
    rows = {"sha256sum_s": statistics.median(sha), "verify": {}}
    for w in workers:
        cmd = [*CLI, "verify", str(out), "--checksums", "--workers", str(w), "-q"]
        t = [measure(cmd)["seconds"] for _ in range(repeats)]
        rows["verify"][w] = {
            "median_s": statistics.median(t),
            "vs_sha256sum": statistics.median(t) / rows["sha256sum_s"],
        }
    rows["bytes"] = du(out)
    shutil.rmtree(out, ignore_errors=True)
    return rows


# The floor under any planner in Python: start the interpreter, read the index and every
# header and decode their JSON with the standard library, checking nothing.
_JSON_FLOOR = r"""
import json, pathlib, struct, sys
root = pathlib.Path(sys.argv[1])
json.loads((root / "model.safetensors.index.json").read_bytes())
for path in sorted(root.glob("*.safetensors")):
    with open(path, "rb") as fh:
        (n,) = struct.unpack("<Q", fh.read(8))
        json.loads(fh.read(n))
"""


def _problem_codes(argv: list[str]) -> set[str]:
    """The reason codes of a `--json` run's problems (empty when it succeeds)."""
    proc = subprocess.run(argv, capture_output=True, text=True)
    if proc.returncode == 0:
        return set()
    doc = json.loads(proc.stdout)
    return {p["code"] for p in doc.get("problems", [])} or {f"exit {proc.returncode}"}


def bench_planning(work: Path, repeats: int) -> dict:
    src, conv = work / "replica-src", work / "replica-out"
    shutil.rmtree(src, ignore_errors=True)
    shutil.rmtree(conv, ignore_errors=True)
    info = write_source_replica(src)
    write_converted_replica(src, conv)
    dry_run = [*CLI, str(src), str(work / "never-written"), "--dry-run", "-q"]
    # The dry run plans everything, then checks free space as the real run does: a bench disk
    # rarely has 1.6 TB free, so its only refusal may be `no-space` (exit 1), checked here once.
    refused = _problem_codes([*dry_run, "--json"])
    if refused - {"no-space"}:
        raise RuntimeError(f"the replica's dry run was refused: {sorted(refused)}")
    dry, ver, floor = [], [], []
    for _ in range(repeats):  # interleaved, so a slow minute of the VM hits all three alike
        dry.append(measure(dry_run, ok=(0, 1) if refused else (0,)))
        ver.append(measure([*CLI, "verify", str(conv), "-q"]))
        floor.append(measure([sys.executable, "-c", _JSON_FLOOR, str(src)]))
    result = {
        **info,
        "disk_bytes": sum(p.stat().st_blocks * 512 for p in src.rglob("*") if p.is_file()),
        "dry_run_s": statistics.median(r["seconds"] for r in dry),
        "dry_run_rss": max(r["peak_rss"] for r in dry),
        "verify_structure_s": statistics.median(r["seconds"] for r in ver),
        "dry_run_runs_s": [r["seconds"] for r in dry],
        "verify_structure_runs_s": [r["seconds"] for r in ver],
        "json_floor_s": statistics.median(r["seconds"] for r in floor),
        "verify_structure_rss": max(r["peak_rss"] for r in ver),
    }
    shutil.rmtree(src, ignore_errors=True)
    shutil.rmtree(conv, ignore_errors=True)
    return result


def render(report: dict) -> str:
    f = report["facts"]
    gb = report["source_bytes"] / 1e9
    lines = [
        "# Benchmarks",
        "",
        f"Measured {f['date']} by `make bench` (`python tools/bench.py --out docs`) on "
        f"{f['cores']} cores ({f['cpu']}), {f['memory_gib']} GiB memory, {f['filesystem']} "
        f"filesystem; Python {f['python']}, kimi-w31 {f['kimi_w31']}, safetensors "
        f"{f['safetensors']}, huggingface_hub {f['huggingface_hub']}, numpy {f['numpy']}, "
        f"kernel {f['kernel']}. Medians of {report['repeats']} runs; ratios are against a "
        "baseline measured in the same run on the same files (for conversion: the median of "
        "per-round ratios; each round runs cp, cp && sync and convert back to back, in an order "
        "rotated from round to round). Raw "
        "figures: "
        "`docs/benchmarks.json`.",
        "",
        f"## Conversion throughput vs `cp` ({gb:.2f} GB synthetic real-dims checkpoint: "
        "K 3584, N 3072)",
        "",
        "warm: source in the page cache; cold: source evicted before each run "
        "(sync + POSIX_FADV_DONTNEED). Conversion fsyncs every shard, so `cp -r && sync` is "
        "the physical reference; plain `cp -r` (no durability) is shown too.",
        "",
        "| cache | cp -r | cp -r && sync | workers | convert | convert / (cp && sync) "
        "| convert / cp |",
        "|---|---|---|---|---|---|---|",
    ]
    for cache, row in report["throughput"].items():
        for w, conv in row["convert"].items():
            lines.append(
                f"| {cache} | {row['cp']['median_s']:.2f} s | {row['cp_sync']['median_s']:.2f} s "
                f"| {w} | {conv['median_s']:.2f} s ({gb / conv['median_s'] * 1000:.0f} MB/s) | "
                f"**{conv['vs_cp_sync']:.3f}** | {conv['vs_cp']:.3f} |"
            )
    mem = report["memory"]
    lines += [
        "",
        "## Peak memory (RSS of the whole process tree)",
        "",
        "| output shard size | shards | peak RSS |",
        "|---|---|---|",
    ]
    for label, row in mem.items():
        lines.append(f"| {label} | {row['shards']} | {row['peak_rss'] / 2**20:.0f} MiB |")
    p = report["planning"]
    lines += [
        "",
        "## Planning at the real model's scale",
        "",
        "A header-only replica of the published Kimi-K3 checkpoint (`tools/replica.py`: 93 "
        "layers, 92 MoE layers x 896 experts, the published names, shapes, dtypes, shard "
        f"placement and headers; {p['tensors']} tensors in {p['shards']} per-layer shards, "
        f"~{p['tensors'] // max(p['shards'], 1):,} tensors per shard, "
        f"{p['apparent_bytes'] / 1e12:.3f} TB apparent size as sparse files, "
        f"{p['disk_bytes'] / 1e6:.0f} MB on disk).",
        "",
        "| command | time | peak RSS | target |",
        "|---|---|---|---|",
        f"| `kimi-convert SRC OUT --dry-run` (index + headers + manifest + full plan) | "
        f"{p['dry_run_s']:.2f} s | {p['dry_run_rss'] / 2**20:.0f} MiB | <= 5 s, <= 1 GB |",
        f"| `kimi-convert verify OUT` (structure level, converted-layout replica) | "
        f"{p['verify_structure_s']:.2f} s | {p['verify_structure_rss'] / 2**20:.0f} MiB | "
        "<= 5 s, <= 1 GB |",
    ]
    if p.get("json_floor_s"):
        runs = ", ".join(f"{t:.2f}" for t in p["dry_run_runs_s"])
        lines += [
            "",
            f"Baseline in the same run: Python start-up plus the standard library's JSON "
            f"decoding of the same index and headers, nothing checked: "
            f"{p['json_floor_s']:.2f} s. The dry run takes "
            f"**{p['dry_run_s'] / p['json_floor_s']:.2f}x** that, verify's structure level "
            f"**{p['verify_structure_s'] / p['json_floor_s']:.2f}x**. Dry-run runs: {runs} s.",
        ]
    v = report["verify"]
    lines += [
        "",
        f"## verify --checksums vs sha256sum ({v['bytes'] / 1e9:.2f} GB, warm)",
        "",
        f"`sha256sum` of the same shard files: {v['sha256sum_s']:.2f} s.",
        "",
        "| workers | verify --checksums | / sha256sum |",
        "|---|---|---|",
    ]
    for w, row in v["verify"].items():
        lines.append(f"| {w} | {row['median_s']:.2f} s | **{row['vs_sha256sum']:.3f}** |")
    lines += ["", report.get("notes", ""), ""]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument(
        "--out",
        type=Path,
        default=Path(".reports"),
        help="where the report goes (default: untracked; `--out docs` updates the "
        "committed one, as `make bench UPDATE_DOCS=1` does)",
    )
    ap.add_argument("--work", type=Path, default=Path(".bench"))
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--experts", type=int, default=60, help="per layer; 4x60 is ~5 GB")
    ap.add_argument(
        "--repeats",
        type=int,
        default=4,
        help="rounds (4: each command once in each position of a round)",
    )
    ap.add_argument("--tiny", action="store_true", help="smoke run on tiny inputs (tests)")
    ap.add_argument(
        "--planning-only",
        action="store_true",
        help="only the planning benchmark on the published layout: print its JSON, write no report",
    )
    args = ap.parse_args()
    work = args.work.resolve()
    work.mkdir(parents=True, exist_ok=True)
    if args.planning_only:
        print(json.dumps(bench_planning(work, args.repeats), indent=2))
        return
    src = work / "src"
    shutil.rmtree(src, ignore_errors=True)
    synth = [
        *CLI,
        "synth",
        str(src),
        "--layers",
        str(args.layers),
        "--dense-layers",  # every layer a MoE layer: the 4.3 GB of earlier reports
        "0",
        "--experts",
        str(args.experts),
        "--shards",
        "8",
    ]
    # Real expert shapes (K 3584, N 3072) with the small attention and vision of the default
    # synth: ~5 GB, mostly experts, near the 4.3 GB of earlier reports (--real-dims: ~9 GB).
    synth += ["--k", "256", "--n", "128"] if args.tiny else ["--k", "3584", "--n", "3072"]
    subprocess.run(synth, check=True, capture_output=True)
    workers = sorted({1, 2, os.cpu_count() or 1})
    print(f"source: {du(src) / 1e9:.2f} GB; workers {workers}", flush=True)
    report = {"facts": machine_facts(work), "repeats": args.repeats, "source_bytes": du(src)}
    report["throughput"] = bench_throughput(work, src, args.repeats, workers)
    print("throughput done", flush=True)
    report["memory"] = bench_memory(work, src)
    report["verify"] = bench_verify(work, src, args.repeats, workers)
    print("memory + verify done", flush=True)
    report["planning"] = (
        bench_planning(work, 1 if args.tiny else args.repeats)
        if not args.tiny
        else {
            "tensors": 0,
            "shards": 0,
            "apparent_bytes": 0,
            "disk_bytes": 0,
            "dry_run_s": 0,
            "dry_run_rss": 0,
            "verify_structure_s": 0,
            "verify_structure_rss": 0,
        }
    )
    args.out.mkdir(parents=True, exist_ok=True)
    notes = DOCS / "benchmarks-notes.md"
    report["notes"] = notes.read_text() if notes.exists() else ""
    (args.out / "benchmarks.json").write_text(json.dumps(report, indent=2) + "\n")
    (args.out / "benchmarks.md").write_text(render(report))
    print(render(report))
    shutil.rmtree(src, ignore_errors=True)
    for leftover in ("dst", "verify-out", "replica-src", "replica-out"):
        shutil.rmtree(work / leftover, ignore_errors=True)
    if not any(work.iterdir()):
        work.rmdir()


if __name__ == "__main__":
    main()
