"""Split fused `experts.E.w31.*` tensors back into zero-copy `w3` (up) and `w1` (gate) views.

SGLang's expert loader then places them (TP slicing, EP global->local, EPLB replicas) exactly
as it places an original checkpoint's tensors. SGLang-free: this works on any iterable of
`(name, tensor, *extra)` items.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from ..converter import contract
from ..converter.errors import fatal
from .reasons import AdapterCode
from .refused import Refused

# Names reach the text model after SGLang's renames: `weight_packed` may already be `weight`.
LOADED_SUFFIXES = (*contract.SUFFIXES, "weight")


class SplitError(Refused, ValueError):
    """A `w31` tensor that cannot be a `[up; gate]` concatenation."""


@dataclass
class SplitStats:
    """What went through the splitter, per MoE layer prefix (`...mlp.experts.`)."""

    w31_layers: set[str] = field(default_factory=set)
    w13_layers: set[str] = field(default_factory=set)
    w31_tensors: int = 0


def split_w31_items(
    items: Iterable[tuple[Any, ...]],
    stats: SplitStats | None = None,
) -> Iterator[tuple[Any, ...]]:
    """Yield items unchanged, except each `w31` tensor becomes its `w3` then `w1` half.

    Names are read with the contract's grammar (the converter's and `verify`'s): a fused
    name outside it is refused, never passed on to be silently skipped. Extra tuple elements
    (SGLang passes kwargs as a third element) are kept. A 4-D scale `[2N, 1, K/32, 1]` is
    squeezed first, as SGLang does for `w1`/`w3` scales.
    """
    stats = stats if stats is not None else SplitStats()
    for item in items:
        name = item[0]
        split = contract.expert_prefix_and_tail(name) if isinstance(name, str) else None
        if split is None:
            yield item
            continue
        prefix, tail = split
        parsed = contract.parse_expert_tail(tail, LOADED_SUFFIXES)
        if parsed is None and f".{contract.FUSED}." in f".{tail}":
            raise SplitError(fatal(AdapterCode.W31_UNSPLITTABLE, rule="grammar", tensor=name))
        if parsed is None or parsed.proj == contract.DOWN:
            yield item
            continue
        if parsed.proj in (contract.GATE, contract.UP):
            stats.w13_layers.add(prefix + "experts.")
            yield item
            continue
        tensor: torch.Tensor = item[1]
        rest = tuple(item[2:])
        if parsed.suffix == "weight_scale" and tensor.ndim == 4:
            tensor = tensor[:, 0, :, 0]
        if tensor.ndim != 2 or tensor.shape[0] == 0 or tensor.shape[0] % 2:
            raise SplitError(
                fatal(
                    AdapterCode.W31_UNSPLITTABLE,
                    rule="shape",
                    tensor=name,
                    shape=tuple(tensor.shape),
                )
            )
        n = tensor.shape[0] // 2
        stats.w31_layers.add(prefix + "experts.")
        stats.w31_tensors += 1
        yield (
            contract.expert_name(prefix, parsed.expert, contract.UP, parsed.suffix),
            tensor.narrow(0, 0, n),
            *rest,
        )  # up: rows [0, N)
        yield (
            contract.expert_name(prefix, parsed.expert, contract.GATE, parsed.suffix),
            tensor.narrow(0, n, n),
            *rest,
        )  # gate: rows [N, 2N)
