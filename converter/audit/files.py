"""The files of an output directory, and the checksums file that should name them all.

An output is untrusted input (it may have been copied from anywhere): every name read from
it (index entries, checksums-file keys) is checked to be a plain relative path that stays
inside the directory before anything is opened, and only regular files are ever read, so a
symlink or a FIFO can neither lead a read elsewhere nor block it forever.
"""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

from .. import contract, fsio
from ..contract import CHECKSUMS_FORMAT, CHECKSUMS_NAME
from ..errors import Problem, problem
from ..hashing import TENSOR_HASH
from ..reasons import Code


def list_files(root: Path) -> tuple[list[str], list[Problem], list[str]]:
    """Every file of the checkpoint under `root` (posix relative paths, sorted), every problem
    (anything that is not a regular file: symlink, FIFO, socket, device), and the hidden paths
    left out, never opened: they are not part of a checkpoint (`contract.not_part_of_checkpoint`:
    the state folder, `.git/`, `.cache/huggingface/` an upload leaves, `.gitattributes`)."""
    files, problems, ignored = [], [], []
    for dirpath, dirnames, filenames in os.walk(root, followlinks=False):
        here = Path(dirpath)

        def kept(name: str, here: Path = here) -> bool:
            rel = (here / name).relative_to(root).as_posix()
            if contract.not_part_of_checkpoint(rel):
                ignored.append(rel)
                return False
            return True

        dirnames[:] = [d for d in dirnames if kept(d)]
        filenames = [f for f in filenames if kept(f)]
        links = [d for d in dirnames if (here / d).is_symlink()]
        dirnames[:] = sorted(d for d in dirnames if d not in links)
        for name in [*filenames, *links]:
            path = here / name
            rel = path.relative_to(root).as_posix()
            mode = os.lstat(path).st_mode
            if not stat.S_ISREG(mode):
                kind = fsio.kind(mode)
                problems.append(
                    problem(Code.NOT_A_REGULAR_FILE, rule="output", file=rel, kind=kind)
                )
            else:
                files.append(rel)
    return sorted(files), problems, sorted(ignored)


def unsafe_name(root: Path, name: object) -> str | None:
    """Why a file name read from the output cannot be opened safely, or None."""
    why = contract.file_name_problem(name)
    if why is not None:
        return why
    assert isinstance(name, str)
    # realpath, not Path.resolve: a link loop must be a finding, not an exception
    real_root = Path(os.path.realpath(root))
    if real_root not in Path(os.path.realpath(root / name)).parents:
        return "points outside the output directory"
    return None


def is_regular(path: Path) -> bool:
    """A regular file, not through a symlink (never opens it)."""
    return fsio.is_regular(path, follow=False)


def load_checksums(root: Path, deep: bool = True) -> tuple[dict[str, dict] | None, list[Problem]]:
    """The checksums file's `files` table (safe names only) and every problem with it.

    None when the file is missing or unusable as a whole. `deep=False` skips checking the
    330k recorded tensor checksums one by one (the file list needs only the names).
    """
    path, file = root / CHECKSUMS_NAME, CHECKSUMS_NAME
    if not os.path.lexists(path):
        return None, [problem(Code.CHECKSUMS_INVALID, rule="missing", file=file)]
    if not is_regular(path):
        return None, [problem(Code.CHECKSUMS_INVALID, rule="not-file", file=file)]
    try:
        doc = json.loads(fsio.read_regular(path, follow=False))
    except (OSError, ValueError, RecursionError) as exc:
        return None, [problem(Code.CHECKSUMS_INVALID, rule="not-json", file=file, error=exc)]
    if not isinstance(doc, dict):
        return None, [problem(Code.CHECKSUMS_INVALID, rule="not-object", file=file)]
    if (version := doc.get("format_version")) != CHECKSUMS_FORMAT:
        return None, [problem(Code.CHECKSUMS_INVALID, rule="format", file=file, value=version)]
    if (algorithm := doc.get("tensor_checksum")) != TENSOR_HASH:
        return None, [problem(Code.CHECKSUMS_INVALID, rule="algorithm", file=file, value=algorithm)]
    files = doc.get("files")
    if not isinstance(files, dict):
        return None, [problem(Code.CHECKSUMS_INVALID, rule="no-files", file=file)]
    table, problems = {}, []
    for name, entry in files.items():
        why = unsafe_name(root, name)
        if why is not None:
            problems.append(
                problem(Code.CHECKSUMS_INVALID, rule="name", file=file, why=why, name=name)
            )
        elif not _entry_ok(entry, deep):
            problems.append(
                problem(Code.CHECKSUMS_INVALID, rule="record", file=name, record=_short(entry))
            )
        else:
            table[name] = entry
    return table, problems


def _entry_ok(entry: object, deep: bool) -> bool:
    if not isinstance(entry, dict) or type(entry.get("size")) is not int:
        return False
    if "header_sha256" in entry:  # a shard
        tensors = entry.get("tensors")
        return (
            isinstance(entry["header_sha256"], str)
            and isinstance(tensors, dict)
            and (not deep or all(isinstance(v, str) for v in tensors.values()))
        )
    return isinstance(entry.get("sha256"), str)


def _short(value: object) -> str:
    text = json.dumps(value, default=str)
    return text if len(text) <= 120 else text[:117] + "..."


def check_recorded(root: Path, files: list[str], table: dict[str, dict]) -> list[Problem]:
    """Every file of the output is in the checksums file, and every recorded file is there."""
    present = set(files)
    problems = [
        problem(Code.FILE_UNRECORDED, file=rel)
        for rel in files
        if rel != CHECKSUMS_NAME and rel not in table
    ]
    problems += [
        problem(Code.FILE_MISSING, rule="recorded", file=rel)
        for rel in sorted(table)
        if rel not in present and not os.path.lexists(root / rel)
    ]
    return problems
