"""Validate a source from its config and headers: every problem, before a byte is written.

The result is one parsed table of the routed-expert tensors (`ExpertTable`), built once,
under the contract's name grammar and MoE-layer rule; the planner reads roles from it and
parses no name itself, so validation and planning cannot disagree on what a tensor is.

The real model has ~500k expert tensors but only a few thousand distinct name tails
("E.proj.suffix"): each tail is judged once, and a layer whose set of tails is exactly the
expected one needs no per-expert bookkeeping.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field, replace
from typing import NamedTuple

from . import contract
from .errors import Problem, problem
from .manifest import Dims, Expectation, ExpertSpec, Manifest, expect
from .reasons import Code
from .safetensors_format import ShardHeader, TensorInfo
from .shapes import LAYER_PREFIX, PREFIX_ALIAS, SUBSTRING_ALIAS, shape_problems
from .source import Source
from .text import id_ranges


class Fusion(NamedTuple):
    """What a w1/w3 tail becomes: the w31 tail ("E.w31.suffix") and whether it is the up half."""

    w31_tail: str
    is_up: bool


@dataclass
class ExpertTable:
    """The source's routed experts as validation parsed them (read by the planner)."""

    dims: Dims
    # w1/w3 tail ("E.w1.suffix") -> what it becomes. Only tails are kept: the real model's
    # ~330k w1/w3 names share ~5k tails, and a name splits in one C call.
    fusions: dict[str, Fusion] = field(default_factory=dict)
    layers: dict[str, int] = field(default_factory=dict)  # expert prefix -> layer index
    experts: dict[str, int] = field(default_factory=dict)  # expert prefix -> experts found

    @property
    def experts_fused(self) -> int:
        return sum(self.experts.values())


def source_tensors(source: Source) -> Iterator[tuple[str, TensorInfo]]:
    """All source tensors as (file, info) in read order (index order of files, offsets)."""
    for file in source.shard_files:
        for info in source.headers[file].tensors.values():
            yield file, info


def validate_source(source: Source, manifest: Manifest) -> tuple[ExpertTable, list[Problem]]:
    """The expert table and every problem that must stop a conversion."""
    config = source.config
    problems: list[Problem] = []
    marks = contract.marks(config)
    if marks:
        problems.append(
            problem(Code.ALREADY_MARKED, file=contract.CONFIG_NAME, marks=", ".join(marks))
        )
    if not any(
        isinstance(contract.get(h, "quantization_config"), dict)
        for h in (config, contract.text_config(config))
    ):
        problems.append(
            problem(Code.NO_QUANTIZATION_CONFIG, rule="source", file=contract.CONFIG_NAME)
        )
    act = contract.config_value(config, "hidden_act")
    if act != contract.FIXED_FIELDS["activation"]:
        problems.append(
            problem(Code.SITU_MISMATCH, rule="hidden-act", file=contract.CONFIG_NAME, act=act)
        )
    # Bounded by the source's own tensor count: nothing is built from a config size above it.
    bound = sum(len(h.tensors) for h in source.headers.values())
    expected, config_problems = expect(manifest, config, bound)
    problems += config_problems
    if not expected.bounded:
        return ExpertTable(expected.dims), problems
    table, tensor_problems = check_expert_tensors(expected, source_tensors(source))
    tensor_problems += check_inventory(expected, source_tensors(source))
    tensor_problems += check_shapes(expected, source_tensors(source))
    tensor_problems += check_name_collisions(source.headers)
    return table, problems + tensor_problems


def check_shapes(expected: Expectation, tensors: Iterable[tuple[str, TensorInfo]]) -> list[Problem]:
    """Every non-expert tensor's shape against the one the config gives it (`shapes.py`)."""
    if expected.shapes is None:
        return []
    return shape_problems(expected.shapes, ((f, i.name, i.shape) for f, i in tensors))


def check_name_collisions(headers: Mapping[str, ShardHeader]) -> list[Problem]:
    """No two names that SGLang's name mapping folds into one model parameter: the one it
    loads last would win, and re-sharding changes which one that is."""
    names = set().union(*(h.tensors for h in headers.values()))

    def file_of(name: str) -> str | None:  # asked only of a collision's names
        return next((f for f, h in headers.items() if name in h.tensors), None)

    return contract.collision_problems(names, file_of)


class _Verdict(NamedTuple):
    expert: int
    key: str  # "proj.suffix"
    dtype: str
    shape: tuple[int, ...] | None  # None when a dimension is unknown (reported already)


def check_expert_tensors(
    expected: Expectation, tensors: Iterable[tuple[str, TensorInfo]], converted: bool = False
) -> tuple[ExpertTable, list[Problem]]:
    """Check every routed-expert tensor, given as (file, info), against the contract and the
    expectation: name grammar, dtype, shape, id range, partners, every expert of every MoE
    layer and no expert anywhere else (the rule's `extra` layers: experts may be there, whole)."""
    rules = expected.tensors
    num_experts = expected.dims.values.get("E")
    moe_layers, extra = set(expected.layers.moe), set(expected.layers.extra)
    table = ExpertTable(expected.dims)
    problems: list[Problem] = []
    tails_by_prefix: dict[str, list[str]] = {}
    verdicts: dict[str, _Verdict | Problem] = {}
    layer_of: dict[str, int | None] = {}
    fusions = table.fusions
    for file, info in tensors:
        name = info.name
        split = contract.expert_prefix_and_tail(name)
        if split is None:
            continue
        prefix, tail = split
        verdict = verdicts.get(tail)
        if verdict is None:
            verdict = verdicts[tail] = _judge_tail(tail, rules, num_experts, converted)
            if isinstance(verdict, _Verdict) and verdict.key.startswith(("w1.", "w3.")):
                w31_tail = f"{verdict.expert}.{contract.FUSED}.{verdict.key[3:]}"
                fusions[tail] = Fusion(w31_tail, verdict.key[:2] == contract.UP)
        if type(verdict) is Problem:
            problems.append(replace(verdict, file=file, tensor=name))
            continue
        tails = tails_by_prefix.get(prefix)
        if tails is None:
            tails = tails_by_prefix[prefix] = []
            layer_of[prefix] = contract.layer_of(prefix)
        tails.append(tail)
        if info.dtype != verdict.dtype:
            problems.append(
                problem(
                    Code.EXPERT_DTYPE, file=file, tensor=name, want=verdict.dtype, dtype=info.dtype
                )
            )
        if verdict.shape is not None and info.shape != verdict.shape:
            problems.append(
                problem(
                    Code.EXPERT_SHAPE,
                    file=file,
                    tensor=name,
                    want=list(verdict.shape),
                    shape=list(info.shape),
                )
            )
    problems += _check_layers(
        table, tails_by_prefix, layer_of, verdicts, rules, num_experts, moe_layers, extra
    )
    return table, problems


def _judge_tail(
    tail: str, rules: dict[str, ExpertSpec], num_experts: int | None, converted: bool
) -> _Verdict | Problem:
    parsed = contract.parse_expert_tail(tail)
    grammar = (
        f"experts.<id>.<{'|'.join(sorted({k.split('.')[0] for k in rules}))}>."
        f"<{'|'.join(contract.SUFFIXES)}>"
    )
    if parsed is None:
        return problem(Code.EXPERT_NAME, rule="source", grammar=grammar, tail="experts." + tail)
    key = f"{parsed.proj}.{parsed.suffix}"
    if key not in rules:
        why = (
            "w1/w3 expert tensor left in a converted checkpoint"
            if converted
            else "fused w31 tensor in a source checkpoint"
        )
        return problem(
            Code.EXPERT_TENSOR_UNEXPECTED,
            rule="source",
            why=why,
            allowed=" / ".join(sorted(rules)),
            key=key,
        )
    if num_experts is not None and parsed.expert >= num_experts:
        return problem(
            Code.EXPERT_ID_RANGE, rule="expert", experts=num_experts, expert=parsed.expert
        )
    return _Verdict(parsed.expert, key, rules[key].dtype, rules[key].shape)


def _check_layers(
    table: ExpertTable,
    tails_by_prefix: dict[str, list[str]],
    layer_of: dict[str, int | None],
    verdicts: dict,
    rules: dict,
    num_experts: int | None,
    moe_layers: set[int],
    extra: set[int],
) -> list[Problem]:
    """Every MoE layer has every expert with every tensor; no expert outside them (an
    extra declared layer's experts, where present, are held to the same)."""
    problems: list[Problem] = []
    complete = num_experts * len(rules) if num_experts is not None else None
    by_layer: dict[int, str] = {}
    for prefix, tails in sorted(tails_by_prefix.items()):
        layer = layer_of[prefix]
        where = f"{prefix}experts.*"
        if layer is None:
            problems.append(problem(Code.EXPERT_OUTSIDE_LAYER, tensor=where))
            continue
        if layer in by_layer:
            problems.append(
                problem(Code.LAYER_DUPLICATED, tensor=where, layer=layer, prefix=by_layer[layer])
            )
            continue
        by_layer[layer] = prefix
        if layer not in moe_layers and layer not in extra:
            problems.append(problem(Code.LAYER_UNEXPECTED, tensor=where, layer=layer))
            continue
        table.layers[prefix] = layer
        # Every accepted tail has an id below E and a key of the rules, so E x rules distinct
        # tails is exactly "every expert with every tensor".
        if len(tails) == complete and len(set(tails)) == complete:
            table.experts[prefix] = num_experts  # type: ignore[assignment]
            continue
        experts: dict[int, set[str]] = {}
        for tail in tails:
            verdict = verdicts[tail]
            experts.setdefault(verdict.expert, set()).add(verdict.key)
        table.experts[prefix] = len(experts)
        problems += _missing_in_layer(prefix, experts, rules, num_experts)
    missing = sorted(moe_layers - set(by_layer))
    if missing:
        problems.append(
            problem(
                Code.LAYER_MISSING,
                count=len(missing),
                layers=id_ranges(sorted(moe_layers)),
                missing=id_ranges(missing),
            )
        )
    if not table.experts_fused:
        problems.append(problem(Code.NO_EXPERTS, rule="source"))
    return problems


def _missing_in_layer(
    prefix: str, experts: dict[int, set[str]], rules: dict, num_experts: int | None
) -> list[Problem]:
    problems = []
    if num_experts is not None:
        missing = sorted(set(range(num_experts)) - set(experts))
        if missing:
            problems.append(
                problem(
                    Code.LAYER_INCOMPLETE,
                    rule="experts",
                    tensor=f"{prefix}experts.*",
                    count=len(missing),
                    experts=num_experts,
                    last=num_experts - 1,
                    missing=id_ranges(missing),
                )
            )
    for expert, parts in sorted(experts.items()):
        for key in sorted(set(rules) - parts):
            problems.append(
                problem(
                    Code.EXPERT_PARTNER_MISSING,
                    rule="expert",
                    tensor=f"{prefix}experts.{expert}.{key}",
                )
            )
    return problems


def check_inventory(
    expected: Expectation, tensors: Iterable[tuple[str, TensorInfo]]
) -> list[Problem]:
    """The non-expert tensors the expectation requires: each present (under any spelling the
    model's loader maps alike) and stored unquantized. Missing names are reported once per
    name pattern, with the layers that lack it, spelled as the source spells that layer."""
    inventory = expected.inventory
    if inventory is None:
        return []
    required = expected.required
    found: dict[str, tuple[str, TensorInfo]] = {}
    names: list[str] = []  # for the spelling of missing names, worked out only if any are
    for file, info in tensors:
        name = info.name
        names.append(name)
        if ".experts." in name:  # routed experts are the contract's, checked elsewhere
            continue
        for spelled, canonical in inventory.aliases:
            name = name.replace(spelled, canonical)
        if name in required:
            found[name] = (file, info)
    problems = []
    missing: dict[str, list[int]] = {}
    spelling: _Spelling | None = None
    for name, place in required.items():
        hit = found.get(name)
        if hit is None:
            if spelling is None:
                spelling = _Spelling.of(names)
            pattern, index = _pattern(spelling.respell(name))
            missing.setdefault(pattern, []).append(index)
        elif hit[1].dtype not in inventory.dtypes:
            problems.append(
                problem(
                    Code.INVENTORY_DTYPE,
                    file=hit[0],
                    tensor=hit[1].name,
                    place=place,
                    dtypes=" or ".join(sorted(inventory.dtypes)),
                    dtype=hit[1].dtype,
                )
            )
    for pattern, ids in missing.items():
        unit = "blocks" if "{B}" in pattern else "layers"
        where = f" in {unit} {id_ranges(ids)}" if ids != [-1] else ""
        problems.append(
            problem(Code.INVENTORY_MISSING, tensor=pattern, where=where, manifest=expected.manifest)
        )
    return problems


class _Spelling:
    """How the source spells each layer's names (SGLang maps `language_model.layers.` and
    `block_sparse_moe` alike), so a problem about a missing tensor names it as the file
    would: real checkpoints spell their MoE layers `block_sparse_moe`."""

    _MOE = f".{SUBSTRING_ALIAS[0]}."

    def __init__(self) -> None:
        self.short: dict[str, bool] = {}  # layer index -> spelled `language_model.layers.`
        self.moe: dict[str, bool] = {}  # layer index -> its FFN spelled `block_sparse_moe`

    @classmethod
    def of(cls, names: Iterable[str]) -> _Spelling:
        spelling = cls()
        for name in names:
            spelling.see(name)
        return spelling

    def see(self, name: str) -> None:
        short = name.startswith(PREFIX_ALIAS[0])
        head = PREFIX_ALIAS[0] if short else LAYER_PREFIX
        if not name.startswith(head):
            return
        layer, _, rest = name[len(head) :].partition(".")
        self.short.setdefault(layer, short)
        if rest.startswith(("mlp.", self._MOE[1:])):
            self.moe.setdefault(layer, rest.startswith(self._MOE[1:]))

    def respell(self, canonical: str) -> str:
        if not canonical.startswith(LAYER_PREFIX):
            return canonical
        layer, _, rest = canonical[len(LAYER_PREFIX) :].partition(".")
        if rest.startswith("mlp.") and self.moe.get(layer):
            rest = self._MOE[1:] + rest[4:]
        head = PREFIX_ALIAS[0] if self.short.get(layer) else LAYER_PREFIX
        return f"{head}{layer}.{rest}"


_INDEX = re.compile(r"(?:^|\.)(layers|blocks)\.(0|[1-9][0-9]*)\.", re.ASCII)


def _pattern(name: str) -> tuple[str, int]:
    """(name with its layer or block index as a placeholder, the index; -1 if none)."""
    m = _INDEX.search(name)
    if m is None:
        return name, -1
    mark = "{L}" if m[1] == "layers" else "{B}"
    return f"{name[: m.start(2)]}{mark}{name[m.end(2) :]}", int(m[2])
