"""Level 3, `--source SRC`: the output against its source, byte for byte.

Everything is derived from the data contract and compared directly; the checksums file is
not used (it may be missing):
- which source shards a loader opens, derived apart from the converter (`served.py`);
- every tensor and file against the source's bytes (`source_bytes.py`);
- `config.json`: `contract.unwrap_config(output config)` equals the source config;
- the `kimi_w31` block's informational fields: `dims` against the dimensions the manifest
  resolves from the source config, `source.files` against the source's shard sizes and
  header hashes (a difference means the source changed since the conversion, which is
  reported as such, not as corruption), `manifest_sha256` against the manifest used.

What this proves holds against deliberate tampering of the output too, as long as the
source is the trusted original: no record in the output is trusted.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from .. import contract
from ..errors import Fatal, Problem, fatal, problem
from ..manifest import resolve_dims
from ..reasons import Code
from ..safetensors_format import ShardHeader
from ..source import Source, read_source
from ..source.local import LocalOrigin, resolve_local
from .meter import MeterFactory
from .report import VerifyReport
from .served import served_headers
from .source_bytes import compare_with_source
from .structure import Output

LEVEL = "source"
INDEX = "model.safetensors.index.json"


def check_against_source(
    out: Output, spec: str, workers: int, meter: MeterFactory, report: VerifyReport
) -> Source | None:
    """Every source check; the source read (for --numerics), or None if it is unreadable."""
    source = _read(out, spec, report)
    if source is None:
        return None
    # The shards a loader opens, found here and not taken from the converter's reader.
    served, served_problems = served_headers(source.root)
    changed = _check_block(out, source, served, report)
    _check_config(out, source, report)
    compare_with_source(out, source, (served, served_problems), changed, workers, meter, report)
    return source


def locate_source(spec: str, output: Path) -> Path:
    """The source directory `--source` names, refused before verify reads anything (a
    checksum pass over 1.5 TB first would make a typo cost an hour): it must exist, not be
    the output, and look like a source (weights, and a config without the converter's
    markers). Raises `Fatal`."""
    root = resolve_local(spec)
    if root == Path(os.path.realpath(output)):
        raise fatal(Code.USAGE, rule="source-is-output", file=root)
    if not (root / INDEX).is_file() and not any(root.glob("*.safetensors")):
        raise fatal(Code.FILE_MISSING, rule="no-weights", file=root)
    try:
        cfg = json.loads((root / "config.json").read_text())
    except (OSError, ValueError):
        return root  # read_source words what is wrong with it, as a finding
    found = contract.marks(cfg)
    if found:
        raise fatal(Code.ALREADY_MARKED, file=root / "config.json", marks=", ".join(found))
    return root


def _read(out: Output, spec: str, report: VerifyReport) -> Source | None:
    title = "source readable"
    try:
        root = resolve_local(spec)
        if root == out.root.resolve():
            raise fatal(Code.USAGE, rule="source-is-output", file=root)
        return read_source(root, spec, LocalOrigin())
    except Fatal as exc:
        hint = f"; {exc.hint}" if exc.hint else ""
        report.add("source", LEVEL, title, exc.problems, f"source {spec}{hint}")
        return None


# -- the block's informational fields ----------------------------------------------------------


def _check_block(
    out: Output, source: Source, served: dict[str, ShardHeader], report: VerifyReport
) -> set[str]:
    """dims, source identity, manifest hash; returns the source files changed since."""
    block, problems, notes = out.block, [], []
    changed, identity = _identity(block.get("source"), served)
    problems += identity
    if "dims" in block and out.manifest is not None:
        dims, _ = resolve_dims(out.manifest, source.config)  # problems: the config check's
        if block["dims"] != dims.values:
            problems.append(
                problem(
                    Code.BLOCK_MISMATCH,
                    rule="dims",
                    file=contract.CONFIG_NAME,
                    want=_json(dims.values),
                    value=_json(block["dims"]),
                )
            )
    else:
        notes.append("no dims recorded")
    if "manifest_sha256" in block and out.manifest is not None:
        if block["manifest_sha256"] != out.manifest.sha256:
            problems.append(
                problem(
                    Code.BLOCK_MISMATCH,
                    rule="manifest-hash",
                    file=contract.CONFIG_NAME,
                    manifest=out.manifest.name,
                    want=_json(out.manifest.sha256),
                    value=_json(block["manifest_sha256"]),
                )
            )
    else:
        notes.append("no manifest hash recorded")
    detail = f"{len(served)} source shards" + "".join(f"; {n}" for n in notes)
    report.add("source-block", LEVEL, "kimi_w31 block vs source", problems, detail)
    return changed


def _json(value: object) -> str:
    return json.dumps(value, default=str)


def _identity(recorded: object, served: dict[str, ShardHeader]) -> tuple[set[str], list[Problem]]:
    """The source shards the block records against the ones there now."""
    if recorded is None:
        return set(), []
    files = recorded.get("files") if isinstance(recorded, dict) else None
    if not isinstance(files, dict):
        return set(), [
            problem(
                Code.BLOCK_FIELD,
                rule="source-files",
                file=contract.CONFIG_NAME,
            )
        ]
    changed, problems = set(), []
    for name in sorted(files.keys() | served.keys()):
        entry, header = files.get(name), served.get(name)
        now = (
            None
            if header is None
            else {"size": header.file_size, "header_sha256": header.header_sha256}
        )
        then = (
            {k: entry.get(k) for k in ("size", "header_sha256")}
            if isinstance(entry, dict)
            else entry
        )
        if then != now:
            changed.add(name)
            problems.append(
                problem(
                    Code.SOURCE_CHANGED_SINCE,
                    rule="shard",
                    file=name,
                    then=json.dumps(then),
                    now=json.dumps(now),
                )
            )
    return changed, problems


# -- config.json --------------------------------------------------------------------------------


def _check_config(out: Output, source: Source, report: VerifyReport) -> None:
    title = "config.json vs source config"
    if out.config is None:
        report.skip("source-config", LEVEL, title, "skipped: output config unreadable")
        return
    try:
        unwrapped = contract.unwrap_config(out.config)
    except ValueError as exc:
        report.add(
            "source-config",
            LEVEL,
            title,
            [problem(Code.CONFIG_DIFFERS, rule="unwrap", file=contract.CONFIG_NAME, error=exc)],
            "",
        )
        return
    problems = []
    if unwrapped != source.config:
        keys = sorted(
            k
            for k in unwrapped.keys() | source.config.keys()
            if unwrapped.get(k, _ABSENT) != source.config.get(k, _ABSENT)
        )
        problems.append(
            problem(
                Code.CONFIG_DIFFERS,
                rule="beyond-block",
                file=contract.CONFIG_NAME,
                keys=", ".join(keys[:10]),
            )
        )
    report.add("source-config", LEVEL, title, problems, "source config + block + wrapper")


_ABSENT = object()
