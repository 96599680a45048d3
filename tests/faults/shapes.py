"""Non-expert tensors of the wrong shape: refused at convert (before any output byte) and by
`verify --source`, with `inventory-shape` naming each tensor as its file spells it.

A tensor is given one wrong dimension (its data cut or padded to match, the shard's offsets
recomputed), so the file is a well-formed safetensors file: only the config says it is wrong.
"""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

from cli_helpers import json_problems, run_cli
from kimi_w31.converter.reasons import Code

from .core import (
    CLEAN,
    CORRECT,
    CRASH,
    INDEX,
    WRONG,
    Case,
    convert_args,
    copy_source,
    looks_like_crash,
    read_shard,
    reference_output,
    shard_bytes,
    tensor_names,
    tree,
)

FAULT = "non-expert tensor of the wrong shape"
_ITEM = {"BF16": 2, "F16": 2, "F32": 4, "U8": 1}


def non_expert_tensors(root: Path) -> dict[str, str]:
    """Every non-expert tensor of a checkpoint -> its shard."""
    index = json.loads((root / INDEX).read_text())
    return {t: f for t, f in index["weight_map"].items() if ".experts." not in t}


def reshape_tensor(root: Path, name: str, rng: random.Random) -> list[int]:
    """Give `name` one wrong dimension (a row or a column more or fewer, or half); rewrite
    its shard with offsets recomputed and the index's total size. Returns the new shape."""
    shard = json.loads((root / INDEX).read_text())["weight_map"][name]
    header, data = read_shard(root / shard)
    entry = header[name]
    shape = list(entry["shape"])
    axis = rng.randrange(len(shape))
    choices = {shape[axis] + 1, shape[axis] - 1, shape[axis] // 2, shape[axis] * 2} - {
        shape[axis],
        0,
    }
    shape[axis] = rng.choice(sorted(choices))
    size = _ITEM[entry["dtype"]]
    for dim in shape:
        size *= dim
    pieces, offset, grown = [], 0, 0
    for t in tensor_names(header):
        begin, end = header[t]["data_offsets"]
        blob = data[begin:end]
        if t == name:
            blob = blob[:size] + bytes(max(0, size - len(blob)))
            grown = len(blob) - (end - begin)
            header[t]["shape"] = shape
        header[t]["data_offsets"] = [offset, offset + len(blob)]
        pieces.append(blob)
        offset += len(blob)
    (root / shard).write_bytes(shard_bytes(header, b"".join(pieces)))
    index = json.loads((root / INDEX).read_text())
    index.setdefault("metadata", {})["total_size"] = index["metadata"].get("total_size", 0) + grown
    (root / INDEX).write_text(json.dumps(index))
    return shape


def respell_moe_layers(root: Path) -> None:
    """Spell every MoE layer's FFN `block_sparse_moe`, as the published checkpoint does (the
    dense layers keep `mlp`): headers and index."""
    index = json.loads((root / INDEX).read_text())
    moe = {
        t.split(".mlp.experts.")[0] + ".mlp." for t in index["weight_map"] if ".mlp.experts." in t
    }

    def spelled(name: str) -> str:
        head = next((h for h in moe if name.startswith(h)), None)
        return name if head is None else name.replace(".mlp.", ".block_sparse_moe.", 1)

    index["weight_map"] = {spelled(t): f for t, f in index["weight_map"].items()}
    (root / INDEX).write_text(json.dumps(index))
    for shard in sorted(set(index["weight_map"].values())):
        header, data = read_shard(root / shard)
        (root / shard).write_bytes(shard_bytes({spelled(t): v for t, v in header.items()}, data))


def _shape_problems(text: str) -> dict[str, dict]:
    return {
        p.get("tensor"): p for p in json_problems(text) if p.get("code") == Code.INVENTORY_SHAPE
    }


def _detail(p: dict) -> str:
    return (
        f"[inventory-shape] {p.get('tensor')}: expected {p.get('expected')}, found {p.get('found')}"
    )


def _convert_case(name: str, src: Path, out: Path, victims: list[str]) -> Case:
    run = run_cli([*convert_args(src, out), "--json"], inprocess=True)
    found = _shape_problems(run.stdout)
    if run.exception is not None or looks_like_crash(run.stdout + run.stderr):
        return Case(FAULT, name, CRASH, " ".join(run.stdout.split())[-300:])
    if run.returncode == 0 or (out / INDEX).exists() or tree(out):
        return Case(
            FAULT, name, WRONG, f"exit {run.returncode}; output written: {sorted(tree(out))}"
        )
    if sorted(found) != sorted(victims):
        return Case(FAULT, name, WRONG, f"inventory-shape named {sorted(found)}, not {victims}")
    return Case(FAULT, name, CLEAN, _detail(found[victims[0]]))


def shape_cases(template: Path, work: Path, seed: int = 0) -> list[Case]:
    rng = random.Random(seed)
    rows = []
    names = sorted(non_expert_tensors(template))
    for count in (1, 3):
        src = copy_source(template, work / f"src{count}")
        victims = rng.sample(names, count)
        for victim in victims:
            reshape_tensor(src, victim, rng)
        rows.append(
            _convert_case(f"convert: {count} wrong tensor(s)", src, work / f"out{count}", victims)
        )
    # Real MoE layers are spelled `block_sparse_moe`: the problem names the file's spelling.
    src = copy_source(template, work / "src-real")
    respell_moe_layers(src)
    router = rng.choice(sorted(t for t in non_expert_tensors(src) if t.endswith(".gate.weight")))
    reshape_tensor(src, router, rng)
    rows.append(
        _convert_case("convert: block_sparse_moe spelling", src, work / "out-real", [router])
    )
    # Negative control: the same tensors, untouched, convert.
    control = work / "out-control"
    run = run_cli([*convert_args(template, control), "--json"], inprocess=True)
    ok = run.returncode == 0 and (control / INDEX).exists()
    rows.append(Case(FAULT, "control: correct shapes convert", CORRECT if ok else WRONG, ""))
    rows.append(_verify_case(template, work, rng))
    return rows


def _verify_case(template: Path, work: Path, rng: random.Random) -> Case:
    """An output made from a wrong source by a converter that did not check (simulated: the
    same change in a good source and its output): `verify --source` refuses it."""
    src, out = copy_source(template, work / "vsrc"), work / "vout"
    reference_output(src, out)
    victim = rng.choice(sorted(non_expert_tensors(src)))
    state = rng.getstate()
    shape = reshape_tensor(src, victim, rng)
    rng.setstate(state)
    if reshape_tensor(out, victim, rng) != shape:
        raise AssertionError("the same change must be made in both")
    run = run_cli(["verify", out, "--source", src, "--json"], inprocess=True)
    found = _shape_problems(run.stdout)
    name = "verify --source: a wrong tensor copied into the output"
    if run.exception is not None or looks_like_crash(run.stdout + run.stderr):
        return Case(FAULT, name, CRASH, " ".join(run.stdout.split())[-300:])
    if run.returncode == 0 or list(found) != [victim]:
        return Case(FAULT, name, WRONG, f"exit {run.returncode}; inventory-shape on {list(found)}")
    shutil.rmtree(out, ignore_errors=True)
    return Case(FAULT, name, CLEAN, _detail(found[victim]))
