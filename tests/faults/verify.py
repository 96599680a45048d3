"""verify on hostile outputs: each must be a clean error, never a crash or a hang."""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path

from cli_helpers import run_cli

from .core import (
    CLEAN,
    CRASH,
    INDEX,
    WRONG,
    Case,
    codes,
    copy_source,
    looks_like_crash,
    read_shard,
    reference_output,
    tensor_names,
    tree,
)
from .headers import HEADER_CASES
from .source_tree import _index_edit, _write


def _output_victim(out: Path) -> str:
    """The shard of a converted output the verify faults are planted in: the first after the
    first that holds at least two tensors (the header faults edit a second entry)."""
    names = sorted(p.name for p in out.glob("model-*.safetensors"))
    return next(n for n in names[1:] if len(tensor_names(read_shard(out / n)[0])) >= 2)


def verify_hostile_cases(template: Path, work: Path) -> list[Case]:
    """`verify` reads outputs copied from anywhere: each header and index fault planted in a
    converted output must be reported (exit 1, a reason code in `--json`), never crash."""
    src = copy_source(template, work / "src")
    ref = work / "ref"
    reference_output(src, ref)
    victim = _output_victim(ref)
    index_faults = {
        "weight_map entry absolute": "/etc/passwd.safetensors",
        "weight_map entry with ..": "../ref/" + victim,
        "weight_map entry not .safetensors": "config.json",
        "weight_map entry with a NUL byte": "a\x00.safetensors",
        "weight_map entry not a string": 17,
    }
    cases: dict[str, Callable[[Path], None]] = {
        f"header: {n}": (lambda f: lambda out: f(out / victim))(fn)
        for n, (fn, _) in HEADER_CASES.items()
        if n != "tensor the index does not list"
    }
    for n, value in index_faults.items():
        cases[f"index: {n}"] = _index_edit(_map_shard(victim, value))
    cases["index: not JSON"] = _write(INDEX, "{not json")
    cases["index: shard missing"] = lambda out: (out / victim).unlink()
    cases["checksums file not JSON"] = _write("kimi_w31.checksums.json", "[")
    cases["config not JSON"] = _write("config.json", "{")
    rows = []
    for i, (name, mutate) in enumerate(cases.items()):
        out = work / f"v{i}"
        shutil.copytree(ref, out)
        mutate(out)
        before = {k: v for k, v in tree(work).items() if not k.startswith(f"v{i}")}
        run = run_cli(["verify", out, "--checksums", "--json"], inprocess=True)
        code, text, exc = run.returncode, run.stdout, run.exception
        after = {k: v for k, v in tree(work).items() if not k.startswith(f"v{i}")}
        flat = " ".join(text.split())
        found = sorted(c for c in codes(text) if c)
        if exc is not None or looks_like_crash(text):
            outcome, detail = CRASH, f"{type(exc).__name__ if exc else 'traceback'}: {flat[-300:]}"
        elif code != 1 or not found:
            outcome, detail = WRONG, f"exit {code}: {flat[-200:]}"
        elif before != after:
            outcome, detail = WRONG, "verify wrote outside the directory it checks"
        else:
            outcome, detail = CLEAN, ", ".join(found)
        rows.append(Case("verify on a hostile output", name, outcome, detail))
        shutil.rmtree(out, ignore_errors=True)
    return rows


def _map_shard(shard: str, value):
    def fn(index: dict) -> None:
        for t, f in index["weight_map"].items():
            if f == shard:
                index["weight_map"][t] = value

    return fn


def verify_fifo_case(template: Path, work: Path) -> list[Case]:
    """An index entry `../x.safetensors` naming a FIFO beside the output: verify must report
    the entry, not open it (opening a FIFO blocks until someone writes to it)."""
    src = copy_source(template, work / "src")
    out = work / "out"
    reference_output(src, out)
    os.mkfifo(work / "fifo.safetensors")
    _index_edit(_map_shard(_output_victim(out), "../fifo.safetensors"))(out)
    try:
        proc = run_cli(["verify", out], timeout=6)  # a clean run takes < 1 s
    except subprocess.TimeoutExpired:
        return [
            Case(
                "verify on a hostile output",
                "index entry ../ naming a FIFO outside",
                CRASH,
                "hangs: verify opens a file outside the output directory",
            )
        ]
    text = " ".join(proc.stderr.split() + proc.stdout.split())
    outcome = (
        CRASH
        if looks_like_crash(text)
        else CLEAN
        if proc.returncode == 1 and ".." in text
        else WRONG
    )
    return [
        Case(
            "verify on a hostile output",
            "index entry ../ naming a FIFO outside",
            outcome,
            text[-160:],
        )
    ]
