"""Data faults: NaN scales, with and without --check-scales."""

from __future__ import annotations

from pathlib import Path

from cli_helpers import json_problems, run_cli
from kimi_w31.converter.reasons import Code

from .core import (
    CLEAN,
    CRASH,
    INDEX,
    WRONG,
    Case,
    convert_args,
    copy_source,
    looks_like_crash,
    read_shard,
    shard_bytes,
    tensor_names,
)


def _plant_nan(path: Path) -> tuple[str, int]:
    """Set one E8M0 scale byte of a w1 scale tensor to 0xFF.

    Returns that source tensor and the byte's position in it: what a report must name
    (the source file and tensor holding the NaN, never the w31 it is fused into).
    """
    header, data = read_shard(path)
    name = next(t for t in tensor_names(header) if ".w1.weight_scale" in t)
    begin, _ = header[name]["data_offsets"]
    pos = 37
    data = data[: begin + pos] + b"\xff" + data[begin + pos + 1 :]
    path.write_bytes(shard_bytes(header, data))
    return name, pos


def names_the_source(p: dict, file: str, tensor: str, pos: int) -> bool:
    """A NaN-scale problem that names the source file and tensor holding the byte, and its
    position in that tensor."""
    return (
        p.get("code") == Code.SCALE_NAN.value
        and p.get("file") == file
        and p.get("tensor") == tensor
        and f"first at byte {pos} of the tensor" in p.get("what", "")
    )


def data_fault_cases(template: Path, work: Path) -> list[Case]:
    src = copy_source(template, work / "src")
    victim = next(
        p
        for p in sorted(src.glob("*.safetensors"))
        if any(".w1.weight_scale" in t for t in tensor_names(read_shard(p)[0]))
    )
    tensor, pos = _plant_nan(victim)
    out = work / "out"
    args = convert_args(src, out, "--workers", "2", "--check-scales")
    rows = []
    for name in ("--check-scales", "--check-scales again (not hidden by resume)"):
        proc = run_cli([*args, "--json"])
        hits = [
            p for p in json_problems(proc.stdout) if names_the_source(p, victim.name, tensor, pos)
        ]
        good = proc.returncode == 1 and hits and not (out / INDEX).exists()
        outcome = CRASH if looks_like_crash(proc.stderr) else CLEAN if good else WRONG
        rows.append(
            Case(
                "NaN scale (0xFF)",
                name,
                outcome,
                hits[0]["what"][:200] if hits else proc.stdout[-200:],
            )
        )
    # Without the flag too: E8M0 expert scales are always scanned (the library scenario plants NaN
    # in a finished output for verify).
    proc = run_cli([*convert_args(src, out, "--workers", "2"), "--json"])
    hits = [p for p in json_problems(proc.stdout) if names_the_source(p, victim.name, tensor, pos)]
    good = proc.returncode == 1 and hits and not (out / INDEX).exists()
    outcome = CRASH if looks_like_crash(proc.stderr) else CLEAN if good else WRONG
    detail = hits[0]["what"][:200] if hits else proc.stdout[-200:]
    rows.append(Case("NaN scale (0xFF)", "by default (no --check-scales)", outcome, detail))
    return rows
