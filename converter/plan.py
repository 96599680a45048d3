"""Plan a conversion from headers alone: which bytes go where, decided before any I/O.

Pure: it reads the validated expert table and the source headers, never a file. Each
output tensor is a list of byte ranges ("pieces") in source files; a fused `w31` is the `w3`
range followed by the `w1` range, which is exactly `concat([w3, w1], dim=0)` for row-major
tensors. Output shards are filled in source order until the next tensor would overflow
`max_shard_size` bytes of data or the header bound; a tensor never straddles shards. Each
shard's header bytes are computed here, so the executor only streams.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cached_property
from typing import NamedTuple

from . import contract
from .errors import Fatal, fatal, problem
from .manifest import Dims
from .reasons import Code
from .safetensors_format import MAX_HEADER_BYTES, TensorInfo, build_header
from .source import Source
from .validate import ExpertTable

DEFAULT_MAX_SHARD_SIZE = 5_000_000_000
# A new shard starts before its header could pass this (half the library's 100 MB limit):
# loaders parse a header whole, and the real model's headers are ~150 kB.
MAX_SHARD_HEADER = 50_000_000


class Piece(NamedTuple):
    """One source tensor's bytes: a problem found in them names that file and tensor."""

    file: str  # source shard, relative to the source root
    offset: int  # absolute offset in that file (where the source tensor begins)
    length: int
    tensor: str = ""  # the source tensor (its name in the source header)


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

    @cached_property
    def input_files(self) -> list[str]:
        """The source shard files this shard's bytes are copied from, sorted."""
        return sorted({p.file for t in self.tensors for p in t.pieces})


@dataclass
class Plan:
    shards: list[OutputShard]
    dims: Dims
    experts_fused: int
    tensors: int
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


def plan_conversion(
    source: Source,
    table: ExpertTable,
    max_shard_size: int,
    tool_version: str = "",
    manifest_sha256: str = "",
    max_header: int = MAX_SHARD_HEADER,
) -> Plan:
    """Lay out every output tensor and shard of a validated source."""
    outputs = output_tensors(source, table)
    shards = pack_shards(outputs, max_shard_size, max_header)
    plan = Plan(
        shards=shards,
        dims=table.dims,
        experts_fused=table.experts_fused,
        tensors=len(outputs),
        source_bytes=sum(h.file_size for h in source.headers.values()),
        layers=dict(table.experts),
    )
    plan.fingerprint = plan_fingerprint(plan, source, manifest_sha256, tool_version)
    return plan


_new_tuple = tuple.__new__  # builds a NamedTuple without its Python-level __new__ (3x faster)


def output_tensors(source: Source, table: ExpertTable) -> list[OutputTensor]:
    """Every output tensor in source read order.

    A w1/w3 pair becomes one w31 (w3's bytes, then w1's) at the place of whichever half
    comes first in the source; everything else is one byte range copied as it is. Roles come
    from the validated table: no name is parsed here.
    """
    outputs: list[OutputTensor | None] = []
    waiting: dict[str, tuple[int, str, TensorInfo, bool]] = {}  # w31 name -> first half
    new, tensor_cls, piece_cls = _new_tuple, OutputTensor, Piece
    split, fusions = contract.expert_prefix_and_tail, table.fusions  # bound once: 500k calls
    halves = contract.FUSED_HALF_ENDINGS
    for file in source.shard_files:
        for info in source.headers[file].tensors.values():
            # Only names ending like a w1/w3 half can have a role: w2 and the rest skip the
            # split (a third of the real model's names).
            parts = split(info.name) if info.name.endswith(halves) else None
            role = None if parts is None else fusions.get(parts[1])
            if role is None:
                length = info.end - info.begin
                piece = new(piece_cls, (file, info.begin, length, info.name))
                outputs.append(
                    new(tensor_cls, (info.name, info.dtype, info.shape, (piece,), length))
                )
                continue
            w31, is_up = parts[0] + "experts." + role.w31_tail, role.is_up
            first = waiting.pop(w31, None)
            if first is None:
                waiting[w31] = (len(outputs), file, info, is_up)
                outputs.append(None)  # the slot is filled when the other half is seen
                continue
            # w31 = concat([w3, w1], dim=0): the up rows' bytes, then the gate rows' bytes.
            slot, other_file, other, other_is_up = first
            up_file, up, gate_file, gate = (
                (other_file, other, file, info) if other_is_up else (file, info, other_file, other)
            )
            up_len, gate_len = up.end - up.begin, gate.end - gate.begin
            pieces = (
                new(piece_cls, (up_file, up.begin, up_len, up.name)),
                new(piece_cls, (gate_file, gate.begin, gate_len, gate.name)),
            )
            shape = (up.shape[0] + gate.shape[0], *up.shape[1:])
            outputs[slot] = new(tensor_cls, (w31, up.dtype, shape, pieces, up_len + gate_len))
    if waiting:  # validation reports a missing partner first; this is a programming error
        raise fatal(Code.EXPERT_PARTNER_MISSING, rule="plan", tensor=next(iter(waiting)))
    return outputs  # type: ignore[return-value]  # every slot is filled


def header_entry_bound(t: OutputTensor) -> int:
    """At least the bytes `build_header` spends on this tensor's entry: a name character
    takes 1 byte in JSON when it is printable ASCII, 2 for a quote or backslash, up to 12
    otherwise (a surrogate pair escaped); a shape dimension up to 21, two offsets of 20
    digits, a dtype of 7 characters and the punctuation fit in 104."""
    name = t.name
    if name.isascii() and name.isprintable():
        size = len(name) + name.count('"') + name.count("\\")
    else:
        size = 12 * len(name)
    return size + 21 * len(t.shape) + 104


def pack_shards(
    tensors: list[OutputTensor], max_shard_size: int, max_header: int = MAX_SHARD_HEADER
) -> list[OutputShard]:
    """Greedy, order-preserving: a new shard starts when the next tensor would overflow the
    data size, or the header bound (checked on the header itself, which every shard needs
    anyway; only a shard found over it is packed again by entry). A tensor larger than the
    limit gets a shard of its own (as huggingface_hub does). A shard whose header passes the
    format's bound even so (one tensor's name alone) is refused, every such shard at once."""
    packed: list[tuple[list[OutputTensor], bytes]] = []
    for group in _greedy(tensors, max_shard_size, lambda t: t.nbytes):
        header = build_header(group)  # OutputTensor has HeaderEntry's fields
        if len(header) - 8 <= max_header or len(group) == 1:
            packed.append((group, header))
            continue
        for part in _greedy(group, max_header, header_entry_bound):
            packed.append((part, build_header(part)))
    shards = [
        OutputShard(shard_name(i, len(packed)), group, header)
        for i, (group, header) in enumerate(packed, start=1)
    ]
    too_large = [  # one tensor alone: its name is > 100 MB
        problem(
            Code.OUTPUT_HEADER_TOO_LARGE,
            file=s.name,
            limit=MAX_HEADER_BYTES,
            length=len(s.header) - 8,
        )
        for s in shards
        if len(s.header) - 8 > MAX_HEADER_BYTES
    ]
    if too_large:
        raise Fatal(too_large)
    return shards


def _greedy(
    tensors: list[OutputTensor], limit: int, weight: Callable[[OutputTensor], int]
) -> list[list[OutputTensor]]:
    """Consecutive groups whose weights sum to at most `limit` (a heavier one alone)."""
    groups: list[list[OutputTensor]] = [[]]
    total = 0
    for t in tensors:
        w = weight(t)
        if groups[-1] and total + w > limit:
            groups.append([])
            total = 0
        groups[-1].append(t)
        total += w
    return groups


def plan_fingerprint(plan: Plan, source: Source, manifest_sha256: str, tool_version: str) -> str:
    """Identity of (tool, manifest, source files, layout): a resume must match it exactly."""
    h = hashlib.sha256()
    ident = {
        "tool": tool_version,
        "manifest": manifest_sha256,
        "source": {f: [hd.file_size, hd.header_sha256] for f, hd in sorted(source.headers.items())},
        "shards": [[s.name, s.file_size] for s in plan.shards],
    }
    h.update(json.dumps(ident, sort_keys=True).encode())
    for s in plan.shards:
        h.update(s.header)
    return h.hexdigest()
