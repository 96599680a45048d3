"""Level 1, structure: what can be proven from headers and small files, without tensor data.

- the index against the shards: every entry safe to open (unsafe ones are never opened),
  every named shard readable under the strict header reader, each tensor in exactly one
  shard and in the shard the index names, no unreferenced `*.safetensors`, the right
  `metadata.total_size`;
- the config: the `kimi_w31` block (`contract.check_block`), every quantization_config
  wrapped (`contract.check_wrapped`), the block against the manifest, the dimensions;
- the routed experts, derived independently from the contract (`experts.py`);
- the files: every file is one the checksums file records, and every recorded file exists.

An output without an index is incomplete (the index is written last): nothing else is
judged. The `Output` read here is what the deeper levels work from.
"""

from __future__ import annotations

import gc
import os
from dataclasses import dataclass, field
from pathlib import Path

from .. import contract
from ..contract import STATE_DIR
from ..errors import Fatal, Problem, problem
from ..manifest import Dims, Manifest, load_manifest, resolve_dims
from ..reasons import Code
from ..safetensors_format import ShardHeader
from ..shapes import shape_problems, shape_rule
from ..source import (
    check_index_against_headers,
    check_shard_name,
    check_weight_map,
    read_index,
    read_json,
)
from ..source.local import LocalOrigin
from .experts import ExpertLayout, check_experts
from .files import check_recorded, list_files, load_checksums, unsafe_name
from .report import VerifyReport

FALLBACK_MANIFEST = "kimi-k3-any"
LEVEL = "structure"


@dataclass
class Output:
    """A converted output as its headers and small files describe it."""

    root: Path
    index_read: bool = False  # the index parsed (a weight_map to follow)
    shard_names: list[str] = field(default_factory=list)  # safe names the index gives
    headers: dict[str, ShardHeader] = field(default_factory=dict)  # shards that parsed
    config: dict | None = None
    manifest: Manifest | None = None
    dims: Dims | None = None
    layout: ExpertLayout | None = None
    files: list[str] = field(default_factory=list)  # regular files, hidden paths excluded
    ignored: list[str] = field(default_factory=list)  # hidden paths: not part of a checkpoint

    @property
    def block(self) -> dict:
        block = contract.find_block(self.config) if self.config is not None else None
        return block if isinstance(block, dict) else {}

    @property
    def files_recorded(self) -> bool:
        """Whether the output has a checksums file at all (usable or not)."""
        return os.path.lexists(self.root / contract.CHECKSUMS_NAME)

    def tensor_files(self) -> dict[str, str]:
        """tensor name -> shard (built on demand: 334k entries at real scale)."""
        return {name: f for f, h in self.headers.items() for name in h.tensors}


def check_structure(root: Path, manifest: Manifest | None, report: VerifyReport) -> Output | None:
    """Every structure check; None when the output is not there or not complete."""
    if not root.is_dir():
        found = (
            problem(Code.OUTPUT_NOT_DIRECTORY, rule="absent", file=root)
            if not os.path.lexists(root)
            else problem(Code.OUTPUT_NOT_DIRECTORY, rule="not-directory", file=root)
        )
        report.add("output", LEVEL, "output directory", [found], "")
        return None
    if not os.path.lexists(root / contract.INDEX_NAME):
        report.add("index", LEVEL, "shards and index", [_incomplete(root)], "no index")
        return None
    out = Output(root)
    out.files, file_problems, out.ignored = list_files(root)
    # 330k header entries and nothing that forms a cycle: the cyclic GC would rescan them
    # over and over (~40% of the time at real scale). Paused here only, then restored.
    gc_was_enabled = gc.isenabled()
    gc.disable()
    try:
        _check_index(out, report)
        _check_config(out, manifest, report)
        _check_experts(out, report)
        _check_shapes(out, report)
        _check_files(out, file_problems, report)
    finally:
        if gc_was_enabled:
            gc.enable()
    return out


def _incomplete(root: Path) -> Problem:
    if (root / STATE_DIR).is_dir():
        return problem(
            Code.INCOMPLETE_OUTPUT, rule="running", file=contract.INDEX_NAME, state=STATE_DIR
        )
    return problem(Code.INCOMPLETE_OUTPUT, rule="no-index", file=contract.INDEX_NAME)


# -- the index and the shards ---------------------------------------------------------------


def _check_index(out: Output, report: VerifyReport) -> None:
    title = "shards and index"
    try:
        weight_map, metadata = read_index(out.root / contract.INDEX_NAME)
    except Fatal as exc:
        report.add("index", LEVEL, title, exc.problems, "index unreadable")
        return
    out.index_read = True
    problems = check_weight_map(out.root, weight_map, contract.INDEX_NAME)
    # Only names that pass both checks are opened: never a path outside OUT, never the
    # state folder, never a non-string.
    weight_map, names = _string_entries(weight_map)
    for name in sorted(names):
        why = unsafe_name(out.root, name)
        if why is None:
            out.shard_names.append(name)
        elif check_shard_name(out.root, name) is None:  # not reported by check_weight_map
            problems.append(
                problem(Code.WEIGHT_MAP_ENTRY_UNSAFE, file=contract.INDEX_NAME, why=why, shard=name)
            )
    origin = LocalOrigin()
    for name in out.shard_names:
        try:
            out.headers[name] = origin.read_header(out.root, name)
        except Fatal as exc:
            problems += exc.problems
    problems += check_index_against_headers(weight_map, out.headers, contract.INDEX_NAME)
    problems += _unreferenced(out)
    # Two names that reach one model parameter: which one is served depends on load order.
    problems += contract.collision_problems(weight_map, weight_map.get)
    tensors = sum(len(h.tensors) for h in out.headers.values())
    if not problems:
        # The reader proved each shard's tensors tile its data section exactly.
        data = sum(h.file_size - h.data_start for h in out.headers.values())
        total = metadata.get("total_size")
        if total != data or type(total) is not int:
            problems.append(
                problem(Code.INDEX_TOTAL_SIZE, file=contract.INDEX_NAME, data=data, total=total)
            )
    report.add(
        "index",
        LEVEL,
        title,
        problems,
        f"{len(out.shard_names)} shards, {tensors} tensors, headers parsed",
    )


def _string_entries(weight_map: dict) -> tuple[dict[str, str], set[str]]:
    """The weight_map without entries whose value is not a string (check_weight_map has
    reported them), and its distinct shard names; no copy in the common case."""
    try:
        names = set(weight_map.values())  # a C loop over 330k entries
    except TypeError:  # a list or an object as a value
        names = None
    if names is None or not all(isinstance(f, str) for f in names):
        weight_map = {t: f for t, f in weight_map.items() if isinstance(f, str)}
        names = set(weight_map.values())
    return weight_map, names


def _unreferenced(out: Output) -> list[Problem]:
    referenced = set(out.shard_names)
    return [
        problem(Code.SHARD_UNREFERENCED, file=rel)
        for rel in out.files
        if rel.endswith(".safetensors") and rel not in referenced
    ]


# -- the config -------------------------------------------------------------------------------


def _check_config(out: Output, explicit: Manifest | None, report: VerifyReport) -> None:
    title = "config.json kimi_w31 block"
    try:
        config = read_json(out.root / contract.CONFIG_NAME)
    except Fatal as exc:
        report.add("config", LEVEL, title, exc.problems, "config unreadable")
        return
    if not isinstance(config, dict):
        report.add(
            "config",
            LEVEL,
            title,
            [
                problem(
                    Code.JSON_INVALID,
                    rule="config-not-object",
                    file=contract.CONFIG_NAME,
                )
            ],
            "config unreadable",
        )
        return
    out.config = config
    problems = contract.check_block(config) + contract.check_wrapped(config)
    out.manifest, note = _manifest(explicit, out.block)
    out.dims, dim_problems = resolve_dims(out.manifest, config)
    problems += dim_problems + _block_vs_manifest(out.block, out.manifest)
    report.add("config", LEVEL, title, problems, f"manifest {out.manifest.name}{note}")


def _manifest(explicit: Manifest | None, block: dict) -> tuple[Manifest, str]:
    """The manifest to check against: --manifest, else the block's, else kimi-k3-any."""
    if explicit is not None:
        return explicit, " (--manifest)"
    name = block.get("manifest")
    if isinstance(name, str) and name:
        try:
            return load_manifest(name), " (recorded in the block)"
        except Fatal:  # a custom manifest not available here: the general rules still apply
            return load_manifest(FALLBACK_MANIFEST), (
                f" (block names {name!r}, not available here; pass --manifest PATH)"
            )
    return load_manifest(FALLBACK_MANIFEST), " (none recorded)"


def _block_vs_manifest(block: dict, manifest: Manifest) -> list[Problem]:
    """The SiTU parameters and group size the block records, against the manifest's (a key
    the block does not carry is no mismatch)."""
    wanted = {
        "situ_beta": manifest.situ_beta,
        "situ_linear_beta": manifest.situ_linear_beta,
        "group_size": manifest.group_size,
    }
    return [
        problem(
            Code.BLOCK_MISMATCH,
            rule="manifest",
            file=contract.CONFIG_NAME,
            key=key,
            manifest=manifest.name,
            want=want,
            value=block[key],
        )
        for key, want in wanted.items()
        if key in block and block[key] != want
    ]


# -- the routed experts and the files -----------------------------------------------------------


def _check_experts(out: Output, report: VerifyReport) -> None:
    title = "routed experts (derived from the contract)"
    if out.config is None or out.manifest is None or out.dims is None:
        report.skip("experts", LEVEL, title, "skipped: no readable config")
        return
    if not out.index_read:
        report.skip("experts", LEVEL, title, "skipped: no readable index")
        return
    out.layout, problems = check_experts(out.config, out.manifest, out.dims, out.headers)
    layers, experts = len(out.layout.prefixes), out.layout.experts
    report.add(
        "experts",
        LEVEL,
        title,
        problems,
        f"{layers} MoE layers x {experts} experts, {out.layout.found} expert tensors",
    )


def _check_shapes(out: Output, report: VerifyReport) -> None:
    """Every non-expert tensor's shape against the one the config gives it (`shapes.py`):
    the converter copies these tensors, so a wrong one is the source's or a later edit's."""
    title = "non-expert tensor shapes (derived from the config)"
    if out.config is None:
        report.skip("shapes", LEVEL, title, "skipped: no readable config")
        return
    # Bounded by the output's tensor count, as the experts check (its problems are that check's).
    bound = sum(len(h.tensors) for h in out.headers.values())
    rule, rule_problems = contract.layer_rule(out.config, bound)
    shapes = shape_rule(out.config, None if rule_problems else rule.moe)
    tensors = (
        (file, info.name, info.shape)
        for file, header in out.headers.items()
        for info in header.tensors.values()
    )
    problems = shape_problems(shapes, tensors)
    report.add("shapes", LEVEL, title, problems, "every judged tensor has its shape")


def _check_files(out: Output, problems: list[Problem], report: VerifyReport) -> None:
    title = "every file recorded by the conversion"
    table, _ = load_checksums(out.root, deep=False)  # its problems belong to --checksums
    if table is None:
        if problems:
            report.add("files", LEVEL, title, problems, "")
        else:
            report.skip(
                "files",
                LEVEL,
                title,
                f"skipped: no usable {contract.CHECKSUMS_NAME} (--checksums reports why)",
            )
        return
    problems += check_recorded(out.root, out.files, table)
    report.add("files", LEVEL, title, problems, f"{len(out.files)} files{_ignored(out)}")


def _ignored(out: Output) -> str:
    if not out.ignored:
        return ""
    more = len(out.ignored) - 5
    shown = ", ".join(out.ignored[:5]) + (f" and {more} more" if more > 0 else "")
    return f"; ignored (not part of a checkpoint): {shown}"
