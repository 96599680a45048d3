"""Read a source checkpoint: everything but its tensor data.

`read_source` is the one reading path, whatever the source's origin: a local directory or a
repo in the Hugging Face cache (`local.py`), or a Hub repo read over HTTP (`hub.py`). The
origin gives only what differs, the shard headers and the lists of files; the config, the
index, which shards a loader would open, and every cross-check are read here. The index's
`weight_map` is untrusted input: entries must be plain relative names of `.safetensors`
files inside the source that a loader opens (a shard there may be a symlink to a regular
file anywhere: `local.py` says why). Files are read only through `fsio` (regular files,
never blocking).
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from itertools import repeat
from operator import eq
from pathlib import Path
from typing import Protocol

from .. import fsio
from ..contract import CONFIG_NAME, INDEX_NAME
from ..errors import Fatal, Problem, fatal, problem
from ..reasons import Code
from ..safetensors_format import ShardHeader
from .hub_cache import snapshot_of


@dataclass(frozen=True)
class SourceId:
    """Which source an output is the conversion of.

    `key` says where the source was read from (its real path, or a Hub repo and commit): it is
    machine-local, so only the state folder keeps it as it is; the published checksums file
    keeps `digest`, a hash of it. `name` (a repo id, or the source directory's own name) is
    what the published config records and what a refusal shows.
    """

    name: str
    key: str

    @property
    def digest(self) -> str:
        return hashlib.sha256(
            b"kimi-w31 source\0" + self.key.encode("utf-8", "replace")
        ).hexdigest()


class SourceReader(Protocol):
    """How a found source's files are read: its file list and shard headers."""

    header_workers: int  # headers read at once (1 on disk; network reads overlap)

    def has_file(self, root: Path, name: str) -> bool: ...

    def read_header(self, root: Path, file: str) -> ShardHeader: ...

    def extra_files(self, root: Path, weight_files: set[str]) -> list[str]: ...

    def top_level_names(self, root: Path) -> list[str]: ...


@dataclass(frozen=True)
class Resolved:
    """A source found: the folder its files are (or arrive) in, and how they are read."""

    root: Path
    reader: SourceReader


class Origin(Protocol):
    """Where a source comes from (local disk, the Hub): `resolve` finds it and returns all
    that was learnt on the way; the origin itself keeps nothing."""

    def resolve(self, spec: str, revision: str | None) -> Resolved: ...


@dataclass(frozen=True)
class FetchHooks:
    """What the download of one source file reports while it runs (a remote origin's
    `fetch`): `on_open` once its temporary file exists, `on_bytes` per increment (negative
    when the client rewinds a retry); `stop()` true: end at the next chunk (raise
    `Interrupted`). Hooks left out report nothing."""

    on_open: Callable[[], None] | None = None
    on_bytes: Callable[[int], None] | None = None
    stop: Callable[[], bool] | None = None


@dataclass
class Source:
    root: Path
    label: str  # what the user typed, for messages
    config: dict
    shard_files: list[str]  # in index order, each once
    headers: dict[str, ShardHeader] = field(default_factory=dict)
    extra_files: list[str] = field(default_factory=list)  # copied unchanged
    index_metadata: dict = field(default_factory=dict)
    # The files read whole (config, index) -> their identity when read: what the output
    # derives from them is published only if they are still those files.
    read_identity: dict[str, list[int]] = field(default_factory=dict)
    reader: SourceReader | None = None  # how it was read (None: made by hand, headers only)

    @property
    def weight_map(self) -> Mapping[str, str]:
        return HeaderWeightMap(self.headers)

    @property
    def header_sha256(self) -> dict[str, str]:
        """shard file -> the sha256 of the header the plan is made from."""
        return {f: h.header_sha256 for f, h in self.headers.items()}


class HeaderWeightMap(Mapping[str, str]):
    """tensor name -> shard file, answered from the shard headers.

    Once the index is proven to agree with the headers it says nothing they do not, and
    keeping its 500k entries would cost ~110 MB: lookups here are rare.
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


def read_source(root: Path, label: str, origin: SourceReader) -> Source:
    """Config, index and every shard header, all cross-checked; every problem before failing."""
    read_identity: dict[str, list[int]] = {}
    config = read_json(root / CONFIG_NAME, read_identity)
    if not isinstance(config, dict):
        raise fatal(
            Code.JSON_INVALID,
            rule="config-not-object",
            file=root / CONFIG_NAME,
        )
    index_metadata: dict = {}
    if origin.has_file(root, INDEX_NAME):
        weight_map, index_metadata = read_index(root / INDEX_NAME, read_identity)
        problems = check_weight_map(root, weight_map, INDEX_NAME)
        if problems:
            raise Fatal(problems)
        shard_files = list(dict.fromkeys(weight_map.values()))
    else:
        shard_files, weight_map = files_loaded_without_index(origin.top_level_names(root)), {}
        if not shard_files:
            raise fatal(Code.FILE_MISSING, rule="no-weights", file=root)

    headers: dict[str, ShardHeader] = {}
    problems = []
    # On disk, one after another; over the network, several requests at once.
    with ThreadPoolExecutor(max_workers=origin.header_workers) as pool:
        mapper = pool.map if origin.header_workers > 1 else map
        for f, result in zip(
            shard_files, mapper(_read_or_fail(origin, root), shard_files), strict=True
        ):
            if isinstance(result, Fatal):
                problems.extend(result.problems)
            else:
                headers[f] = result
    if problems:
        raise Fatal(problems)
    problems = (
        check_index_against_headers(weight_map, headers, INDEX_NAME)
        if weight_map
        else check_each_tensor_once(headers)
    )
    if problems:
        raise Fatal(problems)
    del weight_map  # the headers say the same from here on (single file: the header is the map)
    extra = origin.extra_files(root, set(shard_files) | {INDEX_NAME, CONFIG_NAME})
    return Source(
        root,
        label,
        config,
        shard_files,
        headers,
        extra,
        index_metadata,
        reader=origin,
        read_identity=read_identity,
    )


def _read_or_fail(origin: SourceReader, root: Path):
    def read(file: str) -> ShardHeader | Fatal:
        try:
            return origin.read_header(root, file)
        except Fatal as exc:  # collected: every shard's problems are reported together
            return exc

    return read


# -- which files a loader opens ------------------------------------------------------------
#
# SGLang 0.5.23 (model_loader/loader.py `_prepare_weights`, weight_utils.py
# `filter_duplicate_safetensors_files`) globs `<dir>/*.safetensors` (the top level only;
# `*` skips names starting with "."), then keeps the files the index names when there is
# one, or all of them when there is none, except that exactly {…consolidated.safetensors,
# …model.safetensors} loads the second only. The output serves exactly those files' tensors:
# an index entry the glob cannot list (a subfolder, "./x", a hidden name) is refused, and
# without an index every top-level shard is converted. Held to SGLang by
# tests/sglang/test_file_set_differential.py.
WEIGHT_SUFFIX = ".safetensors"


def globbed(name: str) -> bool:
    """Whether SGLang's top-level `*.safetensors` glob lists a file of this name."""
    return name.endswith(WEIGHT_SUFFIX) and not name.startswith(".") and "/" not in name


def files_loaded_without_index(names: list[str]) -> list[str]:
    """The top-level files (given by name) a loader opens when the source has no index."""
    files = sorted(n for n in names if globbed(n))
    if (
        len(files) == 2
        and files[0].endswith("consolidated" + WEIGHT_SUFFIX)
        and files[1].endswith("model" + WEIGHT_SUFFIX)
    ):
        return files[1:]
    return files


def check_each_tensor_once(headers: dict[str, ShardHeader]) -> list[Problem]:
    """Without an index nothing says which shard owns a tensor: a name in two is refused."""
    owner: dict[str, str] = {}
    problems = []
    for shard, header in headers.items():
        for tensor in header.tensors:
            first = owner.setdefault(tensor, shard)
            if first != shard:
                problems.append(
                    problem(Code.TENSOR_IN_TWO_SHARDS, file=shard, tensor=tensor, first=first)
                )
    return problems


def read_index(path: Path, seen: dict[str, list[int]] | None = None) -> tuple[dict, dict]:
    """The index's weight_map and metadata (nothing else of it is kept in memory)."""
    index = read_json(path, seen)
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict) or not weight_map:
        raise fatal(Code.INDEX_INVALID, rule="no-weight-map", file=path)
    metadata = index.get("metadata")
    return weight_map, metadata if isinstance(metadata, dict) else {}


def check_shard_name(root: Path, name: object) -> str | None:
    """Why a weight_map entry is unsafe or unusable, or None if it is fine."""
    if not isinstance(name, str) or not name or "\x00" in name:  # NUL: no OS takes it
        return "is not a file name"
    if os.path.isabs(name) or name.startswith(("/", "\\")):
        return "is an absolute path"
    if ".." in Path(name).parts:
        return "contains '..'"
    if not name.endswith(".safetensors"):
        return "does not name a .safetensors file"
    # Not resolved on purpose: a shard may be a symlink to a regular file anywhere (1.5 TB
    # spread over several disks). Reading it is harmless: its header is checked like any
    # other, and only its tensors, rewritten, are published (`local.LocalOrigin`).
    return None


def check_weight_map(root: Path, weight_map: dict, index_name: str) -> list[Problem]:
    """Every entry names a safe shard; each distinct name is checked once (500k tensors
    share a few hundred shard names)."""
    try:
        names = set(weight_map.values())  # a C loop over 500k entries
    except TypeError:  # a list or object as a value: the slow loop words it
        names = None
    if names is not None and not any(check_shard_name(root, n) for n in names):
        return _not_loaded(names, index_name)
    verdicts: dict[str, str | None] = {}
    problems = []
    for tensor, shard in weight_map.items():
        key = shard if isinstance(shard, str) else repr(shard)
        if key not in verdicts:
            verdicts[key] = check_shard_name(root, shard)
        if verdicts[key]:
            problems.append(
                problem(
                    Code.WEIGHT_MAP_ENTRY_UNSAFE,
                    file=index_name,
                    tensor=tensor,
                    why=verdicts[key],
                    shard=shard,
                )
            )
    safe = {k for k, why in verdicts.items() if why is None}
    return problems + _not_loaded(safe, index_name)


def _not_loaded(names: set[str], index_name: str) -> list[Problem]:
    """Safe entries the loader's glob cannot list: their tensors would never be served.
    One problem for all of them: one cause (shards kept in a folder), said once."""
    hidden = sorted(name for name in names if not globbed(name))
    if not hidden:
        return []
    shown = ", ".join(repr(name) for name in hidden[:3]) + (" ..." if len(hidden) > 3 else "")
    return [
        problem(
            Code.SHARD_NOT_LOADED, rule="index", file=index_name, count=len(hidden), shards=shown
        )
    ]


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
            problems.append(problem(Code.INDEX_TENSOR_NOT_IN_SHARD, file=shard, tensor=tensor))
    for shard, header in headers.items():
        for tensor in header.tensors:
            owner = weight_map.get(tensor)
            if owner is None:
                problems.append(
                    problem(Code.INDEX_TENSOR_MISSING, file=shard, tensor=tensor, index=index_name)
                )
            elif owner != shard:
                problems.append(
                    problem(Code.INDEX_WRONG_SHARD, file=shard, tensor=tensor, owner=owner)
                )
    return problems


def read_json(path: Path, seen: dict[str, list[int]] | None = None):
    """A JSON file, read only if it is a regular file (a FIFO or a link to a device in its
    place would hang the read or never end: `fsio`); its identity when read goes in `seen`
    (by file name)."""
    try:
        data, identity = fsio.read_identified(path)
        if seen is not None:
            seen[path.name] = identity
        return json.loads(data.decode("utf-8"))
    except FileNotFoundError:
        raise fatal(Code.FILE_MISSING, rule="file", file=path) from None
    except fsio.NotRegularFile:
        kind = fsio.describe(path)
        raise fatal(Code.NOT_A_REGULAR_FILE, rule="file", file=path, kind=kind) from None
    except (ValueError, RecursionError) as exc:  # bad JSON, bad UTF-8, absurd numbers/nesting
        raise fatal(Code.JSON_INVALID, rule="not-json", file=path, error=exc) from None
    except OSError as exc:
        raise fatal(Code.FILE_UNREADABLE, rule="read", file=path, error=exc.strerror) from None


def source_id(source: Source, origin: SourceReader | None) -> SourceId:
    """Which source this is: where it was read from (machine-local, kept in the state folder
    and, hashed, in the checksums file) and a name safe to publish (a repo id, or the
    directory's own name: never a path of this machine)."""
    repo = getattr(origin, "repo", None)  # a Hub snapshot, pinned to one commit
    if repo is not None:
        return SourceId(repo.repo_id, f"hub:{repo.repo_id}@{repo.commit}")
    root = source.root.resolve()
    snapshot = snapshot_of(root)  # the Hub cache: models--org--name/snapshots/<commit>
    if snapshot is not None:
        repo_id, commit = snapshot
        return SourceId(repo_id, f"hub:{repo_id}@{commit}")  # as a --download run
    return SourceId(root.name, str(root))
