"""Paths that must simply work: symlinked directories, --force, a Hub cache source, a umask."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from cli_helpers import run_cli
from kimi_w31.converter.reasons import Code

from .core import (
    CLEAN,
    CORRECT,
    CRASH,
    INDEX,
    MANIFEST,
    STATE,
    WRONG,
    Case,
    _first_problem,
    codes,
    convert_args,
    copy_source,
    looks_like_crash,
    reference_output,
    tree,
    tree_diff,
)


def path_cases(template: Path, work: Path) -> list[Case]:
    rows = []
    src = copy_source(template, work / "src")
    (work / "link").symlink_to(src / "linked-out")
    for name, out in [
        ("output equal to the source", src),
        ("output inside the source", src / "converted"),
        ("output through a symlink into the source", work / "link"),
    ]:
        before = tree(work)
        proc = run_cli(convert_args(src, out, "--json"))
        good = (
            proc.returncode in (1, 2)
            and tree(work) == before
            and codes(proc.stdout) == {Code.OUTPUT_INSIDE_SOURCE.value}
        )
        outcome = CRASH if looks_like_crash(proc.stderr) else CLEAN if good else WRONG
        rows.append(Case("paths", name, outcome, _first_problem(proc.stdout)))
    rows += [
        _force_case(template, work / "force"),
        _hub_cache_case(template, work / "hub"),
        _umask_case(template, work / "umask"),
        _symlinked_dir_case(template, work / "sl"),
    ]
    return rows


def _symlinked_dir_case(template: Path, work: Path) -> Case:
    """A folder of OUT that is a symlink elsewhere must not carry writes out of OUT."""
    src = copy_source(template, work / "src")
    (src / "sub").mkdir()
    (src / "sub" / "notes.txt").write_text("an extra file in a subdirectory\n")
    elsewhere = work / "elsewhere"
    elsewhere.mkdir()
    out = work / "out"
    out.mkdir()
    (out / "sub").symlink_to(elsewhere, target_is_directory=True)
    proc = run_cli(convert_args(src, out, "--force", "--json"))
    good = (
        proc.returncode == 1
        and not any(elsewhere.iterdir())
        and not (out / INDEX).exists()
        and codes(proc.stdout) == {Code.FOREIGN_OUTPUT.value}
        and (out / "sub").is_symlink()
    )
    outcome = CRASH if looks_like_crash(proc.stderr) else CLEAN if good else WRONG
    return Case(
        "paths",
        "a folder of the output is a symlink elsewhere",
        outcome,
        _first_problem(proc.stdout),
    )


def _force_case(template: Path, work: Path) -> Case:
    """--force over a previous, different conversion: replaces it when every file there is
    one the tool recorded writing; refuses, deleting nothing, when anything else is there."""
    src = copy_source(template, work / "src")
    out = work / "out"
    reference_output(src, out)  # 300KB shards
    args = [src, out, *MANIFEST, "--max-shard-size", "500KB", "-q", "--workers", "1", "--json"]
    refused = run_cli(args)  # another plan: refused without --force
    replaced = run_cli([*args, "--force"])
    want = reference_output(src, work / "fresh500", 1, "--max-shard-size", "500KB")
    ok_replace = (
        codes(refused.stdout) == {Code.OUTPUT_NOT_EMPTY.value}
        and replaced.returncode == 0
        and tree(out) == want
    )
    # Now plant files the tool never wrote, and a tampered record pointing out of OUT.
    outside = work / "keep-me.txt"
    outside.write_text("not yours\n")
    planted = {
        "notes.txt": "mine\n",
        "model-best.safetensors": "a user's own file\n",
        "sub/data.bin": "mine too\n",
    }
    for rel, text in planted.items():
        (out / rel).parent.mkdir(exist_ok=True)
        (out / rel).write_text(text)
    (out / "linked.json").symlink_to(outside)
    sums = json.loads((out / "kimi_w31.checksums.json").read_text())
    sums["files"]["../keep-me.txt"] = {"size": 10}
    sums["files"][str(outside)] = {"size": 10}
    (out / "kimi_w31.checksums.json").write_text(json.dumps(sums))
    before = tree(out)
    forced = run_cli([*args[:4], "--max-shard-size", "300KB", "-q", "--json", "--force"])
    ok_refuse = (
        forced.returncode == 1
        and codes(forced.stdout) == {Code.FOREIGN_OUTPUT.value}
        and tree(out) == before
        and outside.read_text() == "not yours\n"
    )
    ok = ok_replace and ok_refuse
    return Case(
        "paths",
        "--force replaces only what it recorded writing; refuses otherwise",
        CORRECT if ok else WRONG,
        ""
        if ok
        else f"replace={ok_replace} refuse={ok_refuse}: "
        f"{refused.stdout[-100:]} {replaced.stderr[-100:]} {forced.stdout[-200:]} "
        f"{tree_diff(tree(out), before)}",
    )


def hub_cache(template: Path, hub: Path, repo: str = "org/name", rev: str = "0" * 40) -> None:
    """The Hub cache layout: snapshots/<rev>/<file> are relative symlinks into blobs/."""
    folder = hub / ("models--" + repo.replace("/", "--"))
    (folder / "blobs").mkdir(parents=True)
    (folder / "refs").mkdir()
    (folder / "refs" / "main").write_text(rev)
    snap = folder / "snapshots" / rev
    for p in sorted(template.rglob("*")):
        if not p.is_file():
            continue
        rel = p.relative_to(template)
        data = p.read_bytes()
        blob = hashlib.sha256(data).hexdigest()
        (folder / "blobs" / blob).write_bytes(data)
        link = snap / rel
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(folder / "blobs" / blob, link.parent))


def _hub_cache_case(template: Path, work: Path) -> Case:
    hub = work / "hub"
    hub_cache(template, hub)
    ref = work / "ref"
    reference_output(template, ref)
    out = work / "out"
    env = {"HF_HUB_CACHE": str(hub), "HF_HUB_OFFLINE": "1"}
    proc = run_cli(convert_args("org/name", out), env=env)
    verify = run_cli(["verify", out, "--checksums", "-q"])
    # config.json and the checksums file record the source label, which differs by design.
    label_free = ("config.json", "kimi_w31.checksums.json")
    got = {k: v for k, v in tree(out).items() if k not in label_free and k.split("/")[0] != STATE}
    want = {k: v for k, v in tree(ref).items() if k not in label_free}
    # the passing verify recorded what it proved, and nothing else
    recorded = sorted(k for k in tree(out) if k.split("/")[0] == STATE)
    ok = (
        proc.returncode == 0
        and verify.returncode == 0
        and got == want
        and recorded == [STATE, f"{STATE}/verified.json"]
    )
    return Case(
        "paths",
        "Hugging Face cache snapshot (symlinks into blobs/) by repo id",
        CORRECT if ok else WRONG,
        ""
        if ok
        else f"exit {proc.returncode}/{verify.returncode}: "
        f"{proc.stderr[-200:]} {tree_diff(got, want)}",
    )


def _umask_case(template: Path, work: Path) -> Case:
    src = copy_source(template, work / "src")
    (src / "sub").mkdir()
    (src / "sub" / "notes.txt").write_text("an extra file in a subdirectory\n")
    out = work / "new" / "out"
    proc = run_cli(convert_args(src, out), preexec_fn=lambda: os.umask(0o077))
    modes = {
        str(p.relative_to(work)): p.stat().st_mode & 0o777
        for p in [work / "new", out, *out.rglob("*")]
    }
    wrong = {k: oct(m) for k, m in modes.items() if m != (0o755 if (work / k).is_dir() else 0o644)}
    ok = proc.returncode == 0 and not wrong and len(modes) > 10
    return Case(
        "paths",
        "permissions under umask 077 (files 0644, dirs 0755)",
        CORRECT if ok else WRONG,
        "" if ok else f"{proc.stderr[-200:]} {wrong}",
    )
