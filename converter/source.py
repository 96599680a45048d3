"""Resolve a source checkpoint and read everything but its tensor data.

A source is a local directory (sharded with `model.safetensors.index.json`, or a single
`model.safetensors`) or a Hugging Face repo id already in the local cache. The index's
`weight_map` is treated as untrusted input: entries must be plain relative names of
`.safetensors` files that stay inside the source (Hub cache snapshots are symlinks into
`blobs/`, which is fine; a link that escapes the repository is not).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from itertools import repeat
from operator import eq
from pathlib import Path

from .errors import ConvertError, Problem, fail
from .safetensors_format import ShardHeader, read_header

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
CONFIG_NAME = "config.json"


@dataclass
class Source:
    root: Path
    label: str  # what the user typed, for messages
    config: dict
    weight_map: Mapping[str, str]  # tensor -> shard file name (relative)
    shard_files: list[str]  # in index order, each once
    headers: dict[str, ShardHeader] = field(default_factory=dict)
    extra_files: list[str] = field(default_factory=list)  # copied unchanged
    index_metadata: dict = field(default_factory=dict)

    def path(self, rel: str) -> Path:
        return self.root / rel


class HeaderWeightMap(Mapping[str, str]):
    """tensor name -> shard file, answered from the shard headers.

    Once the index is proven to agree with the headers it says nothing they do not, and
    keeping its 500k entries would cost ~110 MB: lookups here are rare (numerics samples).
    """

    def __init__(self, headers: dict[str, ShardHeader]) -> None:
        self._headers = headers

    def __getitem__(self, name: str) -> str:
        for file, header in self._headers.items():
            if name in header.tensors:
                return file
        raise KeyError(name)

    def __iter__(self) -> Iterator[str]:
        for header in self._headers.values():
            yield from header.tensors

    def __len__(self) -> int:
        return sum(len(h.tensors) for h in self._headers.values())


def resolve_source(spec: str, revision: str | None = None) -> Path:
    """A directory, or a repo id resolved offline from the Hugging Face cache."""
    path = Path(spec).expanduser()
    if path.exists():
        if not path.is_dir():
            raise fail("source is not a directory", file=str(path))
        return path.resolve()
    if spec.count("/") == 1 and not spec.startswith((".", "/", "~")):
        try:
            from huggingface_hub import snapshot_download
            from huggingface_hub.errors import LocalEntryNotFoundError

            try:
                local = snapshot_download(spec, revision=revision, local_files_only=True)
            except LocalEntryNotFoundError:
                raise fail(
                    f"'{spec}' is not a local directory and is not in the local Hugging Face "
                    "cache; download it first (`hf download "
                    f"{spec}`) or pass a directory"
                ) from None
        except ImportError:  # pragma: no cover - huggingface_hub is a dependency
            raise fail("huggingface_hub is not installed; pass a local directory") from None
        return Path(local)
    raise fail(
        "source not found: expected a directory with model.safetensors.index.json or "
        "model.safetensors, or a Hugging Face repo id (org/name) in the local cache",
        file=spec,
    )


def _check_shard_name(root: Path, name: object) -> str | None:
    """Why a weight_map entry is unsafe or unusable, or None if it is fine."""
    if not isinstance(name, str) or not name or "\x00" in name:  # NUL: no OS takes it
        return "is not a file name"
    if os.path.isabs(name) or name.startswith(("/", "\\")):
        return "is an absolute path"
    parts = Path(name).parts
    if ".." in parts:
        return "contains '..'"
    if not name.endswith(".safetensors"):
        return "does not name a .safetensors file"
    if not _stays_inside(root, root / name):
        return "points outside the source directory"
    return None


def check_weight_map(root: Path, weight_map: dict, index_name: str) -> list[Problem]:
    """Every entry names a safe shard; each distinct name is checked once (500k tensors
    share a few hundred shard names, and resolving symlinks is a system call per path)."""
    try:
        names = set(weight_map.values())  # a C loop over 500k entries
    except TypeError:  # a list or object as a value: the slow loop words it
        names = None
    if names is not None and not any(_check_shard_name(root, n) for n in names):
        return []
    verdicts: dict[str, str | None] = {}
    problems = []
    for tensor, shard in weight_map.items():
        key = shard if isinstance(shard, str) else repr(shard)
        if key not in verdicts:
            verdicts[key] = _check_shard_name(root, shard)
        if verdicts[key]:
            problems.append(Problem(f"weight_map entry {verdicts[key]}", file=index_name,
                                    tensor=tensor, found=repr(shard)))  # fmt: skip
    return problems


def _stays_inside(root: Path, path: Path) -> bool:
    """Whether `path`, symlinks resolved, is inside the source (or its Hub blob store)."""
    target = path.resolve()
    real_root = root.resolve()
    # Hub snapshots link files into ../../blobs of the same repo cache folder.
    allowed = [real_root]
    if real_root.parent.name == "snapshots":
        allowed.append(real_root.parent.parent / "blobs")
    return any(target == a or a in target.parents for a in allowed)


def read_source(root: Path, label: str | None = None) -> Source:
    """Read config, index and every shard header; collect every problem before failing."""
    label = label or str(root)
    problems: list[Problem] = []
    config = read_json(root / CONFIG_NAME)
    if not isinstance(config, dict):
        raise fail("config.json is not a JSON object", file=str(root / CONFIG_NAME))

    index_path = root / INDEX_NAME
    index_metadata: dict = {}
    if index_path.exists():
        weight_map, index_metadata = _read_index(index_path)
        problems.extend(check_weight_map(root, weight_map, INDEX_NAME))
        if problems:
            raise ConvertError(problems)
        shard_files = list(dict.fromkeys(weight_map.values()))
    elif (root / SINGLE_NAME).exists():
        shard_files = [SINGLE_NAME]
        weight_map = {}
    else:
        raise fail(f"no {INDEX_NAME} or {SINGLE_NAME} in the source directory", file=str(root))

    headers: dict[str, ShardHeader] = {}
    for shard in shard_files:
        path = root / shard
        if not path.exists():
            problems.append(Problem("shard named in the index is missing", file=shard))
            continue
        if not path.is_file():  # a directory, or a FIFO that would block the read forever
            problems.append(Problem("shard is not a regular file", file=shard))
            continue
        try:
            headers[shard] = read_header(path, display_name=shard)
        except ConvertError as exc:
            problems.extend(exc.problems)
    if problems:
        raise ConvertError(problems)

    if weight_map:
        problems.extend(check_index_against_headers(weight_map, headers, INDEX_NAME))
        if problems:
            raise ConvertError(problems)
    del weight_map  # the headers say the same from here on (single file: the header is the map)

    weight_files = set(shard_files) | {INDEX_NAME, CONFIG_NAME}
    extra = sorted(
        str(p.relative_to(root))
        for p in root.rglob("*")
        if p.is_file()
        and str(p.relative_to(root)) not in weight_files
        and not p.name.endswith(".safetensors")
        and not any(part.startswith(".") for part in p.relative_to(root).parts)
    )
    # Extra files are copied into the output: a link to a file elsewhere (a hostile download
    # pointing at ~/.ssh/...) would publish that file with the converted model.
    escaping = [rel for rel in extra if not _stays_inside(root, root / rel)]
    if escaping:
        raise ConvertError(
            [Problem("file is a symlink that points outside the source directory", file=rel)
             for rel in escaping]
        )  # fmt: skip
    return Source(root, label, config, HeaderWeightMap(headers), shard_files, headers, extra,
                  index_metadata)  # fmt: skip


def _read_index(path: Path) -> tuple[dict, dict]:
    """The index's weight_map and metadata (nothing else of it is kept in memory)."""
    index = read_json(path)
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict) or not weight_map:
        raise fail("index has no weight_map object", file=str(path))
    return weight_map, index.get("metadata") or {}


def check_index_against_headers(
    weight_map: dict[str, str], headers: dict[str, ShardHeader], index_name: str
) -> list[Problem]:
    """Each tensor exactly once: in the index and in the shard the index names."""
    # Fast proof, in C loops: if every header tensor maps to its own shard and the counts
    # agree, no name is in two shards and the index holds nothing else.
    if sum(len(h.tensors) for h in headers.values()) == len(weight_map) and all(
        all(map(eq, repeat(shard), map(weight_map.get, h.tensors))) for shard, h in headers.items()
    ):
        return []
    problems: list[Problem] = []
    for tensor, shard in weight_map.items():
        header = headers.get(shard)
        if header is not None and tensor not in header.tensors:
            problems.append(
                Problem("index names a tensor its shard does not hold", file=shard, tensor=tensor)
            )
    for shard, header in headers.items():
        for tensor in header.tensors:
            owner = weight_map.get(tensor)
            if owner is None:
                problems.append(
                    Problem(f"tensor is missing from {index_name}", file=shard, tensor=tensor)
                )
            elif owner != shard:
                problems.append(
                    Problem(
                        "tensor is in a different shard than the index says",
                        file=shard,
                        tensor=tensor,
                        expected=owner,
                        found=shard,
                    )
                )
    return problems


def read_json(path: Path):
    try:
        with open(path, encoding="utf-8") as fh:
            return json.load(fh)
    except FileNotFoundError:
        raise fail("file is missing", file=str(path)) from None
    except (ValueError, RecursionError) as exc:  # bad JSON, bad UTF-8, absurd numbers/nesting
        raise fail(f"not valid JSON ({exc})", file=str(path)) from None
    except OSError as exc:
        raise fail(f"cannot read ({exc.strerror})", file=str(path)) from None
