"""What `verify` proved, kept beside the checkpoint, and the check a server makes against it.

A passing `verify --checksums` read every byte of the checkpoint; it records, in the output's
state folder, the levels it ran and the identity (`records.file_identity`: size, mtime,
ctime, inode, device) of every file of the checkpoint, taken before it read them and found the
same after. A failing verify removes the record. A server loading the checkpoint stats the
same files (no byte read: seconds for hundreds of shards) and refuses any difference: a file
changed, added or removed since, or a copy (another inode or device) that was never
verified where it stands.

One record may hold several proofs, one per filesystem view (the device of the checkpoint's
folder): a shared filesystem mounted under another device number on another node is
verified there too, without undoing the first node's proof.

SGLang-free: the adapter reads it through `served_refusal`; `verify` writes it through
`settle`. Nothing here imports the planner, the executors or the audit.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from .. import contract, fsio
from ..contract import STATE_DIR
from ..errors import Fatal, Problem, fatal, message, problem
from ..reasons import Code
from .records import FileIdentity, file_identity

RECORD_NAME = "verified.json"
RECORD_FORMAT = 1
REQUIRED_LEVEL = "checksums"  # what a server asks for: every byte was read and matched
SKIP_ENV = "KIMI_W31_SKIP_VERIFIED_CHECK"  # "1": serve without the check (logged loudly)
MAX_LISTED = 20  # changed files named in one refusal

Identities = dict[str, FileIdentity | None]


@dataclass(frozen=True)
class Proof:
    """One passing `verify`: its levels, and the identity of every file it covered."""

    levels: tuple[str, ...]
    device: int  # the device of the checkpoint's folder when it was verified
    files: dict[str, FileIdentity]

    def to_json(self) -> dict:
        return {
            "levels": list(self.levels),
            "device": self.device,
            "files": {name: list(ident) for name, ident in self.files.items()},
        }

    @classmethod
    def from_json(cls, data: object) -> Proof | None:
        """None for anything but a well-formed proof (a torn or edited record proves nothing)."""
        if not isinstance(data, dict):
            return None
        levels, device, files = data.get("levels"), data.get("device"), data.get("files")
        if not (
            isinstance(levels, list)
            and all(isinstance(x, str) for x in levels)
            and type(device) is int
            and isinstance(files, dict)
        ):
            return None
        out: dict[str, FileIdentity] = {}
        for name, ident in files.items():
            if not (
                isinstance(ident, list)
                and len(ident) == len(FileIdentity._fields)
                and all(type(v) is int for v in ident)
            ):
                return None
            out[name] = FileIdentity(*ident)
        return cls(tuple(levels), device, out)


def record_path(root: Path) -> Path:
    return Path(root) / STATE_DIR / RECORD_NAME


def identities(root: Path) -> Identities:
    """name (relative, posix) -> identity of every file of the checkpoint at `root` (hidden
    paths are not part of it: `contract.not_part_of_checkpoint`). Stat calls only."""
    _, files = fsio.listing(Path(root), contract.not_part_of_checkpoint)
    return {p.relative_to(root).as_posix(): file_identity(p) for p in files}


def _root_device(root: Path) -> int | None:
    ident = file_identity(root)
    return ident.device if ident is not None else None


def read_proofs(root: Path) -> list[Proof]:
    data = fsio.read_if_regular(record_path(root))
    try:
        doc = json.loads((data or b"").decode("utf-8"))
    except ValueError:
        return []
    if not isinstance(doc, dict) or doc.get("format_version") != RECORD_FORMAT:
        return []
    proofs = doc.get("proofs")
    found = [Proof.from_json(p) for p in proofs] if isinstance(proofs, list) else []
    return [p for p in found if p is not None]


def settle(root: Path, levels: list[str], passed: bool, before: Identities | None) -> str:
    """After a verify of `root` with `levels`: record the proof (a passing verify that read
    every byte, on files unchanged from `before` to now), or remove every proof (a failing
    verify). Returns what was done, in words; never raises for a record it cannot write
    (the verify's verdict stands; a server will say the checkpoint is not verified)."""
    root = Path(root)
    if not passed:
        return "removed" if forget(root) else ""
    if REQUIRED_LEVEL not in levels or before is None:
        return ""
    try:
        now = identities(root)
        device = _root_device(root)
    except OSError as exc:
        return f"not recorded: {exc.strerror or exc}"
    if now != before or device is None or any(v is None for v in now.values()):
        forget(root)
        return "not recorded: files changed while they were verified"
    files = {name: ident for name, ident in now.items() if ident is not None}
    proof = Proof(tuple(levels), device, files)
    others = [p for p in read_proofs(root) if p.device != device]
    doc = {"format_version": RECORD_FORMAT, "proofs": [p.to_json() for p in [*others, proof]]}
    state = root / STATE_DIR
    try:
        if os.path.lexists(state) and not fsio.is_real_dir(state):
            return f"not recorded: {STATE_DIR} is {fsio.describe(state)}"
        fsio.make_dirs(state)
        fsio.write_atomic(record_path(root), (json.dumps(doc) + "\n").encode(), state)
    except OSError as exc:
        return f"not recorded: {exc.strerror or exc}"
    return "recorded"


def forget(root: Path) -> bool:
    """Remove the record (only ours, only inside a real state folder); whether there was one."""
    state = Path(root) / STATE_DIR
    if not fsio.is_real_dir(state):
        return False
    try:
        os.unlink(record_path(root))
    except OSError:
        return False
    return True


def _shown(ident: FileIdentity | None) -> str:
    if ident is None:
        return "nothing readable"
    return ", ".join(f"{k} {v}" for k, v in ident._asdict().items())


def _differences(proof: Proof, now: Mapping[str, FileIdentity | None], root: str) -> list:
    problems: list[Problem] = []
    for name in sorted(set(proof.files) | set(now)):
        want, found = proof.files.get(name), now.get(name)
        if want == found:
            continue
        if want is None:
            added = problem(
                Code.VERIFIED_FILES_CHANGED, rule="added", file=name, root=root, env=SKIP_ENV
            )
            problems.append(added)
        elif found is None:
            problems.append(
                problem(
                    Code.VERIFIED_FILES_CHANGED, rule="removed", file=name, root=root, env=SKIP_ENV
                )
            )
        else:
            problems.append(
                problem(
                    Code.VERIFIED_FILES_CHANGED,
                    rule="changed",
                    file=name,
                    want=_shown(want),
                    identity=_shown(found),
                    root=root,
                    env=SKIP_ENV,
                )
            )
    return problems


def served_refusal(root: Path) -> Fatal | None:
    """Why the checkpoint at `root` must not be served: never verified with --checksums
    where it stands, or a file of it changed since (None: it was, and nothing changed).
    Stat calls and one small read: seconds at full scale."""
    root = Path(root)
    where = str(root)
    if not os.path.isdir(root):
        return fatal(Code.NOT_VERIFIED, rule="not-local", root=where, env=SKIP_ENV)
    device = _root_device(root)
    proofs = [p for p in read_proofs(root) if p.device == device]
    if not proofs:
        return fatal(Code.NOT_VERIFIED, rule="never", file=root, root=where, env=SKIP_ENV)
    proof = proofs[-1]
    if REQUIRED_LEVEL not in proof.levels:
        levels = ", ".join(proof.levels)
        return fatal(
            Code.NOT_VERIFIED,
            rule="no-checksums",
            file=root,
            levels=levels,
            root=where,
            env=SKIP_ENV,
        )
    problems = _differences(proof, identities(root), where)
    if not problems:
        return None
    hint = message(Code.VERIFIED_FILES_CHANGED, "changed").hint or ""
    return Fatal(problems[:MAX_LISTED], hint=hint.format(root=where, env=SKIP_ENV))


def skipped(env: Mapping[str, str] | None = None) -> bool:
    """Whether the operator opted out of the check (`KIMI_W31_SKIP_VERIFIED_CHECK=1`)."""
    return (os.environ if env is None else env).get(SKIP_ENV, "") == "1"
