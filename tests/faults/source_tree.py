"""A hostile index or source tree: unsafe weight_map entries, links, missing or odd files."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path

from kimi_w31.converter.reasons import Code

from .core import (
    INDEX,
    VICTIM,
    C,
    Case,
    hostile_cases,
)


def _index_edit(fn: Callable[[dict], None]):
    def mutate(src: Path) -> None:
        index = json.loads((src / INDEX).read_text())
        fn(index)
        (src / INDEX).write_text(json.dumps(index))

    return mutate


def _first_tensor(index: dict, shard: str = VICTIM) -> str:
    return next(t for t, f in index["weight_map"].items() if f == shard)


def _map_first(value):
    def fn(index: dict) -> None:
        index["weight_map"][_first_tensor(index)] = value

    return fn


def _map_all(value):
    def fn(index: dict) -> None:
        for t, f in index["weight_map"].items():
            if f == VICTIM:
                index["weight_map"][t] = value

    return fn


def _symlink_shard_outside(src: Path) -> None:
    """A shard may link anywhere (shards spread over disks), but only to a regular file."""
    outside = src.parent / "outside.safetensors"
    outside.unlink(missing_ok=True)
    os.mkfifo(outside)
    (src / VICTIM).unlink()
    (src / VICTIM).symlink_to(outside)


def _symlink_extra_outside(src: Path) -> None:
    secret = src.parent / "secret.txt"
    secret.write_text("private key material\n")
    (src / "tokenizer_config.json").unlink()
    (src / "tokenizer_config.json").symlink_to(secret)


def _shard_is_dir(src: Path) -> None:
    (src / VICTIM).unlink()
    (src / VICTIM).mkdir()


def _shard_is_fifo(src: Path) -> None:
    (src / VICTIM).unlink()
    os.mkfifo(src / VICTIM)


def _move_tensor(index: dict) -> None:
    index["weight_map"][_first_tensor(index)] = "model-00001-of-000006.safetensors"


def _drop_tensor(index: dict) -> None:
    del index["weight_map"][_first_tensor(index)]


def _phantom_tensor(index: dict) -> None:
    index["weight_map"]["phantom.weight"] = VICTIM


def _write(name: str, text: str | bytes):
    def mutate(src: Path) -> None:
        data = text.encode() if isinstance(text, str) else text
        (src / name).write_bytes(data)

    return mutate


INDEX_CASES: dict[str, tuple[Callable[[Path], None], Code]] = {
    "weight_map entry absolute": (
        _index_edit(_map_all("/etc/passwd.safetensors")),
        C.WEIGHT_MAP_ENTRY_UNSAFE,
    ),
    "weight_map entry with ..": (
        _index_edit(_map_all("../outside/" + VICTIM)),
        C.WEIGHT_MAP_ENTRY_UNSAFE,
    ),
    "weight_map entry not .safetensors": (
        _index_edit(_map_all("config.json")),
        C.WEIGHT_MAP_ENTRY_UNSAFE,
    ),
    "weight_map entry not a string": (_index_edit(_map_first(17)), C.WEIGHT_MAP_ENTRY_UNSAFE),
    "weight_map entry empty": (_index_edit(_map_first("")), C.WEIGHT_MAP_ENTRY_UNSAFE),
    "weight_map entry with a NUL byte": (
        _index_edit(_map_first("a\x00.safetensors")),
        C.WEIGHT_MAP_ENTRY_UNSAFE,
    ),
    "shard symlink to a FIFO outside the source": (_symlink_shard_outside, C.NOT_A_REGULAR_FILE),
    "extra file symlink escaping the source": (_symlink_extra_outside, C.LINK_ESCAPES),
    "shard named in the index missing": (lambda src: (src / VICTIM).unlink(), C.SHARD_MISSING),
    "shard is a directory": (_shard_is_dir, C.NOT_A_REGULAR_FILE),
    "shard is a FIFO": (_shard_is_fifo, C.NOT_A_REGULAR_FILE),
    "tensor in a different shard than the index says": (
        _index_edit(_move_tensor),
        C.INDEX_WRONG_SHARD,
    ),
    "tensor missing from the index": (_index_edit(_drop_tensor), C.INDEX_TENSOR_MISSING),
    "index names a tensor the shard lacks": (
        _index_edit(_phantom_tensor),
        C.INDEX_TENSOR_NOT_IN_SHARD,
    ),
    "weight_map not an object": (
        _index_edit(lambda i: i.update(weight_map=["a"])),
        C.INDEX_INVALID,
    ),
    "index not JSON": (_write(INDEX, "{not json"), C.JSON_INVALID),
    "index not UTF-8": (_write(INDEX, b'{"weight_map": "\xff"}'), C.JSON_INVALID),
    "index with a 5000-digit number": (
        _write(INDEX, '{"weight_map": {"a": ' + "9" * 5000 + "}}"),
        C.JSON_INVALID,
    ),
    "config not JSON": (_write("config.json", "]"), C.JSON_INVALID),
    "config deeply nested": (_write("config.json", "[" * 100_000 + "]" * 100_000), C.JSON_INVALID),
    "config not an object": (_write("config.json", "[]"), C.JSON_INVALID),
}


def index_cases(template: Path, work: Path) -> list[Case]:
    return hostile_cases(template, work, "hostile index / source tree", INDEX_CASES)
