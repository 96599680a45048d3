"""What a run publishes is proven when it publishes it, to the standard of this run.

- a source file the output derives from (config, index, a copied file, a shard written or
  kept) changed during the run: refused at publish (`source-changed`), never the old bytes;
- a rerun on an earlier output judges scales as a fresh run would (`--check-scales`);
- a NaN scale is named by the source file and tensor that hold it;
- `--force` deletes only recorded files, and a folder only once empty.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path

from cli_helpers import json_problems, run_cli, start_cli
from kimi_w31.converter.reasons import Code

from .core import (
    CLEAN,
    CORRECT,
    CRASH,
    INDEX,
    MANIFEST,
    VICTIM,
    WRONG,
    Case,
    convert_args,
    copy_source,
    looks_like_crash,
    read_shard,
    reference_output,
    resume_stopped,
    shard_bytes,
    tree,
    tree_diff,
)

FAULT = "published as proven"


def _edit_config(src: Path) -> None:
    config = json.loads((src / "config.json").read_text())
    config["kimi_w31_test_edit"] = 1
    (src / "config.json").write_text(json.dumps(config))


def _edit_keeping_mtime(name: str) -> Callable[[Path], None]:
    def edit(src: Path) -> None:
        path = src / name
        st = path.stat()
        data = path.read_bytes()
        at = data.find(b" ")  # a space becomes a tab: JSON stays JSON, the bytes differ
        with open(path, "r+b") as fh:  # same inode, same size: only ctime tells
            fh.seek(max(at, 0))
            fh.write(b"\t" if at >= 0 else data[:1].swapcase())
        os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))

    return edit


def _reindent_index(src: Path) -> None:
    index = json.loads((src / INDEX).read_text())
    (src / INDEX).write_text(json.dumps(index, indent=1))


def _replace_shard(src: Path) -> None:
    tmp = src / (VICTIM + ".new")
    shutil.copyfile(src / VICTIM, tmp)
    os.replace(tmp, src / VICTIM)  # the same bytes under a new inode: another file


def _verdict(case: str, name: str, code: int, stdout: str, err: str, out: Path, file: str):
    """A run stopped mid-way while `file` changed: a clean `source-changed` naming it, and
    no complete-looking output made from what was read before."""
    if looks_like_crash(err) or code not in (0, 1):
        return Case(FAULT, name, CRASH, f"exit {code}: {' '.join(err.split())[-200:]}")
    hits = [
        p
        for p in json_problems(stdout)
        if p.get("code") == Code.SOURCE_CHANGED.value and p.get("file") == file
    ]
    if code == 0 or not hits:
        return Case(FAULT, name, WRONG, f"exit {code}: published what was read before {file}")
    return Case(FAULT, name, CLEAN, f"[{hits[0]['code']}] {hits[0]['what'][:100]}")


def _rerun_is_fresh(src: Path, out: Path, fresh: Path, args: list) -> str | None:
    """After the refusal, a rerun gives a fresh run's output and its own verify passes."""
    rerun = run_cli(args)
    if rerun.returncode != 0:
        return f"rerun exit {rerun.returncode}: {rerun.stderr[-160:]}"
    want = reference_output(src, fresh)
    if tree(out) != want:
        return "rerun differs from a fresh run: " + tree_diff(tree(out), want)
    check = run_cli(["verify", out, "--source", src, "-q"])
    return None if check.returncode == 0 else f"verify --source: {check.stderr[-160:]}"


def change_during_run_cases(template: Path, work: Path) -> list[Case]:
    """Each source file the output derives from, changed while the run is in flight (a
    fresh run between two shards; a rerun of a finished output after its shards were
    proven and kept): refused at publish; the rerun then equals a fresh run."""
    rows = []
    changes = [
        ("config.json edited while shards are written", "shard.header:2", _edit_config, ""),
        (
            "config.json rewritten in place, mtime restored, while shards are written",
            "shard.header:2",
            _edit_keeping_mtime("config.json"),
            "",
        ),
        ("index re-indented while shards are written", "shard.header:2", _reindent_index, ""),
        (
            "README.md edited in place, mtime restored, during a rerun (already copied)",
            "shards.settled:1",
            _edit_keeping_mtime("README.md"),
            "finished",
        ),
        (
            "config.json edited during a rerun of a finished output",
            "shards.settled:1",
            _edit_config,
            "finished",
        ),
        (
            "source shard replaced after a rerun proved the kept shards",
            "shards.settled:1",
            _replace_shard,
            "finished",
        ),
    ]
    files = {
        _edit_config: "config.json",
        _reindent_index: INDEX,
        _replace_shard: VICTIM,
    }
    for i, (name, stop_at, change, first) in enumerate(changes):
        case = work / f"change{i}"
        src = copy_source(template, case / "src")
        out = case / "out"
        args = convert_args(src, out, "--workers", "1")
        if first and run_cli(args).returncode != 0:
            rows.append(Case(FAULT, name, CRASH, "the first run failed"))
            continue
        running = start_cli([*args, "--json"], stop_at=stop_at)
        change(src)
        code, err, stdout = resume_stopped(running)
        file = files.get(change) or ("config.json" if "config" in name else "README.md")
        row = _verdict(f"change{i}", name, code, stdout, err, out, file)
        if row.outcome == CLEAN:
            problem = _rerun_is_fresh(src, out, case / "fresh", args)
            if problem is not None:
                row = Case(FAULT, name, WRONG, problem)
            else:
                row.detail += " / rerun equals a fresh run, verify --source passes"
        rows.append(row)
    return rows


DENSE_SCALE = "language_model.model.norm.weight_scale"


def _with_dense_nan(src: Path) -> None:
    """A non-expert U8 scale holding a NaN byte: only --check-scales scans it."""
    header, data = read_shard(src / VICTIM)
    header[DENSE_SCALE] = {
        "dtype": "U8",
        "shape": [64],
        "data_offsets": [len(data), len(data) + 64],
    }
    (src / VICTIM).write_bytes(shard_bytes(header, data + b"\x00" * 7 + b"\xff" + b"\x00" * 56))
    index = json.loads((src / INDEX).read_text())
    index["weight_map"][DENSE_SCALE] = VICTIM
    index["metadata"]["total_size"] += 64
    (src / INDEX).write_text(json.dumps(index))


def kept_scale_cases(template: Path, work: Path) -> list[Case]:
    """An output converted without --check-scales, rerun with it: refused as a fresh run
    with it is, naming the source file and tensor (with --rehash too)."""
    rows = []
    for i, extra in enumerate(([], ["--rehash"])):
        name = " ".join(["rerun --check-scales", *extra, "on an output converted without it"])
        case = work / f"kept{i}"
        src = copy_source(template, case / "src")
        _with_dense_nan(src)
        out = case / "out"
        first = run_cli(convert_args(src, out))
        rerun = run_cli([*convert_args(src, out, "--check-scales", *extra), "--json"])
        fresh = run_cli([*convert_args(src, case / "fresh", "--check-scales"), "--json"])
        crashed = looks_like_crash(first.stderr + rerun.stderr + fresh.stderr)
        hits = [
            p
            for p in json_problems(rerun.stdout)
            if p.get("code") == Code.SCALE_NAN.value
            and p.get("file") == VICTIM
            and p.get("tensor") == DENSE_SCALE
            and "first at byte 7 of the tensor" in p.get("what", "")
        ]
        same = rerun.returncode == fresh.returncode == 1 and first.returncode == 0
        if crashed:
            rows.append(Case(FAULT, name, CRASH, (rerun.stderr or fresh.stderr)[-200:]))
        elif not (same and hits) or (out / INDEX).exists():
            rows.append(Case(FAULT, name, WRONG, f"exit {rerun.returncode}: {rerun.stdout[:160]}"))
        else:
            rows.append(Case(FAULT, name, CLEAN, f"[scale-nan] {hits[0]['what'][:120]}"))
    return rows


def force_hidden_case(template: Path, work: Path) -> list[Case]:
    """--force over an earlier conversion whose folders hold hidden files someone else put
    there: the recorded files go, the hidden ones (and their folders) stay."""
    src = copy_source(template, work / "src")
    (src / "assets").mkdir(exist_ok=True)  # synth ships assets/ as published
    (src / "assets" / "notes.txt").write_text("a file of the model\n")
    out = work / "out"
    reference_output(src, out)
    planted = {"assets/.keep": "someone else's\n", "assets/.cache/x": "theirs\n"}
    for rel, text in planted.items():
        (out / rel).parent.mkdir(parents=True, exist_ok=True)
        (out / rel).write_text(text)
    other = copy_source(template, work / "other")  # another source: --force replaces
    forced = run_cli([other, out, *MANIFEST, "--max-shard-size", "500KB", "-q", "--force"])
    kept = all((out / rel).is_file() and (out / rel).read_text() == t for rel, t in planted.items())
    gone = not (out / "assets" / "notes.txt").exists()
    name = "--force over an output whose folder holds hidden files of another"
    if looks_like_crash(forced.stderr):
        return [Case(FAULT, name, CRASH, forced.stderr[-200:])]
    if forced.returncode != 0 or not kept or not gone:
        return [Case(FAULT, name, WRONG, f"exit {forced.returncode} kept={kept} gone={gone}")]
    return [Case(FAULT, name, CORRECT, "recorded files removed; the hidden files stay")]


def publish_proof_cases(template: Path, work: Path) -> list[Case]:
    return [
        *change_during_run_cases(template, work / "change"),
        *kept_scale_cases(template, work / "scales"),
        *force_hidden_case(template, work / "force"),
    ]
