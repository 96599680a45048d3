"""A full disk: the file-size limit mid-write, the free-space check, --dry-run's space report."""

from __future__ import annotations

import resource
import shutil
from collections.abc import Callable
from pathlib import Path

from cli_helpers import json_problems, run_cli
from kimi_w31.converter.pipeline import ConvertOptions, prepare
from kimi_w31.converter.reasons import Code

from .core import (
    CLEAN,
    CORRECT,
    CRASH,
    INDEX,
    MANIFEST,
    RESUMED,
    SHARD_SIZE,
    WRONG,
    Case,
    convert_args,
    copy_source,
    looks_like_crash,
    reference_output,
    tree,
    tree_diff,
)


def _fsize_limit(limit: int) -> Callable[[], None]:
    def apply() -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    return apply


def disk_full_cases(template: Path, work: Path) -> list[Case]:
    """RLIMIT_FSIZE below the largest shard: EFBIG on write, a clean error, then a resume."""
    src = copy_source(template, work / "src")
    ref = reference_output(src, work / "ref", 2)
    largest = max(v for k, v in _sizes(work / "ref").items() if k.endswith(".safetensors"))
    rows = []
    for workers in (1, 2):
        out = work / f"out{workers}"
        args = convert_args(src, out, "--workers", str(workers))
        proc = run_cli([*args, "--json"], preexec_fn=_fsize_limit(largest - 4096))
        text = " ".join(proc.stderr.split())
        named = [
            p
            for p in json_problems(proc.stdout)
            if p.get("code") == Code.NO_SPACE.value and str(out) in (p.get("file") or "")
        ]
        name = f"file size limit below the largest shard, --workers {workers}"
        if looks_like_crash(proc.stderr) or proc.returncode != 1:
            rows.append(Case("disk full", name, CRASH, f"exit {proc.returncode}: {text[-300:]}"))
            continue
        if (out / INDEX).exists():
            rows.append(Case("disk full", name, WRONG, "index written"))
            continue
        if not named:
            rows.append(Case("disk full", name, CRASH, f"no-space not reported: {proc.stdout}"))
            continue
        rerun = run_cli(args)
        got = tree(out)
        ok = rerun.returncode == 0 and got == ref
        rows.append(
            Case(
                "disk full",
                name,
                RESUMED if ok else WRONG,
                named[0]["file"] if ok else tree_diff(got, ref),
            )
        )
    return rows


def _sizes(root: Path) -> dict[str, int]:
    return {p.name: p.stat().st_size for p in root.iterdir() if p.is_file()}


def free_space_cases(template: Path, work: Path) -> list[Case]:
    """The up-front check: a disk that clearly cannot hold the output is refused early."""
    from unittest import mock

    from kimi_w31.converter.errors import Fatal
    from kimi_w31.converter.pipeline import convert
    from kimi_w31.converter.text import Size

    src = copy_source(template, work / "src")
    out = work / "new" / "out"
    rows = []
    # The dry run asks the same question by the same rule: the same refusal, nothing written.
    for dry_run, name in ((False, "free-space check up front"), (True, "--dry-run refuses too")):
        opts = ConvertOptions(
            source=str(src), out=out, manifest="kimi-k3-any", max_shard_size=300_000
        )
        opts.dry_run = dry_run
        _, _, plan = prepare(opts)
        fake = shutil._ntuple_diskusage(10**9, 10**9 - 1000, 1000)  # type: ignore[attr-defined]
        try:
            with mock.patch("shutil.disk_usage", return_value=fake):
                convert(opts)
        except Fatal as exc:
            p = exc.problems[0]
            # Refused before anything was written, and nothing left that looks like a run;
            # the sizes in people's units and exactly.
            ok = (
                exc.codes == [Code.NO_SPACE]
                and p.expected == f"{Size(plan.output_bytes)} free"
                and p.found == f"{Size(1000)} free"
                and not (work / "new").exists()
            )
            detail = p.render()[:160] if ok else f"{p.render()[:200]}; left: {sorted(tree(work))}"
            rows.append(Case("disk full", name, CLEAN if ok else WRONG, detail))
            continue
        rows.append(Case("disk full", name, WRONG, "went ahead onto a full disk"))
    return rows


def dry_run_space_cases(template: Path, work: Path) -> list[Case]:
    """--dry-run states the space the output will take, in the table and in --json."""
    src = copy_source(template, work / "src")
    ref = work / "ref"
    reference_output(src, ref)
    need = sum(p.stat().st_size for p in ref.glob("*.safetensors"))
    proc = run_cli([src, work / "dry", *MANIFEST, *SHARD_SIZE, "--dry-run", "--json"])
    reported = proc.json.get("output_bytes") if proc.returncode == 0 else None
    checked = proc.returncode == 0 and proc.json.get("space_ok") is True
    checked = checked and proc.json.get("space_needed_bytes") == need
    checked = checked and proc.json.get("free_bytes", 0) > 0
    text = run_cli([src, work / "dry", *MANIFEST, *SHARD_SIZE, "--dry-run"])
    ok = reported == need and "space needed" in text.stdout and not (work / "dry").exists()
    ok = ok and checked
    return [
        Case(
            "disk full",
            "--dry-run reports the space needed",
            CORRECT if ok else WRONG,
            f"output_bytes {reported}, shards on disk {need}",
        )
    ]
