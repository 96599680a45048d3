"""Class 8: two tensor names that SGLang folds into one model parameter.

Each of SGLang's folds (the VL wrapper's `language_model.layers.` prefix and
`block_sparse_moe` alias, the `language_model.` it drops, the `weight_packed` -> `weight`
rename) is planted as a second spelling of an existing tensor, with other bytes: the one
SGLang loads last would be served, and re-sharding changes which. `convert` must refuse the
source and `verify` an output holding such a pair, each with `name-collision`.
"""

from __future__ import annotations

import json
from collections.abc import Callable
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
    reference_output,
    shard_bytes,
)

# fold -> (which tensor to double, its second spelling)
ALIASES: dict[str, tuple[Callable[[str], bool], Callable[[str], str]]] = {
    "language_model.layers. spelling": (
        lambda n: n.endswith("layers.0.mlp.down_proj.weight"),
        lambda n: n.replace("language_model.model.layers.", "language_model.layers.", 1),
    ),
    "mlp for block_sparse_moe (an expert)": (
        lambda n: n.endswith("layers.1.block_sparse_moe.experts.0.w2.weight_scale"),
        lambda n: n.replace(".block_sparse_moe.", ".mlp.", 1),
    ),
    "no language_model. prefix": (
        lambda n: n.endswith("layers.0.self_attn.b_proj.weight"),
        lambda n: n.replace("language_model.", "", 1),
    ),
    "weight_packed beside weight": (
        lambda n: n.endswith("layers.0.mlp.down_proj.weight"),
        lambda n: n.replace(".weight", ".weight_packed"),
    ),
}


def plant_alias(root: Path, pick: Callable[[str], bool], spell: Callable[[str], str]) -> str:
    """Add a second spelling of the first tensor `pick` accepts to the last shard, with its
    bytes flipped, and to the index; returns the new name."""
    index = json.loads((root / INDEX).read_text())
    weight_map = index["weight_map"]
    victim = next(n for n in sorted(weight_map) if pick(n))
    header, data = read_shard(root / weight_map[victim])
    begin, end = header[victim]["data_offsets"]
    payload = bytes(b ^ 0x01 for b in data[begin:end])
    alias = spell(victim)
    last = sorted(set(weight_map.values()))[-1]
    h2, d2 = read_shard(root / last)
    h2[alias] = {
        "dtype": header[victim]["dtype"],
        "shape": header[victim]["shape"],
        "data_offsets": [len(d2), len(d2) + len(payload)],
    }
    (root / last).write_bytes(shard_bytes(h2, d2 + payload))
    weight_map[alias] = last
    meta = index.get("metadata") or {}
    if isinstance(meta.get("total_size"), int):
        meta["total_size"] += len(payload)
    (root / INDEX).write_text(json.dumps(index))
    return alias


def _judge(proc, alias: str, must_not_exist: Path | None) -> tuple[str, str]:
    """Refused with `name-collision` naming the alias, or with a cause it follows from
    (its record's `implies`: a layer's experts under two spellings) that is listed while the
    collision is counted."""
    listed = json_problems(proc.stdout)
    hits = [
        p for p in listed if p.get("code") == Code.NAME_COLLISION.value and alias in json.dumps(p)
    ]
    if not hits and f'"{Code.NAME_COLLISION.value}"' in proc.stdout:  # counted, not listed
        hits = [p for p in listed if p.get("code") == Code.LAYER_DUPLICATED.value]
    good = proc.returncode == 1 and hits and (must_not_exist is None or not must_not_exist.exists())
    if looks_like_crash(proc.stderr):
        return CRASH, proc.stderr[-200:]
    return (CLEAN if good else WRONG), (hits[0]["what"][:200] if hits else proc.stdout[-200:])


def alias_cases(template: Path, work: Path) -> list[Case]:
    rows = []
    reference = work / "reference"
    reference_output(template, reference)
    for i, (fold, (pick, spell)) in enumerate(ALIASES.items()):
        src = copy_source(template, work / f"src{i}")
        alias = plant_alias(src, pick, spell)
        out = work / f"out{i}"
        proc = run_cli([*convert_args(src, out), "--json"])
        outcome, detail = _judge(proc, alias, out / INDEX)
        rows.append(Case("two names, one parameter", f"convert: {fold}", outcome, detail))
        # verify: the same pair planted in a finished output
        copy = copy_source(reference, work / f"verify{i}")
        alias = plant_alias(copy, pick, spell)
        proc = run_cli(["verify", str(copy), "--json"])
        outcome, detail = _judge(proc, alias, None)
        rows.append(Case("two names, one parameter", f"verify: {fold}", outcome, detail))
    return rows
