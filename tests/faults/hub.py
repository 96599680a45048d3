"""The Hub, hostile or shared (`--download` against the loopback fake Hub, `hub_server.py`).

- A server that accepts and never answers (the file list, or the header probes), or answers
  a byte at a time just inside every wait: a clean
  `hub-timeout` within seconds, `--dry-run` included, no output and no partial download (the
  small files huggingface_hub completed before may stay in its cache); a run still going
  after two minutes is a hang (reported as a crash).
- A server that ignores `Range` and pads its answer by 4 GiB: the dry run is correct and
  the bytes it got to send stay bounded; a range answered from another offset: a clean
  `hub-error`.
- The cache path and `--download` of one repo and commit, in either order: the rerun keeps
  every shard and downloads nothing.
- `--delete-source-shards` beside another cached revision sharing all or half of the blobs:
  that revision stays whole, and the summary counts only what the Hub sent and what was
  freed.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import time
from pathlib import Path

from cli_helpers import CliResult, run_cli
from hub_server import FakeHub, Silent
from kimi_w31.converter.reasons import Code

from .core import CLEAN, CORRECT, CRASH, MANIFEST, SHARD_SIZE, WRONG, Case, tree

FAULT_TIME = "Hub request never answered"
FAULT_BYTES = "Hub answer longer than asked"
FAULT_ROUTE = "cache path and --download, one source"
FAULT_SHARED = "--delete-source-shards, shared cache"
REPO = "org/kimi-faults"
FOLDER = "models--org--kimi-faults"
OTHER = "e" * 40
HANG = 120  # s: a case still running is a hang
SENT_BOUND = 64 << 20


def _env(endpoint: str, case: Path, **extra: str) -> dict[str, str | None]:
    env: dict[str, str | None] = {k: None for k in os.environ if k.startswith("HF_")}
    env.update(
        HF_ENDPOINT=endpoint,
        HF_HOME=str(case / "hf_home"),
        HF_HUB_CACHE=str(case / "hf_cache"),
        HF_HUB_DISABLE_TELEMETRY="1",
        KIMI_W31_HUB_TIMEOUT="0.5",
        KIMI_W31_HUB_RETRIES="1",
    )
    env.update(extra)
    return env


def _run(args: list[object], env: dict[str, str | None]) -> CliResult | None:
    """The CLI with --json; None when it hangs."""
    try:
        return run_cli([*args, *MANIFEST, *SHARD_SIZE, "--json"], env=env, timeout=HANG)
    except subprocess.TimeoutExpired:
        return None


def _refused(
    fault: str, name: str, run: CliResult | None, want: Code, case: Path, before: dict
) -> Case:
    """A clean refusal with `want`: no output, no partial download."""
    if run is None:
        return Case(fault, name, CRASH, f"hang: still running after {HANG} s")
    codes = set(run.codes)
    if "Traceback (most recent call last)" in run.output or run.returncode not in (1, 2):
        return Case(fault, name, CRASH, f"exit {run.returncode}: {run.output[-300:]}")
    if want.value not in codes:
        return Case(fault, name, CRASH, f"{want.value} not reported: {sorted(codes)}")
    # The small files huggingface_hub completed before the refusal may stay in its cache;
    # no output, and no partial download, may.
    partial = [k for k in set(tree(case)) - set(before) if k.endswith(".incomplete")]
    if (case / "out").exists() or partial:
        return Case(fault, name, WRONG, f"wrote: {sorted(partial)[:3] or 'the output'}")
    first = next(p for p in run.problems if p.get("code") == want.value)
    return Case(fault, name, CLEAN, f"[{first['code']}] {first.get('what', '')}"[:160])


def _timed(
    fault: str, name: str, case: Path, want: Code, args: list[object], endpoint: str
) -> Case:
    """Run `args` for a case that must be refused with `want`; its time in the detail."""
    case.mkdir(parents=True)
    before = tree(case)
    started = time.monotonic()
    row = _refused(fault, name, _run(args, _env(endpoint, case)), want, case, before)
    row.detail += f" ({time.monotonic() - started:.1f} s)"
    return row


def _time_cases(hub: FakeHub, work: Path) -> list[Case]:
    rows = []
    for dry in (True, False):
        case = work / f"silent{int(dry)}"
        extra = ["--dry-run"] if dry else []
        name = "endpoint accepts, never answers: file list" + (" (--dry-run)" if dry else "")
        with Silent() as silent:
            args = [REPO, case / "out", "--download", *extra]
            rows.append(_timed(FAULT_TIME, name, case, Code.HUB_TIMEOUT, args, silent.endpoint))
    case = work / "stall"
    name = "header probes accepted, never answered (--dry-run)"
    hub.stall_probes = True
    try:
        args = [REPO, case / "out", "--download", "--dry-run"]
        rows.append(_timed(FAULT_TIME, name, case, Code.HUB_TIMEOUT, args, hub.endpoint))
    finally:
        hub.stall_probes = False
    case = work / "drip"
    name = "header probes answered a byte every 50 ms (--dry-run)"
    hub.drip_probes = 0.05
    try:
        args = [REPO, case / "out", "--download", "--dry-run"]
        rows.append(_timed(FAULT_TIME, name, case, Code.HUB_TIMEOUT, args, hub.endpoint))
    finally:
        hub.drip_probes = 0.0
    return rows


def _bytes_cases(hub: FakeHub, work: Path) -> list[Case]:
    rows = []
    case = work / "norange"
    case.mkdir()
    hub.ignore_range, hub.pad_probes = True, 4 << 30
    hub.log.clear()
    try:
        run = _run([REPO, case / "out", "--download", "--dry-run"], _env(hub.endpoint, case))
    finally:
        hub.ignore_range, hub.pad_probes = False, 0
    name = "Range ignored, answer padded by 4 GiB (--dry-run)"
    sent = max((r.sent for r in hub.log if r.file and r.file.endswith(".safetensors")), default=0)
    if run is None:
        rows.append(Case(FAULT_BYTES, name, CRASH, f"hang: still running after {HANG} s"))
    elif run.returncode != 0:
        rows.append(Case(FAULT_BYTES, name, CRASH, f"exit {run.returncode}: {run.output[-300:]}"))
    elif sent > SENT_BOUND:
        rows.append(Case(FAULT_BYTES, name, WRONG, f"a probe read {sent} bytes"))
    else:
        detail = f"the most a probe answer got to send: {sent} bytes (of 4 GiB more)"
        rows.append(Case(FAULT_BYTES, name, CORRECT, detail))
    case = work / "shifted"
    name = "range answered from another offset (--dry-run)"
    hub.shift_ranges = 3
    try:
        args = [REPO, case / "out", "--download", "--dry-run"]
        rows.append(_timed(FAULT_BYTES, name, case, Code.HUB_ERROR, args, hub.endpoint))
    finally:
        hub.shift_ranges = 0
    return rows


def _ok(run: CliResult | None) -> dict | None:
    return run.json if run is not None and run.returncode == 0 else None


def _route_cases(hub: FakeHub, work: Path) -> list[Case]:
    rows = []
    for first in ("cache", "download"):
        case = work / f"route-{first}"
        case.mkdir()
        out = case / "out"
        by_download = ([REPO, out, "--download"], _env(hub.endpoint, case))
        by_cache = ([REPO, out], _env(hub.endpoint, case, HF_HUB_OFFLINE="1"))
        runs = (by_cache, by_download) if first == "cache" else (by_download, by_cache)
        name = f"converted by {first}, rerun by the other route"
        seed = _ok(_run([REPO, case / "seed", "--download"], by_download[1]))
        made = _ok(_run(*runs[0]))
        if seed is None or made is None:
            rows.append(Case(FAULT_ROUTE, name, CRASH, "the first conversion failed"))
            continue
        served = len(hub.downloads())
        again = _ok(_run(*runs[1]))
        if again is None:
            rows.append(Case(FAULT_ROUTE, name, CRASH, "the rerun failed"))
            continue
        fetched = len(hub.downloads()) - served
        if not again["already_complete"] or again["shards_written"] or fetched:
            rows.append(Case(FAULT_ROUTE, name, WRONG, f"rewrote: {again['redone']}"[:160]))
        else:
            kept = again["shards_kept"]
            rows.append(Case(FAULT_ROUTE, name, CORRECT, f"{kept} shards kept, 0 downloaded"))
    return rows


def _shared_cases(hub: FakeHub, work: Path) -> list[Case]:
    rows = []
    shards = sorted(f for f in hub.files[REPO] if f.endswith(".safetensors"))
    for shared in ("all", "half"):
        case = work / f"shared-{shared}"
        case.mkdir()
        env = _env(hub.endpoint, case)
        name = f"another cached revision links to {shared} of the blobs"
        if _ok(_run([REPO, case / "seed", "--download"], env)) is None:
            rows.append(Case(FAULT_SHARED, name, CRASH, "the seeding download failed"))
            continue
        snapshots = case / "hf_cache" / FOLDER / "snapshots"
        other = snapshots / OTHER
        (snapshots / hub.commit).rename(other)
        fetched = shards[1::2] if shared == "half" else []
        for f in fetched:
            blob = Path(os.path.realpath(other / f))
            (other / f).unlink()
            blob.unlink()
        hub.log.clear()
        run = _run([REPO, case / "out", "--download", "--delete-source-shards"], env)
        summary = _ok(run)
        if summary is None:
            detail = "hang" if run is None else f"exit {run.returncode}: {run.output[-300:]}"
            rows.append(Case(FAULT_SHARED, name, CRASH, detail))
            continue
        h = summary["hub"]
        broken = [
            f
            for f in shards
            if f not in fetched
            and (
                not (other / f).exists()
                or hashlib.sha256((other / f).read_bytes()).hexdigest() != hub.files[REPO][f].etag
            )
        ]
        sizes = {f: hub.files[REPO][f].size for f in shards}
        honest = (h["downloaded_files"], h["downloaded_bytes"], h["deleted_bytes"]) == (
            len(fetched),
            sum(sizes[f] for f in fetched),
            sum(sizes[f] for f in fetched),
        )
        if broken:
            rows.append(Case(FAULT_SHARED, name, WRONG, f"the other revision lost {broken}"))
        elif not honest or sorted({d.file for d in hub.downloads()}) != fetched:
            rows.append(Case(FAULT_SHARED, name, WRONG, f"summary says {h}"[:160]))
        else:
            rows.append(
                Case(
                    FAULT_SHARED,
                    name,
                    CORRECT,
                    f"other revision whole; downloaded {h['downloaded_files']}, "
                    f"freed {h['deleted_bytes']} bytes, {h['deleted_shared_kept']} blobs kept",
                )
            )
    return rows


def hub_cases(template: Path, work: Path) -> list[Case]:
    with FakeHub({REPO: template}) as hub:
        return [
            *_time_cases(hub, work),
            *_bytes_cases(hub, work),
            *_route_cases(hub, work),
            *_shared_cases(hub, work),
        ]
