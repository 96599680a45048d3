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
from collections.abc import Iterator
from dataclasses import dataclass, field
from functools import cached_property
from typing import NamedTuple

from .errors import ConvertError, Problem
from .manifest import (
    Dims,
    Manifest,
    check_expert_tensors,
    parse_expert,
    resolve_dims,
    split_expert_name,
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

    @cached_property
    def data_size(self) -> int:  # cached: asked for several times of 300k-tensor plans
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


def _source_tensors(source: Source) -> Iterator[tuple[str, TensorInfo]]:
    """All source tensors as (file, info), in index order of files and by offset within one
    (`ShardHeader.tensors` is in offset order): the order they are read in."""
    for file in source.shard_files:
        for info in source.headers[file].tensors.values():
            yield file, info


@dataclass
class Validated:
    """What validation learned, handed to the planner so nothing is computed twice."""

    dims: Dims
    layers: dict[str, int]  # MoE layer prefix -> experts found
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
    layers, tensor_problems = check_expert_tensors(
        manifest, dims, _source_tensors(source), converted=False
    )
    problems.extend(tensor_problems)
    return Validated(dims, layers, problems)


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
    if checked.problems:
        raise ConvertError(
            checked.problems,
            hint=(
                f"the checkpoint does not match manifest '{manifest.name}'; for scaled-down "
                "or modified checkpoints pass --manifest kimi-k3-any"
                if manifest.raw.get("pinned")
                else None
            ),
        )
    outputs = output_tensors(source, manifest)
    shards = pack_shards(outputs, max_shard_size)
    plan = Plan(
        shards=shards,
        dims=checked.dims,
        experts_fused=sum(checked.layers.values()),
        tensors_copied=len(outputs),
        source_bytes=sum(h.file_size for h in source.headers.values()),
        layers=checked.layers,
    )
    plan.fingerprint = plan_fingerprint(plan, source, manifest, tool_version)
    return plan


_new_tuple = tuple.__new__  # builds a NamedTuple without its Python-level __new__ (3x faster)


def output_tensors(source: Source, manifest: Manifest) -> list[OutputTensor]:
    """Every output tensor in source read order; a validated source is assumed.

    A w1/w3 pair becomes one w31 (w3's bytes, then w1's) at the place of whichever half
    comes first in the source; everything else is one byte range copied as it is.
    """
    fusion: dict[str, tuple[str, bool] | None] = {}  # name tail -> (w31 tail, is w3) or None
    outputs: list[OutputTensor | None] = []
    waiting: dict[str, tuple[int, str, TensorInfo, bool]] = {}  # w31 name -> first half
    new, tensor_cls, piece_cls = _new_tuple, OutputTensor, Piece
    for file in source.shard_files:  # _source_tensors inlined: this body runs 500k times
        for info in source.headers[file].tensors.values():
            name = info.name
            split = split_expert_name(name)
            role = None
            if split is not None:
                head, tail = split
                role = fusion.get(tail, _UNSEEN)
                if role is _UNSEEN:
                    role = fusion[tail] = _fusion_role(manifest, tail)
            if role is None:
                length = info.end - info.begin
                piece = new(piece_cls, (file, info.begin, length))
                outputs.append(new(tensor_cls, (name, info.dtype, info.shape, (piece,), length)))
                continue
            w31 = head + "experts." + role[0]
            first = waiting.pop(w31, None)
            if first is None:
                waiting[w31] = (len(outputs), file, info, role[1])
                outputs.append(None)  # the slot is filled when the other half is seen
                continue
            # w31 = concat([w3, w1], dim=0): the up rows' bytes, then the gate rows' bytes.
            slot, other_file, other, other_is_up = first
            up_file, up, gate_file, gate = (
                (other_file, other, file, info) if other_is_up else (file, info, other_file, other)
            )
            up_len, gate_len = up.end - up.begin, gate.end - gate.begin
            pieces = (
                new(piece_cls, (up_file, up.begin, up_len)),
                new(piece_cls, (gate_file, gate.begin, gate_len)),
            )
            shape = (up.shape[0] + gate.shape[0], *up.shape[1:])
            outputs[slot] = new(tensor_cls, (w31, up.dtype, shape, pieces, up_len + gate_len))
    if waiting:  # validation reports a missing partner first; this is a programming error
        raise ConvertError([Problem("w1/w3 half without its partner", tensor=next(iter(waiting)))])
    return outputs  # type: ignore[return-value]  # every slot is filled


_UNSEEN = object()


def _fusion_role(manifest: Manifest, tail: str) -> tuple[str, bool] | None:
    """For a w1/w3 tail ("E.w1.suffix"): the w31 tail ("E.w31.suffix") and whether it is w3."""
    parsed = parse_expert(manifest, "experts." + tail)
    if parsed is None or parsed.proj not in ("w1", "w3"):
        return None
    expert_part = tail[: -len(parsed.proj) - len(parsed.suffix) - 1]  # "E."
    return expert_part + "w31." + parsed.suffix, parsed.proj == "w3"


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
