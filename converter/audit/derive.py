"""What each output tensor must be, derived from the source's names by the contract alone.

`<p>experts.E.w31.X` must be the bytes of `<p>experts.E.w3.X` (up) followed by those of
`<p>experts.E.w1.X` (gate); every other tensor is the source tensor of the same name. No
planner, no validation table: only `contract.parse_expert_name` and string rules.
"""

from __future__ import annotations

from typing import NamedTuple

from .. import contract
from ..safetensors_format import ShardHeader, TensorInfo


class Part(NamedTuple):
    """A source tensor an output tensor is made of."""

    file: str  # source shard
    info: TensorInfo


class Expected(NamedTuple):
    """One output tensor as the source defines it: its parts, in byte order, or the names of
    the parts the source lacks."""

    parts: tuple[Part, ...]
    missing: tuple[str, ...] = ()

    @property
    def fused(self) -> bool:
        return len(self.parts) + len(self.missing) == 2


def expected_tensors(headers: dict[str, ShardHeader]) -> dict[str, Expected]:
    """Output tensor name -> what it must consist of, for a source given by its headers."""
    where: dict[str, Part] = {}
    for file, header in headers.items():
        for name, info in header.tensors.items():
            where[name] = Part(file, info)
    expected: dict[str, Expected] = {}
    fused: dict[str, tuple[str, str]] = {}  # w31 name -> (up = w3, gate = w1) names
    tails: dict[str, contract.ExpertTail | None] = {}  # a few thousand distinct at real scale
    for name, part in where.items():
        split = contract.expert_prefix_and_tail(name)
        if split is None:
            expected[name] = Expected((part,))
            continue
        prefix, tail = split
        if tail not in tails:
            tails[tail] = contract.parse_expert_tail(tail)
        parsed = tails[tail]
        if parsed is None or parsed.proj not in (contract.GATE, contract.UP):
            expected[name] = Expected((part,))
            continue
        w31 = contract.expert_name(prefix, parsed.expert, contract.FUSED, parsed.suffix)
        if w31 not in fused:
            fused[w31] = (
                contract.expert_name(prefix, parsed.expert, contract.UP, parsed.suffix),
                contract.expert_name(prefix, parsed.expert, contract.GATE, parsed.suffix),
            )
    for w31, halves in fused.items():
        parts = tuple(where[h] for h in halves if h in where)
        expected[w31] = Expected(parts, tuple(h for h in halves if h not in where))
    return expected
