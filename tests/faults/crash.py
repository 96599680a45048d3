"""Crashes: a process killed at each fault point, SIGINT, a torn ledger; the rerun resumes."""

from __future__ import annotations

import json
import shutil
import signal
from pathlib import Path

from cli_helpers import run_cli
from kimi_w31.converter.output.directory import OutputDir
from kimi_w31.converter.pipeline import ConvertOptions, prepare

from .core import (
    CLEAN,
    CRASH,
    INDEX,
    RESUMED,
    STATE,
    WRONG,
    Case,
    convert_args,
    copy_source,
    looks_like_crash,
    reference_output,
    tree,
    tree_diff,
)


def label_totals(src: Path) -> dict[str, int]:
    """How often each fault point is reached in one uninterrupted run."""
    source, _, plan = prepare(
        ConvertOptions(
            source=str(src), out=src.parent / "x", manifest="kimi-k3-any", max_shard_size=300_000
        )
    )
    shards = len(plan.shards)
    extras = len(source.extra_files)
    return {
        "lock.acquired": 1,
        "ledger.opened": 1,
        "shard.header": shards,
        "shard.piece": sum(len(t.pieces) for s in plan.shards for t in s.tensors),
        "shard.fsynced": shards,
        "shard.renamed": shards,
        "ledger.append": shards,
        "ledger.appended": shards,
        "finalize.extra": extras,
        "finalize.checksums": 1,
        "finalize.config": 1,
        "finalize.index": 1,
    }


def kill_points(totals: dict[str, int], per_label: int) -> list[tuple[str, int]]:
    """Up to per_label calls of each label, spread evenly from the first to the last."""
    points = []
    for label, total in totals.items():
        k = min(per_label, total)
        picks = sorted({1 + round(i * (total - 1) / max(1, k - 1)) for i in range(k)})
        points += [(label, n) for n in picks]
    return points


def crash_case(
    src: Path, out: Path, ref: dict[str, str], workers: int, faults: list[str]
) -> tuple[str, str]:
    """Run with each fault in turn (each must kill the run), then without: compare."""
    args = convert_args(src, out, "--workers", str(workers))
    src_before = tree(src)
    for spec in faults:
        proc = run_cli(args, env={"KIMI_W31_FAULT_AT": spec})
        if proc.returncode != -signal.SIGKILL:
            return CRASH, f"{spec}: expected SIGKILL, exit {proc.returncode}: {proc.stderr[-300:]}"
        if (out / INDEX).exists():
            # Killed after the index: it must already be complete and correct.
            done = {k: v for k, v in tree(out).items() if not k.startswith(STATE)}
            if done != ref:
                return WRONG, f"{spec}: complete-looking output differs: {tree_diff(done, ref)}"
    proc = run_cli(args)
    if proc.returncode != 0:
        kind = CRASH if looks_like_crash(proc.stderr) else CLEAN
        return kind, f"rerun exit {proc.returncode}: {proc.stderr[-300:]}"
    got = tree(out)
    if got != ref:
        return WRONG, "differs from an uninterrupted run: " + tree_diff(got, ref)
    if tree(src) != src_before:
        return WRONG, "the source changed"
    return RESUMED, ""


def crash_cases(template: Path, work: Path, workers: int, per_label: int) -> list[Case]:
    src = copy_source(template, work / "src")
    ref = reference_output(src, work / "ref", workers)
    rows = []
    points = kill_points(label_totals(src), per_label)
    for i, (label, n) in enumerate(points):
        out = work / f"out{i}"
        outcome, detail = crash_case(src, out, ref, workers, [f"{label}:{n}"])
        rows.append(Case(f"SIGKILL, --workers {workers}", f"{label} #{n}", outcome, detail))
        shutil.rmtree(out, ignore_errors=True)
    # Killed again while resuming (reused shards, a second stale lock, a rewritten ledger).
    chains = [
        ["shard.renamed:3", "shard.header:2", "ledger.append:4"],
        ["ledger.appended:5", "finalize.config:1"],
    ]
    for chain in chains:
        out = work / f"chain{len(rows)}"
        outcome, detail = crash_case(src, out, ref, workers, chain)
        rows.append(Case(f"SIGKILL, --workers {workers}", " then ".join(chain), outcome, detail))
    verify = run_cli(["verify", work / "ref", "--checksums", "-q"])
    if verify.returncode != 0:
        rows.append(
            Case(f"SIGKILL, --workers {workers}", "reference verifies", WRONG, verify.stderr[-300:])
        )
    return rows


def sigint_cases(template: Path, work: Path) -> list[Case]:
    """Ctrl-C (SIGINT) mid-shard: exit 130, says how to resume; the rerun completes."""
    src = copy_source(template, work / "src")
    ref = reference_output(src, work / "ref", 2)
    rows = []
    for spec in ["shard.piece:20:int", "shard.renamed:4:int", "ledger.append:2:int"]:
        out = work / f"out_{spec.replace(':', '_')}"
        args = convert_args(src, out, "--workers", "2")
        proc = run_cli(args, env={"KIMI_W31_FAULT_AT": spec})
        if looks_like_crash(proc.stderr):
            outcome, detail = CRASH, proc.stderr[-300:]
        elif proc.returncode != 130:
            outcome, detail = CRASH, f"exit {proc.returncode}: {proc.stderr[-300:]}"
        elif (out / INDEX).exists():
            outcome, detail = WRONG, "an interrupted run left an index"
        elif list((out / STATE).glob("lock")):
            outcome, detail = WRONG, "an interrupted run left its lock behind"
        else:
            rerun = run_cli(args)
            got = tree(out)
            outcome, detail = (
                (RESUMED, "exit 130, then resumed")
                if (rerun.returncode == 0 and got == ref)
                else (WRONG, f"rerun exit {rerun.returncode}: {tree_diff(got, ref)}")
            )
        rows.append(Case("SIGINT (Ctrl-C)", spec.rsplit(":", 1)[0], outcome, detail))
    return rows


def torn_ledger_cases(template: Path, work: Path) -> list[Case]:
    """A crash mid-append leaves a torn last ledger line; the next append must not glue to it."""
    src = copy_source(template, work / "src")
    ref = reference_output(src, work / "ref")
    out = work / "out"
    args = convert_args(src, out, "--workers", "1")
    proc = run_cli(args, env={"KIMI_W31_FAULT_AT": "ledger.appended:4"})
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    ledger = OutputDir(out).ledger_path
    lines = ledger.read_bytes().splitlines(keepends=True)
    torn = b"".join(lines[:-1]) + lines[-1][: len(lines[-1]) // 2]
    ledger.write_bytes(torn)
    # Die again right after the next append: that entry must be readable on the 3rd run.
    proc = run_cli(args, env={"KIMI_W31_FAULT_AT": "ledger.appended:1"})
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    entries = [json.loads(x) for x in ledger.read_text().splitlines()[1:]]  # raises if glued
    rerun = run_cli(args)
    got = tree(out)
    ok = rerun.returncode == 0 and got == ref and len(entries) == 4
    return [
        Case(
            "torn ledger line",
            "torn last line, then killed again, then resumed",
            RESUMED if ok else WRONG,
            "" if ok else f"{len(entries)} entries, exit {rerun.returncode}: {tree_diff(got, ref)}",
        )
    ]
