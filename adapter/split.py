"""Split fused `experts.E.w31.*` tensors back into zero-copy `w3` (up) and `w1` (gate) views.

SGLang's expert loader then places them (TP slicing, EP global->local, EPLB replicas) exactly
as it places an original checkpoint's tensors. SGLang-free: this works on any iterable of
`(name, tensor, *extra)` items.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

# Names reach the text model after SGLang's renames: `weight_packed` may already be `weight`.
_W31 = re.compile(r"^(?P<pre>.*experts\.)(?P<eid>\d+)\.w31\.(?P<suf>[A-Za-z_]+)$")
_W13 = re.compile(r"^(?P<pre>.*experts\.)\d+\.w[13]\.")
_SPLIT_SUFFIXES = ("weight_packed", "weight_scale", "weight")


class SplitError(ValueError):
    """A `w31` tensor that cannot be a `[up; gate]` concatenation."""


@dataclass
class SplitStats:
    """What went through the splitter, per MoE layer prefix (`...mlp.experts.`)."""

    w31_layers: set[str] = field(default_factory=set)
    w13_layers: set[str] = field(default_factory=set)
    w31_tensors: int = 0
    dropped: list[str] = field(default_factory=list)


def split_w31_items(
    items: Iterable[tuple[Any, ...]],
    stats: SplitStats | None = None,
) -> Iterator[tuple[Any, ...]]:
    """Yield items unchanged, except each `w31` tensor becomes its `w3` then `w1` half.

    Extra tuple elements (SGLang passes kwargs as a third element) are kept. A 4-D scale
    `[2N, 1, K/32, 1]` is squeezed first, as SGLang does for `w1`/`w3` scales.
    """
    stats = stats if stats is not None else SplitStats()
    for item in items:
        name = item[0]
        m = _W31.match(name) if isinstance(name, str) else None
        if m is None:
            w13 = _W13.match(name) if isinstance(name, str) else None
            if w13 is not None:
                stats.w13_layers.add(w13["pre"])
            yield item
            continue
        suffix = m["suf"]
        if suffix not in _SPLIT_SUFFIXES:
            # e.g. a compressed-tensors `weight_shape`: SGLang drops these for w1/w3 too.
            stats.dropped.append(name)
            continue
        tensor: torch.Tensor = item[1]
        rest = tuple(item[2:])
        if suffix == "weight_scale" and tensor.ndim == 4:
            tensor = tensor[:, 0, :, 0]
        if tensor.ndim != 2 or tensor.shape[0] == 0 or tensor.shape[0] % 2:
            raise SplitError(
                f"{name}: a w31 tensor must be 2-D with an even, non-zero row count "
                f"([up; gate] = [2N, ...]), found shape {tuple(tensor.shape)}; the checkpoint "
                "is damaged or was not written by kimi-convert (run `kimi-convert verify`)"
            )
        n = tensor.shape[0] // 2
        stats.w31_layers.add(m["pre"])
        stats.w31_tensors += 1
        base = f"{m['pre']}{m['eid']}."
        yield (f"{base}w3.{suffix}", tensor.narrow(0, 0, n), *rest)  # up: rows [0, N)
        yield (f"{base}w1.{suffix}", tensor.narrow(0, n, n), *rest)  # gate: rows [N, 2N)
