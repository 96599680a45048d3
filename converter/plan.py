"""Plan a conversion from headers alone: which bytes go where, decided before any I/O.

The plan is plain data. Each output tensor is a list of byte ranges ("pieces") in source
files; a fused `w31` is the `w3` range followed by the `w1` range, which is exactly
`concat([w3, w1], dim=0)` for row-major tensors. Output shards are filled in source order
up to `max_shard_size`; a tensor never straddles shards. Each shard's header bytes are
computed here, so the executor only streams.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from typing import NamedTuple

from .errors import ConvertError, Problem
from .manifest import (
    Dims,
    ExpertTensor,
    Manifest,
    check_expert_tensors,
    parse_expert,
    resolve_dims,
)
from .safetensors_format import TensorInfo, build_header
from .source import Source

DEFAULT_MAX_SHARD_SIZE = 5_000_000_000


class Piece(NamedTuple):
    file: str  # source shard, relative to the source root
    offset: int  # absolute offset in that file
    length: int


class OutputTensor(NamedTuple):
    name: str
    dtype: str
    shape: tuple[int, ...]
    pieces: tuple[Piece, ...]
    nbytes: int  # sum of the pieces' lengths


@dataclass
class OutputShard:
    name: str
    tensors: list[OutputTensor]
    header: bytes = b""

    @property
    def data_size(self) -> int:
        return sum(t.nbytes for t in self.tensors)

    @property
    def file_size(self) -> int:
        return len(self.header) + self.data_size

    @property
    def source_files(self) -> list[str]:
        return sorted({p.file for t in self.tensors for p in t.pieces})


@dataclass
class Plan:
    shards: list[OutputShard]
    dims: Dims
    experts_fused: int
    tensors_copied: int
    source_bytes: int
    fingerprint: str = ""
    layers: dict[str, int] = field(default_factory=dict)  # MoE layer prefix -> experts

    @property
    def total_size(self) -> int:
        """`metadata.total_size` of the index: the sum of tensor data bytes."""
        return sum(s.data_size for s in self.shards)

    @property
    def output_bytes(self) -> int:
        return sum(s.file_size for s in self.shards)

    def weight_map(self) -> dict[str, str]:
        return {t.name: s.name for s in self.shards for t in s.tensors}


def shard_name(index: int, count: int) -> str:
    if count == 1:
        return "model.safetensors"
    return f"model-{index:05d}-of-{count:05d}.safetensors"


def _ordered_tensors(source: Source) -> list[tuple[str, TensorInfo]]:
    """All source tensors in (index order of files, offset within file): read-friendly."""
    out = []
    for file in source.shard_files:
        header = source.headers[file]
        out.extend((file, info) for info in sorted(header.tensors.values(), key=lambda t: t.begin))
    return out


@dataclass
class Validated:
    """What validation learned, handed to the planner so nothing is computed twice."""

    dims: Dims
    layers: dict  # MoE layer prefix -> expert id -> {proj.suffix: tensor name}
    parsed: dict[str, ExpertTensor | None]  # tensor name -> its expert-name parts
    table: dict[str, tuple[str, TensorInfo]]  # tensor name -> (source file, info)
    problems: list[Problem]


def validate_source(source: Source, manifest: Manifest) -> Validated:
    """Every check that must pass before a byte is written; returns all problems."""
    problems: list[Problem] = []
    if not _has_quantization_config(source.config):
        problems.append(
            Problem(
                "config has no quantization_config: this is not an MXFP4 checkpoint",
                file="config.json",
            )
        )
    dims, dim_problems = resolve_dims(manifest, source.config)
    problems.extend(dim_problems)
    table = {
        info.name: (file, info) for file, header in source.headers.items()
        for info in header.tensors.values()
    }  # fmt: skip
    parsed = {name: parse_expert(manifest, name) for name in table}
    layers, tensor_problems = check_expert_tensors(manifest, dims, table, False, parsed)
    problems.extend(tensor_problems)
    return Validated(dims, layers, parsed, table, problems)


def _has_quantization_config(config: dict) -> bool:
    inner = config.get("text_config")
    return isinstance(config.get("quantization_config"), dict) or (
        isinstance(inner, dict) and isinstance(inner.get("quantization_config"), dict)
    )


def plan_conversion(
    source: Source,
    manifest: Manifest,
    max_shard_size: int = DEFAULT_MAX_SHARD_SIZE,
    tool_version: str = "",
) -> Plan:
    """Validate, then lay out every output tensor and shard. Raises with all problems."""
    checked = validate_source(source, manifest)
    dims, layers, parsed_names, table, problems = (
        checked.dims, checked.layers, checked.parsed, checked.table, checked.problems,
    )  # fmt: skip
    if problems:
        raise ConvertError(
            problems,
            hint=(
                f"the checkpoint does not match manifest '{manifest.name}'; for scaled-down "
                "or modified checkpoints pass --manifest kimi-k3-any"
                if manifest.raw.get("pinned")
                else None
            ),
        )

    ordered = _ordered_tensors(source)
    outputs: list[OutputTensor] = []
    fused: set[str] = set()
    for file, info in ordered:
        parsed = parsed_names[info.name]
        if parsed is None or parsed.proj not in ("w1", "w3"):
            piece = Piece(file, info.begin, info.end - info.begin)
            outputs.append(OutputTensor(info.name, info.dtype, info.shape, (piece,), piece.length))
            continue
        # w31 goes where the first of its two halves appears in the source.
        stem = info.name[: -len(parsed.proj) - len(parsed.suffix) - 1]  # "<p>experts.E."
        tail = "." + parsed.suffix
        name = stem + "w31" + tail
        if name in fused:
            continue
        fused.add(name)
        (up_file, up), (gate_file, gate) = table[stem + "w3" + tail], table[stem + "w1" + tail]
        pieces = (
            Piece(up_file, up.begin, up.end - up.begin),
            Piece(gate_file, gate.begin, gate.end - gate.begin),
        )
        shape = (up.shape[0] + gate.shape[0], *up.shape[1:])
        outputs.append(
            OutputTensor(name, up.dtype, shape, pieces, pieces[0].length + pieces[1].length)
        )

    shards = pack_shards(outputs, max_shard_size)
    plan = Plan(
        shards=shards,
        dims=dims,
        experts_fused=sum(len(e) for e in layers.values()),
        tensors_copied=len(outputs),
        source_bytes=sum(h.file_size for h in source.headers.values()),
        layers={prefix: len(experts) for prefix, experts in layers.items()},
    )
    plan.fingerprint = plan_fingerprint(plan, source, manifest, tool_version)
    return plan


def pack_shards(tensors: list[OutputTensor], max_shard_size: int) -> list[OutputShard]:
    """Greedy, order-preserving: start a new shard when the next tensor would overflow.

    A tensor larger than the limit gets a shard of its own (as huggingface_hub does).
    """
    groups: list[list[OutputTensor]] = [[]]
    size = 0
    for t in tensors:
        if groups[-1] and size + t.nbytes > max_shard_size:
            groups.append([])
            size = 0
        groups[-1].append(t)
        size += t.nbytes
    count = len(groups)
    shards = []
    for i, group in enumerate(groups, start=1):
        shard = OutputShard(shard_name(i, count), group)
        shard.header = build_header(group)  # OutputTensor has HeaderEntry's fields
        shards.append(shard)
    return shards


def plan_fingerprint(plan: Plan, source: Source, manifest: Manifest, tool_version: str) -> str:
    """Identity of (tool, manifest, source files, layout): a resume must match it exactly."""
    h = hashlib.sha256()
    ident = {
        "tool": tool_version,
        "manifest": manifest.sha256,
        "source": {f: [hd.file_size, hd.header_sha256] for f, hd in sorted(source.headers.items())},
        "shards": [[s.name, s.file_size] for s in plan.shards],
    }
    h.update(json.dumps(ident, sort_keys=True).encode())
    for s in plan.shards:
        h.update(s.header)
    return h.hexdigest()
