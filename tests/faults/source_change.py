"""A source changing under us: mid-run, between runs, a header swap of equal size."""

from __future__ import annotations

import json
import os
import shutil
import signal
import struct
from collections.abc import Callable
from pathlib import Path

from cli_helpers import json_problems, run_cli, start_cli
from kimi_w31.converter.output.directory import OutputDir
from kimi_w31.converter.reasons import Code

from .core import (
    CLEAN,
    CORRECT,
    CRASH,
    INDEX,
    VICTIM,
    WRONG,
    Case,
    convert_args,
    copy_source,
    looks_like_crash,
    reference_output,
    resume_stopped,
    tensor_names,
    tree,
    tree_diff,
)


def _rewrite_data(path: Path) -> None:
    """Same header bytes and size, different tensor bytes (a re-upload of the same layout)."""
    raw = path.read_bytes()
    start = 8 + struct.unpack("<Q", raw[:8])[0]
    flipped = bytes(b ^ 0x01 for b in raw[start : start + 4096])  # low bit: no 0xFF made
    path.write_bytes(raw[:start] + flipped + raw[start + 4096 :])


def _truncate(path: Path) -> None:
    os.truncate(path, path.stat().st_size // 2)


def _replace(path: Path) -> None:
    tmp = path.with_suffix(".new")
    shutil.copyfile(path, tmp)
    _rewrite_data(tmp)
    os.replace(tmp, path)  # a new inode under the old name


def source_change_cases(template: Path, work: Path) -> list[Case]:
    rows = []
    changes = {
        "truncated": _truncate,
        "rewritten in place": _rewrite_data,
        "replaced (new inode)": _replace,
    }
    for i, (name, change) in enumerate(changes.items()):
        case = work / f"mid{i}"
        src = copy_source(template, case / "src")
        out = case / "out"
        args = convert_args(src, out, "--workers", "1")
        old_ident = list(_identity(src / VICTIM))
        running = start_cli([*args, "--json"], stop_at="shard.header:2")
        change(src / VICTIM)
        code, err, stdout = resume_stopped(running)
        text = " ".join(err.split())
        reported = [
            p
            for p in json_problems(stdout)
            if p.get("code") == Code.SOURCE_CHANGED.value and p.get("file") == VICTIM
        ]
        ledger = OutputDir(out).ledger_path
        marked = [json.loads(x) for x in ledger.read_text().splitlines()[1:]]
        # Nothing copied from the changed file may be marked done.
        derived_new = [
            e["shard"]
            for e in marked
            if VICTIM in e["sources"] and e["sources"][VICTIM] != old_ident
        ]
        if looks_like_crash(err) or code != 1:
            rows.append(Case("source changes mid-run", name, CRASH, f"exit {code}: {text[-200:]}"))
            continue
        if not reported or (out / INDEX).exists() or derived_new:
            rows.append(
                Case(
                    "source changes mid-run",
                    name,
                    WRONG,
                    f"index={(out / INDEX).exists()} marked={derived_new} {text[:160]}",
                )
            )
            continue
        # Rerun: nothing copied from the old bytes may be kept.
        outcome, detail = _rerun_matches_fresh(src, out, case / "fresh", args)
        rows.append(
            Case(
                "source changes mid-run",
                name,
                CLEAN if outcome == CORRECT else outcome,
                f"[{reported[0]['code']}] {reported[0]['what'][:80]} / rerun: {detail}",
            )
        )
    # Changed between a crash and the rerun: same header and size, so only the recorded
    # source identity tells the finished shards are stale.
    for case, name, killed, change in (
        ("between", "rewritten after a crash, same size/header", True, _rewrite_data),
        (
            "between-mtime",
            "rewritten in place after a crash, same size, header, inode and mtime",
            True,
            _rewrite_keeping_mtime,
        ),
        (
            "after-complete",
            "rewritten in place under a complete output, mtime restored",
            False,
            _rewrite_keeping_mtime,
        ),
    ):
        rows.append(_changed_between_runs(template, work / case, name, killed, change))
    return rows + header_swap_case(template, work / "swap")


def _changed_between_runs(
    template: Path, case: Path, name: str, killed: bool, change: Callable[[Path], None]
) -> Case:
    """A run killed midway (or a finished one), then the source changed, then a rerun: it
    must redo what came from the change and equal a fresh conversion."""
    src = copy_source(template, case / "src")
    out = case / "out"
    args = convert_args(src, out, "--workers", "1")
    if killed:
        proc = run_cli(args, env={"KIMI_W31_FAULT_AT": "shard.renamed:9"})
        assert proc.returncode == -signal.SIGKILL, proc.stderr
    else:
        assert run_cli(args).returncode == 0
    change(src / VICTIM)
    return Case(
        "source changes between runs", name, *_rerun_matches_fresh(src, out, case / "fresh", args)
    )


def _rewrite_keeping_mtime(path: Path) -> None:
    """Rewritten through the same inode, the modification time put back: only ctime tells."""
    st = path.stat()
    _rewrite_in_place(path)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))


def _rewrite_in_place(path: Path) -> None:
    """Like `_rewrite_data`, but through the same inode (open r+, no new file)."""
    raw = path.read_bytes()
    start = 8 + struct.unpack("<Q", raw[:8])[0]
    with open(path, "r+b") as fh:
        fh.seek(start)
        fh.write(bytes(b ^ 0x01 for b in raw[start : start + 4096]))


def _identity(path: Path) -> tuple[int, int, int, int]:
    st = path.stat()
    return st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino


def _rerun_matches_fresh(src: Path, out: Path, fresh: Path, args: list[str]) -> tuple[str, str]:
    """The rerun either refuses cleanly (a broken source) or equals a fresh conversion."""
    rerun = run_cli(args)
    if rerun.returncode != 0:
        text = " ".join(rerun.stderr.split())
        if looks_like_crash(rerun.stderr) or rerun.returncode != 1:
            return CRASH, text[-200:]
        return CORRECT, "refuses the broken source: " + text[text.find("error:") :][:100]
    want = reference_output(src, fresh)
    got = tree(out)
    if got != want:
        return WRONG, "rerun kept bytes of the old source: " + tree_diff(got, want)
    return CORRECT, "redid every shard copied from it; equals a fresh conversion"


def _swap_equal_tensors(path: Path) -> None:
    """Same size, same tensor names, two equal-sized tensors' offsets exchanged: a different
    checkpoint that a size/mtime check alone cannot tell from the planned one."""
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + n])
    names = tensor_names(header)
    a, b = next(
        (x, y)
        for i, x in enumerate(names)
        for y in names[i + 1 :]
        if header[x]["dtype"] == header[y]["dtype"] and header[x]["shape"] == header[y]["shape"]
    )
    header[a]["data_offsets"], header[b]["data_offsets"] = (
        header[b]["data_offsets"],
        header[a]["data_offsets"],
    )
    body = json.dumps(header, separators=(",", ":")).encode()
    body = body + b" " * (n - len(body))  # keep the header length, so the file size stays
    assert len(body) == n
    path.write_bytes(raw[:8] + body + raw[8 + n :])


def header_swap_case(template: Path, work: Path) -> list[Case]:
    """The source's header changes after planning (same size): never copy with a stale plan."""
    src = copy_source(template, work / "src")
    out = work / "out"
    args = convert_args(src, out, "--workers", "1")
    running = start_cli([*args, "--json"], stop_at="lock.acquired:1")
    _swap_equal_tensors(src / VICTIM)
    code, err, stdout = resume_stopped(running)
    name = "header rewritten between planning and copying"
    if looks_like_crash(err):
        return [Case("source changes mid-run", name, CRASH, err[-200:])]
    if code == 0:
        return [Case("source changes mid-run", name, WRONG, "converted with the stale plan")]
    reported = [
        p
        for p in json_problems(stdout)
        if p.get("code") == Code.SOURCE_CHANGED.value and p.get("file") == VICTIM
    ]
    good = code == 1 and reported and not (out / INDEX).exists()
    return [Case("source changes mid-run", name, CLEAN if good else WRONG, stdout[:200])]
