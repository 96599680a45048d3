"""Did every local expert of a MoE layer receive every part? Engine-neutral bookkeeping.

A loader that writes experts into preallocated buffers (SGLang's FusedMoE does) leaves
whatever it was never given as zeros, or as a default scale, and says nothing. The engine
glue records each write it sees (local slot, projection, packed or scale); after the load,
every local expert must hold every part the layer has buffers for, or the load stops with
what is missing, per layer, in the checkpoint's own names and expert ids.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from ..converter.text import id_ranges, plural

# Loader projections: w1 gate, w3 up (both halves of a converted w31), w2 down.
PROJECTIONS = ("w1", "w3", "w2")
PACKED, SCALE = "weight_packed", "weight_scale"


def kind_of(weight_name: str) -> str | None:
    """`...w13_weight_scale` -> weight_scale, `...w2_weight` / `..weight_packed` -> packed;
    None for anything else a loader may write (biases, input scales)."""
    if weight_name.endswith("weight_scale"):
        return SCALE
    if weight_name.endswith(("weight", "weight_packed")):
        return PACKED
    return None


@dataclass
class ExpertLedger:
    """One MoE layer on one rank: which (local slot, projection, kind) writes arrived.

    `global_ids[slot]` is the checkpoint's id of the expert in local slot `slot`;
    `required` the (projection, kind) pairs the layer has buffers for.
    """

    where: str
    global_ids: Sequence[int]
    required: frozenset[tuple[str, str]]
    received: set[tuple[int, str, str]] = field(default_factory=set)

    def record(self, slot: int, projection: str, kind: str | None) -> None:
        if kind is not None and 0 <= slot < len(self.global_ids):
            self.received.add((slot, projection, kind))

    def missing(self) -> dict[tuple[str, str], list[int]]:
        """{(projection, kind): checkpoint expert ids that lack it}, empty when complete."""
        out: dict[tuple[str, str], list[int]] = {}
        for proj, kind in sorted(self.required):
            lacking = [
                gid
                for slot, gid in enumerate(self.global_ids)
                if (slot, proj, kind) not in self.received
            ]
            if lacking:
                out[(proj, kind)] = lacking
        return out


def checkpoint_part(projection: str, kind: str, converted: bool) -> str:
    """The checkpoint tensor a loader write came from: a converted checkpoint's w1 and w3
    are the two halves of one w31."""
    return f"{'w31' if converted and projection in ('w1', 'w3') else projection}.{kind}"


def missing_parts(ledger: ExpertLedger, converted: bool) -> dict[str, list[int]]:
    """{checkpoint part ('w31.weight_packed'): sorted checkpoint expert ids lacking it}."""
    parts: dict[str, set[int]] = {}
    for (proj, kind), ids in ledger.missing().items():
        parts.setdefault(checkpoint_part(proj, kind, converted), set()).update(ids)
    return {part: sorted(ids) for part, ids in sorted(parts.items())}


def describe_missing(ledger: ExpertLedger, converted: bool) -> list[str]:
    """One line per missing checkpoint part: 'w31.weight_packed: experts 0-3, 9'."""
    return [
        f"{part}: expert{'s' if len(ids) > 1 else ''} {id_ranges(ids, limit=None)}"
        for part, ids in missing_parts(ledger, converted).items()
    ]


def incomplete_report(
    ledgers: Iterable[ExpertLedger], converted: bool, max_layers: int = 8
) -> str | None:
    """The refusal text for every incomplete layer (the first `max_layers` in full), or None
    when every local expert of every layer received every part."""
    bad = [(lg, describe_missing(lg, converted)) for lg in ledgers]
    bad = [(lg, lines) for lg, lines in bad if lines]
    if not bad:
        return None
    text = [f"{plural(len(bad), 'MoE layer')} did not receive every part of every local expert:"]
    for lg, lines in bad[:max_layers]:
        local = id_ranges(lg.global_ids, limit=None)
        text.append(f"  {lg.where} (local experts {local}):")
        text.extend(f"    {line}" for line in lines)
    if len(bad) > max_layers:
        text.append(f"  ... and {plural(len(bad) - max_layers, 'more layer')}")
    return "\n".join(text)
