"""The fault library's shared core: outcomes, `Case`, sources, trees, and the judges.

Every scenario runs the real converter (in-process through click's runner for input
validation, in a subprocess wherever a process must die or hit a resource limit) and
classifies each case by what a user would see:

- `clean error`: exit 1 (or 2 for usage), the expected reason code in `--json` with the
  file named, no traceback, no index in the output, nothing written outside the output
  directory;
- `resumed identical`: after the fault, rerunning the same command produced an output
  byte-identical to an uninterrupted run;
- `correct`: a case that must simply work (a Hub cache source, permissions, --force);
- `crash`: a traceback or an unexpected exception surfaced;
- `silently wrong`: exit 0 on bad input, or an output that differs from the reference.

Scenarios return `Case` rows; the tests assert on them and the fault table prints them.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import struct
import subprocess
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from cli_helpers import json_problems, run_cli
from kimi_w31.converter.contract import STATE_DIR
from kimi_w31.converter.reasons import Code
from kimi_w31.converter.synth import SynthSpec, synth_checkpoint

CLEAN = "clean error"
RESUMED = "resumed identical"
CORRECT = "correct"
CRASH = "crash"
WRONG = "silently wrong"
OUTCOMES = [CLEAN, RESUMED, CORRECT, CRASH, WRONG]  # the table's columns, in order

MANIFEST = ["--manifest", "kimi-k3-any"]
SHARD_SIZE = ["--max-shard-size", "300KB"]  # ~13 output shards from the small synth source
INDEX = "model.safetensors.index.json"
STATE = STATE_DIR
VICTIM = "model-00002-of-000006.safetensors"  # layer 1 (MoE): the data faults hit it
C = Code


@dataclass
class Case:
    fault: str  # the fault class (a row group of the table)
    name: str
    outcome: str
    detail: str = ""


# ---------------------------------------------------------------------------- sources


def make_source(path: Path, layers: int = 3, experts: int = 8, shards: int | None = None) -> Path:
    """As published: one shard per layer plus three (None), or `shards` packed by size."""
    synth_checkpoint(path, SynthSpec(layers=layers, experts=experts, shards=shards))
    return path


def copy_source(template: Path, dest: Path) -> Path:
    shutil.copytree(template, dest, symlinks=True)
    return dest


def tree(root: Path) -> dict[str, str]:
    """Relative path -> sha256 (or link target) of everything under root, hidden files too."""
    out: dict[str, str] = {}
    if not root.exists():
        return out
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            p = Path(dirpath) / name
            rel = str(p.relative_to(root))
            if p.is_symlink():
                out[rel] = "-> " + os.readlink(p)
            elif p.is_file():
                out[rel] = hashlib.sha256(p.read_bytes()).hexdigest()
            else:
                out[rel] = "dir"
    return out


def tree_diff(a: dict[str, str], b: dict[str, str]) -> str:
    keys = sorted(set(a) | set(b))
    diff = [k for k in keys if a.get(k) != b.get(k)]
    return ", ".join(diff[:5]) + (f" (+{len(diff) - 5})" if len(diff) > 5 else "")


def convert_args(src: Path, out: Path, *extra: str) -> list[str]:
    return [str(src), str(out), *MANIFEST, *SHARD_SIZE, "-q", *extra]


# ---------------------------------------------------------------------- reading a run


def _first_problem(text: str) -> str:
    problems = json_problems(text)
    if not problems:
        return text[-160:]
    return f"[{problems[0].get('code')}] {problems[0].get('what', '')}"[:160]


def codes(text: str) -> set[str]:
    return {p.get("code") for p in json_problems(text)}


def looks_like_crash(text: str) -> bool:
    # The CLI's last-resort handler prints this for an unexpected exception.
    return "Traceback (most recent call last)" in text or "KIMI_W31_DEBUG" in text


def classify_error(
    code: int,
    text: str,
    exc: BaseException | None,
    out: Path,
    outside_before: dict[str, str],
    outside_after: dict[str, str],
    want: Code | None = None,
    must_name: str | None = None,
) -> tuple[str, str]:
    """A case that must be refused (run with --json): is it a clean error with its code?"""
    flat = " ".join(text.split())
    if exc is not None or looks_like_crash(text):
        return CRASH, f"{type(exc).__name__ if exc else 'traceback'}: {flat[-300:]}"
    if code == 0:
        return WRONG, "exit 0 on hostile input"
    if (out / INDEX).exists():
        return WRONG, "an index (complete-looking output) was written"
    if outside_before != outside_after:
        return WRONG, "wrote outside the output directory: " + tree_diff(
            outside_before, outside_after
        )
    problems = json_problems(text)
    if code not in (1, 2) or not problems:
        return CRASH, f"exit {code} without a reported problem: {flat[-300:]}"
    if want is not None and want.value not in {p.get("code") for p in problems}:
        return CRASH, f"reason {want.value} not reported: {flat[-300:]}"
    if must_name and not any(must_name in (p.get("file") or "") for p in problems):
        return CRASH, f"no problem names {must_name!r}: {flat[-300:]}"
    first = next(p for p in problems if want is None or p.get("code") == want.value)
    return CLEAN, f"[{first.get('code')}] {first.get('what', '')}"[:160]


# ------------------------------------------------------------------------ shard bytes


def read_shard(path: Path) -> tuple[dict, bytes]:
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8 : 8 + n]), raw[8 + n :]


def shard_bytes(header: dict | bytes | str, data: bytes, length: int | None = None) -> bytes:
    body = (
        header
        if isinstance(header, bytes)
        else (header.encode() if isinstance(header, str) else json.dumps(header).encode())
    )
    return struct.pack("<Q", len(body) if length is None else length) + body + data


def tensor_names(header: dict) -> list[str]:
    """Tensor names in data order."""
    names = [k for k in header if k != "__metadata__"]
    return sorted(names, key=lambda k: header[k]["data_offsets"][0])


# ----------------------------------------------------------------- a run held stopped


def resume_stopped(proc: subprocess.Popen) -> tuple[int, str, str]:
    """Continue a run `cli_helpers.start_cli` holds; (exit code, stderr, stdout)."""
    os.kill(proc.pid, signal.SIGCONT)
    out, err = proc.communicate(timeout=120)
    return proc.returncode, err, out


# --------------------------------------------------------------------- judging a case


def hostile_cases(
    template: Path,
    work: Path,
    fault: str,
    cases: dict[str, tuple[Callable[[Path], None], Code]],
    manifest: list[str] = MANIFEST,
    name_file: str | None = None,
) -> list[Case]:
    """Each mutation of a clean source, converted through the CLI: must be a clean error
    with its reason code (and naming `name_file`, when given)."""
    rows = []
    for i, (name, (mutate, want)) in enumerate(cases.items()):
        case_dir = work / f"{fault[:8].replace(' ', '_')}{i}"
        case_dir.mkdir(parents=True)
        src = copy_source(template, case_dir / "src")
        mutate(src)
        out = case_dir / "out"
        before = {k: v for k, v in tree(case_dir).items() if not k.startswith("out")}
        run = run_cli([src, out, *manifest, *SHARD_SIZE, "--json"], inprocess=True)
        code, text, exc = run.returncode, run.stdout, run.exception
        after = {k: v for k, v in tree(case_dir).items() if not k.startswith("out")}
        outcome, detail = classify_error(code, text, exc, out, before, after, want, name_file)
        if outcome == CLEAN and out.exists():
            outcome, detail = WRONG, "output directory created before validation finished"
        rows.append(Case(fault, name, outcome, detail))
    return rows


def reference_output(src: Path, out: Path, workers: int = 1, *extra: str) -> dict[str, str]:
    """An uninterrupted conversion (default: 300KB shards): the tree every fault must match."""
    proc = run_cli(convert_args(src, out, "--workers", str(workers), *extra))
    assert proc.returncode == 0, proc.stderr
    return tree(out)


# --------------------------------------------------------------------------- reporting


def bad_rows(rows: list[Case], allowed: set[str]) -> str:
    """The rows whose outcome is not allowed, one a line (empty when all are fine)."""
    return "\n".join(
        f"[{r.outcome}] {r.fault} / {r.name}: {r.detail}" for r in rows if r.outcome not in allowed
    )


def fuzz(examples: int):
    """Hypothesis settings for the property tests: modest by default so `make test` stays
    quick; `KIMI_W31_FUZZ_SCALE=20` (the fault table) runs twenty times as many examples.
    No example database: nothing is written into the checkout."""
    from hypothesis import HealthCheck, settings

    scale = float(os.environ.get("KIMI_W31_FUZZ_SCALE", "1"))
    return settings(
        max_examples=max(1, int(examples * scale)),
        deadline=None,
        database=None,
        suppress_health_check=[HealthCheck.too_slow],
    )
