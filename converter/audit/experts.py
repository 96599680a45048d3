"""The routed experts an output must hold, derived from the contract alone, and compared.

This is the independent second opinion on what the converter's validation decided: it
shares only the contract (name grammar, MoE-layer rule) and the manifest's shape formulas
with it. Expected: for every MoE layer of the config (`contract.moe_layer_ids`), at the one
expert prefix the output uses for that layer, experts 0..E-1, each with
`w31.weight_packed`, `w31.weight_scale`, `w2.weight_packed`, `w2.weight_scale` of the
manifest's converted dtype and shape. Found: every output tensor with an `experts` path
component. The two are compared as sets of name tails per prefix; each kind of difference
has its own code.

The real model has 330k expert tensors: names are split and grouped in C loops (`map`,
`compress`, `groupby`), tails are compared as sets against the E x 4 expected ones, and only
names that are not exactly what is expected are taken apart one by one.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import chain, compress, groupby, repeat
from operator import add, eq, ge, getitem, itemgetter, or_

from .. import contract
from ..errors import Problem, problem
from ..manifest import Dims, Manifest
from ..reasons import Code
from ..safetensors_format import ShardHeader, TensorInfo
from ..text import id_ranges

# The tensors of one converted expert, as "proj.suffix" (the manifest's keys).
ROLES = tuple(f"{p}.{s}" for p in (contract.FUSED, contract.DOWN) for s in contract.SUFFIXES)
_MARK = ".experts."
_PAIR = itemgetter(1, 2)  # (dtype, shape) of a TensorInfo


@dataclass
class ExpertLayout:
    """What the comparison established: the prefix of each expected MoE layer found."""

    experts: int | None  # E from the config (None if unreadable)
    prefixes: dict[int, str] = field(default_factory=dict)  # MoE layer -> expert prefix
    found: int = 0  # routed-expert tensors found under the grammar

    def expert_prefixes(self) -> list[tuple[str, int]]:
        """(prefix, expert id) of every expected expert of the layers found."""
        if self.experts is None:
            return []
        return [(p, e) for _, p in sorted(self.prefixes.items()) for e in range(self.experts)]


@dataclass
class _Group:
    """The tensors under one expert prefix: name tails ("E.proj.suffix") and their infos."""

    tails: list[str] = field(default_factory=list)
    infos: list[TensorInfo] = field(default_factory=list)
    valid: set[str] = field(default_factory=set)  # tails that are expected ones
    out_of_range: set[int] = field(default_factory=set)  # grammar-valid ids >= E


@dataclass(frozen=True)
class _Expected:
    """The tails every MoE layer must have, with the (dtype, shape) of each."""

    tails: frozenset[str]
    pairs: dict[str, tuple[str, tuple[int, ...] | None]]

    @classmethod
    def of(cls, experts: int | None, manifest: Manifest, dims: Dims) -> _Expected:
        pairs = {}
        for role in ROLES:
            rule = manifest.converted_tensors[role]
            pair = (rule.dtype, dims.shape(rule.shape))
            pairs.update((f"{e}.{role}", pair) for e in range(experts or 0))
        return cls(frozenset(pairs), pairs)


def check_experts(
    config: dict, manifest: Manifest, dims: Dims, headers: dict[str, ShardHeader]
) -> tuple[ExpertLayout, list[Problem]]:
    """Compare the routed-expert tensors of `headers` with what the config says must exist."""
    # Bounded by the output's own tensor count: a config may claim 10^10 layers.
    bound = sum(len(h.tensors) for h in headers.values())
    rule, problems = contract.layer_rule(config, bound)
    if not any(p.code is Code.CONFIG_BOUND for p in problems):
        # E as the manifest names it (the rule bounded `num_experts`).
        too_big = contract.bound_problem(manifest.dims["E"], dims.values.get("E", 0), bound)
        problems += [too_big] if too_big else []
    if any(p.code is Code.CONFIG_BOUND for p in problems):
        return ExpertLayout(None), problems
    moe_ids = rule.moe
    rule_known = not problems  # without the MoE rule no layer can be judged unexpected
    layout = ExpertLayout(dims.values.get("E"))
    expected = _Expected.of(layout.experts, manifest, dims)
    groups, files = _group(headers), _Files(headers)
    for prefix, group in groups.items():
        problems += _judge_names(prefix, group, expected, files)
    problems += _assign_layers(groups, set(moe_ids), set(rule.extra), layout, rule_known)
    missing = [i for i in moe_ids if i not in layout.prefixes]
    if missing:
        problems.append(
            problem(
                Code.LAYER_MISSING,
                count=len(missing),
                layers=id_ranges(moe_ids),
                missing=id_ranges(missing),
            )
        )
    for layer in sorted(layout.prefixes):
        prefix = layout.prefixes[layer]
        problems += _layer_problems(prefix, groups[prefix], expected, layout.experts, files)
    layout.found = sum(len(g.valid) + len(g.out_of_range) for g in groups.values())
    if not layout.found:
        problems.append(problem(Code.NO_EXPERTS, rule="output"))
    return layout, problems


def _group(headers: dict[str, ShardHeader]) -> dict[str, _Group]:
    """Every tensor under an `experts` path component, grouped by its prefix (the text
    before the last ".experts.", as `contract.expert_prefix_and_tail` splits)."""
    names = list(chain.from_iterable(h.tensors for h in headers.values()))
    infos = list(chain.from_iterable(h.tensors.values() for h in headers.values()))
    cuts = list(map(str.rfind, names, repeat(_MARK)))
    keep = list(map(or_, map(ge, cuts, repeat(0)), map(str.startswith, names, repeat("experts."))))
    names, infos, cuts = (list(compress(x, keep)) for x in (names, infos, cuts))
    # A cut of -1 (a name starting with "experts.") gives prefix "" and the tail after it.
    prefixes = map(getitem, names, map(slice, repeat(None), map(add, cuts, repeat(1))))
    tails = map(getitem, names, map(slice, map(add, cuts, repeat(len(_MARK))), repeat(None)))
    groups: dict[str, _Group] = {}
    for prefix, run in groupby(zip(prefixes, tails, infos, strict=True), key=itemgetter(0)):
        group = groups.setdefault(prefix, _Group())
        run = list(run)
        group.tails.extend(map(itemgetter(1), run))
        group.infos.extend(map(itemgetter(2), run))
    return groups


def _judge_names(prefix: str, group: _Group, expected: _Expected, files: _Files) -> list[Problem]:
    """Sort a prefix's tails into expected ones and the rest; the rest are taken apart:
    not the grammar, a w1/w3 left over, or a w31/w2 with an id beyond E."""
    tails = set(group.tails)
    group.valid = tails & expected.tails
    problems = []
    for tail in sorted(tails - group.valid):
        name = f"{prefix}experts.{tail}"
        parsed = contract.parse_expert_tail(tail)
        if parsed is None:
            problems.append(problem(Code.EXPERT_NAME, rule="output", file=files(name), tensor=name))
        elif parsed.proj in (contract.GATE, contract.UP):
            problems.append(
                problem(Code.EXPERT_TENSOR_UNEXPECTED, rule="output", file=files(name), tensor=name)
            )
        else:
            group.out_of_range.add(parsed.expert)
    return problems


class _Files:
    """Which shard holds a tensor, for messages: built on first use (problems are rare)."""

    def __init__(self, headers: dict[str, ShardHeader]) -> None:
        self._headers = headers
        self._map: dict[str, str] | None = None

    def __call__(self, name: str) -> str | None:
        if self._map is None:
            self._map = {n: f for f, h in self._headers.items() for n in h.tensors}
        return self._map.get(name)


def _assign_layers(
    groups: dict[str, _Group],
    moe_ids: set[int],
    extra: set[int],
    layout: ExpertLayout,
    rule_known: bool = True,
) -> list[Problem]:
    """Each prefix holding routed experts to its layer: exactly one prefix per MoE layer,
    none anywhere else (a declared extra layer may have one: held to the same)."""
    problems = []
    for prefix in sorted(p for p, g in groups.items() if g.valid or g.out_of_range):
        layer = contract.layer_of(prefix)
        where = f"{prefix}experts.*"
        if layer is None:
            problems.append(problem(Code.EXPERT_OUTSIDE_LAYER, tensor=where))
        elif layer in layout.prefixes:
            first = layout.prefixes[layer]
            problems.append(problem(Code.LAYER_DUPLICATED, tensor=where, layer=layer, prefix=first))
        elif layer not in moe_ids and layer not in extra and rule_known:
            problems.append(problem(Code.LAYER_UNEXPECTED, tensor=where, layer=layer))
        elif layer in moe_ids or layer in extra:
            layout.prefixes[layer] = prefix
    return problems


def _layer_problems(
    prefix: str, group: _Group, expected: _Expected, experts: int | None, files: _Files
) -> list[Problem]:
    """One MoE layer: every expert 0..E-1 with every role, no other id, right dtype/shape."""
    if experts is None:  # E unknown: the config check says why
        return []
    problems = _missing(prefix, expected.tails - group.valid, experts)
    if group.out_of_range:
        problems.append(
            problem(
                Code.EXPERT_ID_RANGE,
                rule="layer",
                tensor=f"{prefix}experts.*",
                last=experts - 1,
                ids=id_ranges(group.out_of_range),
            )
        )
    # One C loop proves the common case: every expected tensor has its (dtype, shape).
    if all(map(eq, map(expected.pairs.get, group.tails), map(_PAIR, group.infos))):
        return problems
    for tail, info in zip(group.tails, group.infos, strict=True):
        pair = expected.pairs.get(tail)
        if pair is None:
            continue
        name = f"{prefix}experts.{tail}"
        if info.dtype != pair[0]:
            problems.append(
                problem(
                    Code.EXPERT_DTYPE, file=files(name), tensor=name, want=pair[0], dtype=info.dtype
                )
            )
        elif pair[1] is not None and info.shape != pair[1]:
            problems.append(
                problem(
                    Code.EXPERT_SHAPE,
                    file=files(name),
                    tensor=name,
                    want=list(pair[1]),
                    shape=list(info.shape),
                )
            )
    return problems


def _missing(prefix: str, missing: set[str], experts: int) -> list[Problem]:
    """Whole experts missing (one problem for the layer), else single tensors missing."""
    roles_missing: dict[int, list[str]] = {}
    for tail in missing:
        expert, role = tail.split(".", 1)
        roles_missing.setdefault(int(expert), []).append(role)
    whole = sorted(e for e, roles in roles_missing.items() if len(roles) == len(ROLES))
    problems = []
    if whole:
        problems.append(
            problem(
                Code.LAYER_INCOMPLETE,
                rule="experts",
                tensor=f"{prefix}experts.*",
                count=len(whole),
                experts=experts,
                last=experts - 1,
                missing=id_ranges(whole),
            )
        )
    for expert in sorted(set(roles_missing) - set(whole)):
        for role in sorted(roles_missing[expert]):
            problems.append(
                problem(
                    Code.EXPERT_PARTNER_MISSING,
                    rule="expert",
                    tensor=f"{prefix}experts.{expert}.{role}",
                )
            )
    return problems
