"""A source on local disk: a directory, or a repo id already in the Hugging Face cache.

Links, one policy: a shard may be a symlink to a regular file anywhere (1.5 TB spread over
several disks): reading it is harmless, its header is checked like any other and only its
rewritten tensors are published. Any other file is published only when it is a regular
file, or a link to what would be published directly: another published file of the source,
or a blob of the same Hugging Face cache repo (a snapshot is all links into `../../blobs/`).
Everything else is refused once per file, with a hint (`publish_problem`).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from .. import contract, fsio
from ..contract import CHECKSUMS_NAME, INDEX_NAME
from ..errors import Fatal, Problem, fatal, problem
from ..reasons import Code
from ..safetensors_format import ShardHeader, read_header
from . import Resolved


def resolve_local(spec: str, revision: str | None = None) -> Path:
    """A directory, or a repo id resolved offline from the Hugging Face cache."""
    path = Path(spec).expanduser()
    if path.exists():
        if revision is not None:
            raise fatal(Code.USAGE, rule="revision-local", file=path.resolve(), revision=revision)
        if not path.is_dir():
            raise fatal(Code.SOURCE_NOT_FOUND, rule="not-directory", file=path)
        return path.resolve()
    if spec.count("/") == 1 and not spec.startswith((".", "/", "~")):
        from huggingface_hub import snapshot_download
        from huggingface_hub.errors import LocalEntryNotFoundError

        where, command = spec, spec
        if revision:
            where, command = f"{spec}@{revision}", f"{spec} --revision {revision}"
        try:
            snapshot = Path(snapshot_download(spec, revision=revision, local_files_only=True))
        except LocalEntryNotFoundError:
            raise fatal(Code.SOURCE_NOT_IN_CACHE, where=where, command=command) from None
        _check_snapshot_complete(snapshot, command)
        return snapshot
    raise fatal(Code.SOURCE_NOT_FOUND, rule="spec", file=spec)


def _check_snapshot_complete(snapshot: Path, command: str) -> None:
    """A cache snapshot whose index names shards that are not there is a download that did
    not finish: said as that, with the snapshot's path and the command that finishes it
    (not as a shard of a directory the user never named)."""
    try:
        weight_map = json.loads((snapshot / INDEX_NAME).read_text()).get("weight_map")
    except (OSError, ValueError, AttributeError):
        return  # no readable index: reading the source says what is wrong with it
    if not isinstance(weight_map, dict):
        return
    shards = sorted({v for v in weight_map.values() if isinstance(v, str)})
    missing = [f for f in shards if not (snapshot / f).exists()]
    if missing:
        raise fatal(
            Code.SHARD_MISSING,
            rule="cache",
            file=missing[0],
            snapshot=snapshot,
            missing=len(missing),
            total=len(shards),
            command=command,
        )


class LocalOrigin:
    """Headers and file list straight from the source directory."""

    header_workers = 1

    def resolve(self, spec: str, revision: str | None) -> Resolved:
        return Resolved(resolve_local(spec, revision), self)  # on disk: nothing more to learn

    def has_file(self, root: Path, name: str) -> bool:
        return os.path.lexists(root / name)  # a dangling link is there: reading it says so

    def read_header(self, root: Path, file: str) -> ShardHeader:
        path = root / file
        if not os.path.lexists(path):
            raise fatal(Code.SHARD_MISSING, rule="local", file=file)
        # A shard may be a symlink (shards spread over disks); its target must be a regular
        # file: a FIFO would block the read forever, a device would never end.
        if not fsio.is_regular(path):
            if not path.exists():
                raise fatal(
                    Code.SHARD_MISSING, rule="dangling", file=file, kind=fsio.describe(path)
                )
            raise fatal(Code.NOT_A_REGULAR_FILE, rule="shard", file=file, kind=fsio.describe(path))
        return read_header(path, display_name=file)

    def top_level_names(self, root: Path) -> list[str]:
        """Every name directly in the source directory (what a loader's glob sees)."""
        try:
            return sorted(os.listdir(root))
        except OSError as exc:
            raise fatal(Code.FILE_UNREADABLE, rule="list", file=root, error=exc.strerror) from None

    def extra_files(self, root: Path, weight_files: set[str]) -> list[str]:
        """Every other file (tokenizer, chat template, custom code, ...), copied unchanged.

        Hidden paths are skipped, and so is a checksums file of ours: it describes some other
        output and would make this one fail its own verify. What is published must be what
        `publish_problem` allows: one problem per file refused, all of them at once.
        """
        extra, problems = [], []
        files, loops = _files(root)
        for path in loops:
            rel = path.relative_to(root).as_posix()
            if published_directly(rel):
                problems.append(
                    problem(
                        Code.LINK_ESCAPES, rule="publish-loop", file=rel, kind=fsio.describe(path)
                    )
                )
        for path in files:
            rel = path.relative_to(root).as_posix()
            if rel in weight_files or not published_directly(rel):
                continue
            refused = publish_problem(root, rel)
            if refused is not None:
                problems.append(refused)
            else:
                extra.append(rel)
        if problems:
            named = any(p.code is Code.FILE_NAME_INVALID for p in problems)
            linked = any(p.code is not Code.FILE_NAME_INVALID for p in problems)
            raise Fatal(problems, hint="; ".join([NAME_HINT] * named + [LINK_HINT] * linked))
        return sorted(extra)


LINK_HINT = (
    "a checkpoint publishes regular files: replace each link named with a copy of a file "
    "that belongs with the model (cp -L), or remove it; linked *.safetensors shards are fine"
)
NAME_HINT = "rename each file named (or move it out of the source): its name cannot be published"


def published_directly(rel: str) -> bool:
    """Whether a regular file at `rel` in the source is one of the other files copied into the
    output (not a weight file, not hidden, not a checksums file of ours)."""
    parts = rel.split("/")
    return (
        not rel.endswith(".safetensors")
        and rel != CHECKSUMS_NAME
        and not any(part.startswith(".") for part in parts)
    )


def publish_problem(root: Path, rel: str) -> Problem | None:
    """Why the source's file `rel` may not be published, or None.

    The one rule for links among the other files: never publish through a link what would
    not be published directly. A link is followed only to a regular file that is itself one
    of the source's published files (inside the source, not hidden), or, for a Hugging Face
    cache snapshot, to a blob of the same repo (the cache keeps every file that way). Anything
    that is not a regular file (FIFO, socket, device, dangling link) is refused too: silently
    skipping it would drop a file of the model.
    """
    path = root / rel
    name_problem = contract.file_name_problem(rel)
    if name_problem is not None:
        return problem(Code.FILE_NAME_INVALID, file=rel, why=name_problem)
    if not fsio.is_regular(path):
        return problem(Code.NOT_A_REGULAR_FILE, rule="publish", file=rel, kind=fsio.describe(path))
    if not _through_link(root, rel):
        return None
    real_root = root.resolve()
    target = path.resolve()
    if real_root.parent.name == "snapshots" and target.parent == real_root.parent.parent / "blobs":
        return None  # the Hub cache: snapshots/<rev>/<file> -> ../../blobs/<sha>
    inside = real_root in target.parents
    if inside and published_directly(target.relative_to(real_root).as_posix()):
        return None
    if inside:
        return problem(Code.LINK_ESCAPES, rule="publish-inside", file=rel, kind=fsio.describe(path))
    return problem(Code.LINK_ESCAPES, rule="publish-outside", file=rel, kind=fsio.describe(path))


def _through_link(root: Path, rel: str) -> bool:
    """Whether `root/rel` is reached through a symlink (the file or a folder on the way)."""
    path = root
    for part in rel.split("/"):
        path = path / part
        if os.path.islink(path):
            return True
    return False


def _files(root: Path) -> tuple[list[Path], list[Path]]:
    """Every path under `root` that is not a directory, hidden folders not entered, and the
    folder links that lead back to a folder holding them. A linked folder is entered under
    each of its names, as a loader or a copy would see it (`sub/` and `alias -> sub` publish
    `sub/x` and `alias/x`), so the rule for links judges every name its files are reached
    by; a link to a folder on its own path (a loop) would make names without end, and is
    returned instead of entered."""
    files: list[Path] = []
    loops: list[Path] = []
    stack: list[tuple[Path, tuple[str, ...]]] = [(root, ())]
    while stack:
        folder, above = stack.pop()
        real = os.path.realpath(folder)
        if real in above:
            loops.append(folder)
            continue
        try:
            entries = list(os.scandir(folder))
        except OSError:
            continue
        for entry in entries:
            path = Path(entry.path)
            try:
                is_dir = entry.is_dir()  # follows a link: a linked folder is entered
            except OSError:
                is_dir = False
            if is_dir:
                if not entry.name.startswith("."):
                    stack.append((path, (*above, real)))
            else:
                files.append(path)
    return files, loops
