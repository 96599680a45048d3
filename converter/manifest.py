"""Manifests: what a Kimi-K3 checkpoint must look like, as data.

A manifest (JSON under `manifests/`, or a file the user names) gives the config fields that
hold the dimensions, each routed-expert tensor's dtype and shape as a formula of them (before
and after conversion), the SiTU parameters, and optionally pinned config values. The name
grammar and the MoE-layer rule are not the manifest's: they are the contract's
(`contract.py`). Loading checks the manifest itself, so a broken one is named in words
before any checkpoint is read.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any, NamedTuple

from . import contract
from .errors import Problem, fatal, problem
from .reasons import Code
from .shapes import ShapeRule, shape_rule

DEFAULT_MANIFEST = "kimi-k3"
# Symbols every manifest must map to config fields: K (expert input width), N (expert
# intermediate size), E (routed experts per layer).
REQUIRED_DIMS = ("K", "N", "E")
_FORMULA = re.compile(r"(?:([0-9]+)\*)?([A-Za-z_]+)(?:/([0-9]+))?", re.ASCII)
_SECTIONS = {
    "name": "its name",
    "dims": "the config fields that give the dimensions K, N and E",
    "source_tensors": "the dtype and shape of each expert tensor before conversion",
    "converted_tensors": "the dtype and shape of each expert tensor after conversion",
    "situ": "the SiTU parameters beta and linear_beta",
}


@dataclass(frozen=True)
class TensorRule:
    dtype: str
    shape: tuple[str, ...]  # formulas such as "N", "2*N", "K/32"


# Where a group of the non-expert inventory applies (see `Inventory`).
INVENTORY_PLACES = ("model", "layer", "kda", "mla", "dense", "moe", "vision_block")
_PLACES = ", ".join(INVENTORY_PLACES)


@dataclass(frozen=True)
class InventoryGroup:
    """Tensor names required at one kind of place, when a config field is set (`when`) or
    unset (`unless`). Names under a layer or vision block are relative to its prefix."""

    place: str
    names: tuple[str, ...]
    when: str | None = None
    unless: str | None = None


@dataclass(frozen=True)
class Inventory:
    """The non-expert tensors a checkpoint must carry (the model class loads them all)."""

    dtypes: frozenset[str]  # what each may be stored as (the model's unquantized methods)
    aliases: tuple[tuple[str, str], ...]  # name spellings the model's loader maps alike
    layer_prefix: str  # "...layers.{L}."
    vision_block_prefix: str  # "...blocks.{B}."
    vision_blocks: tuple[str, int]  # (vision config field, its default)
    groups: tuple[InventoryGroup, ...]


@dataclass(frozen=True)
class Manifest:
    name: str
    sha256: str
    dims: dict[str, str]  # symbol -> config field
    source_tensors: dict[str, TensorRule]  # "proj.suffix" -> rule
    converted_tensors: dict[str, TensorRule]
    situ_beta: float
    situ_linear_beta: float
    pinned: dict[str, Any]
    group_size: int = contract.GROUP_SIZE
    inventory: Inventory | None = None

    def rules(self, converted: bool) -> dict[str, TensorRule]:
        return self.converted_tensors if converted else self.source_tensors


def available_manifests() -> list[str]:
    root = resources.files("kimi_w31.manifests")
    return sorted(p.name[:-5] for p in root.iterdir() if p.name.endswith(".json"))


def load_manifest(name_or_path: str) -> Manifest:
    """A bundled manifest by name (`kimi-k3`, `kimi-k3-any`) or a JSON file path."""
    bundled = resources.files("kimi_w31.manifests") / f"{name_or_path}.json"
    looks_like_path = name_or_path.endswith(".json") or "/" in name_or_path
    if not looks_like_path and _is_file(bundled):
        data, label = bundled.read_bytes(), name_or_path
    elif looks_like_path:
        path = Path(name_or_path).expanduser()
        if not path.is_file():
            raise fatal(Code.MANIFEST_NOT_FOUND, rule="file", file=path)
        data, label = path.read_bytes(), str(path)
    else:
        raise fatal(
            Code.MANIFEST_NOT_FOUND,
            rule="name",
            name=name_or_path,
            known=" or ".join(available_manifests()),
        )
    return parse_manifest(data, label)


def _is_file(path) -> bool:
    """Whether a bundled manifest of that name is there (a name too long to look up: no)."""
    try:
        return path.is_file()
    except OSError:
        return False


def parse_manifest(data: bytes, label: str) -> Manifest:
    try:
        raw = json.loads(data)
    except (ValueError, RecursionError) as exc:
        raise fatal(Code.MANIFEST_INVALID, rule="not-json", file=label, error=exc) from None
    if not isinstance(raw, dict):
        raise fatal(Code.MANIFEST_INVALID, rule="not-object", file=label)
    for key, meaning in _SECTIONS.items():
        if key not in raw:
            raise fatal(Code.MANIFEST_INVALID, rule="no-key", file=label, key=key, meaning=meaning)
    dims = raw["dims"]
    if not isinstance(dims, dict) or not all(isinstance(v, str) for v in dims.values()):
        raise fatal(Code.MANIFEST_INVALID, rule="dims", file=label)
    missing = [s for s in REQUIRED_DIMS if s not in dims]
    if missing:
        raise fatal(
            Code.MANIFEST_INVALID, rule="dims-missing", file=label, symbols=", ".join(missing)
        )
    situ = raw["situ"]
    if not isinstance(situ, dict) or not all(
        isinstance(situ.get(k), (int, float)) for k in ("beta", "linear_beta")
    ):
        raise fatal(Code.MANIFEST_INVALID, rule="situ", file=label)
    if raw.get("group_size", contract.GROUP_SIZE) != contract.GROUP_SIZE:
        raise fatal(Code.MANIFEST_INVALID, rule="group-size", file=label, group=contract.GROUP_SIZE)
    pinned = raw.get("pinned", {})
    if not isinstance(pinned, dict):
        raise fatal(Code.MANIFEST_INVALID, rule="pinned", file=label)
    rules = {}
    for section, projs in (
        ("source_tensors", (contract.GATE, contract.UP, contract.DOWN)),
        ("converted_tensors", (contract.FUSED, contract.DOWN)),
    ):
        table = raw[section]
        want = {f"{p}.{s}" for p in projs for s in contract.SUFFIXES}
        if not isinstance(table, dict) or set(table) != want:
            found = sorted(table) if isinstance(table, dict) else table
            raise fatal(
                Code.MANIFEST_INVALID,
                rule="section-keys",
                file=label,
                section=section,
                want=sorted(want),
                found=found,
            )
        rules[section] = {}
        for key, rule in table.items():
            shape = rule.get("shape") if isinstance(rule, dict) else None
            if (
                not isinstance(rule, dict)
                or not isinstance(rule.get("dtype"), str)
                or not isinstance(shape, list)
                or not all(isinstance(t, str) and _formula_ok(t, dims) for t in shape)
            ):
                raise fatal(
                    Code.MANIFEST_INVALID, rule="entry", file=label, section=section, key=key
                )
            rules[section][key] = TensorRule(rule["dtype"], tuple(shape))
    if not isinstance(raw["name"], str):
        raise fatal(Code.MANIFEST_INVALID, rule="name", file=label)
    inventory = _parse_inventory(raw["inventory"], label) if "inventory" in raw else None
    return Manifest(
        name=raw["name"],
        sha256=hashlib.sha256(data).hexdigest(),
        dims=dict(dims),
        source_tensors=rules["source_tensors"],
        converted_tensors=rules["converted_tensors"],
        situ_beta=float(situ["beta"]),
        situ_linear_beta=float(situ["linear_beta"]),
        pinned=dict(pinned),
        inventory=inventory,
    )


def _parse_inventory(raw: Any, label: str) -> Inventory:
    def strings(value: Any) -> bool:
        return isinstance(value, list) and all(isinstance(v, str) for v in value)

    if not isinstance(raw, dict):
        raise fatal(Code.MANIFEST_INVALID, rule="inventory", file=label, places=_PLACES)
    aliases, blocks, groups = raw.get("aliases"), raw.get("vision_blocks"), raw.get("groups")
    if (
        not strings(raw.get("dtypes"))
        or not isinstance(aliases, dict)
        or not all(isinstance(v, str) for v in aliases.values())
        or "{L}" not in str(raw.get("layer_prefix"))
        or "{B}" not in str(raw.get("vision_block_prefix"))
        or not (isinstance(blocks, list) and len(blocks) == 2 and isinstance(blocks[0], str))
        or type(blocks[1]) is not int
        or not isinstance(groups, list)
    ):
        raise fatal(Code.MANIFEST_INVALID, rule="inventory", file=label, places=_PLACES)
    parsed = []
    for group in groups:
        if (
            not isinstance(group, dict)
            or group.get("place") not in INVENTORY_PLACES
            or not strings(group.get("names"))
            or not set(group) <= {"place", "names", "when", "unless"}
            or not all(isinstance(group.get(k, ""), str) for k in ("when", "unless"))
        ):
            raise fatal(Code.MANIFEST_INVALID, rule="inventory", file=label, places=_PLACES)
        parsed.append(
            InventoryGroup(
                group["place"], tuple(group["names"]), group.get("when"), group.get("unless")
            )
        )
    return Inventory(
        frozenset(raw["dtypes"]),
        tuple(aliases.items()),
        raw["layer_prefix"],
        raw["vision_block_prefix"],
        (blocks[0], blocks[1]),
        tuple(parsed),
    )


def _formula_ok(term: str, dims: dict) -> bool:
    m = _FORMULA.fullmatch(term)
    return m is not None and m[2] in dims


@dataclass(frozen=True)
class Dims:
    values: dict[str, int]

    def shape(self, formula: tuple[str, ...]) -> tuple[int, ...] | None:
        """The shape a rule asks for; None if a dimension is unknown or does not divide."""
        out = []
        for term in formula:
            m = _FORMULA.fullmatch(term)
            if m is None or m[2] not in self.values:
                return None
            value = self.values[m[2]] * int(m[1] or 1)
            div = int(m[3] or 1)
            if value % div:
                return None
            out.append(value // div)
        return tuple(out)


_VISION_BLOCKS = "vision blocks"  # `_read`'s key for the vision tower's block count
_INTS = "integers"  # `_read`'s key for the fields that are config integers


def _read(
    keys: Iterable[str], inventory: Inventory | None, config: Any
) -> tuple[dict[str, Any], list[Problem]]:
    """Every config field that `keys` and the inventory name, as SGLang reads it, read once
    and together (what follows works on these values alone), and the problems reading the
    `keys` (the MoE rule's own fields are judged once, by `contract.layer_rule`)."""
    keys = set(keys)
    heads = set()
    if inventory is not None:
        dotted = {g.when for g in inventory.groups} | {g.unless for g in inventory.groups}
        heads = {d.partition(".")[0] for d in dotted if d}
        heads |= {"num_hidden_layers", "linear_attn_config"}
    fields = {key: contract.config_value(config, key) for key in keys | heads}
    # Which are config integers, judged here with the rest of the reading.
    fields[_INTS] = {key for key, v in fields.items() if contract.is_config_int(v)}
    problems = contract.config_problems(config, sorted(keys - set(contract.MOE_RULE_FIELDS)))
    if inventory is not None:
        vision = contract.get(config, "vision_config")
        field, default = inventory.vision_blocks
        blocks = contract.get(vision, field, default) if vision is not None else default
        fields[_VISION_BLOCKS] = blocks if type(blocks) is int and blocks >= 0 else default
    return fields, problems


def _dims_read(manifest: Manifest) -> set[str]:
    """The config fields `resolve_dims` judges."""
    return {
        *manifest.dims.values(),
        *manifest.pinned,
        "hidden_act",
        *contract.SITU_CONFIG_KEYS.values(),
    }


def resolve_dims(manifest: Manifest, config: dict) -> tuple[Dims, list[Problem]]:
    """Dimensions from the config as SGLang reads it (`contract.config_value`), checked
    against pinned values, the MXFP4 group size and the manifest's SiTU parameters."""
    fields, problems = _read(_dims_read(manifest), None, config)
    return _dims(manifest, fields, problems)


def _dims(
    manifest: Manifest, fields: Mapping[str, Any], problems: list[Problem]
) -> tuple[Dims, list[Problem]]:
    """`resolve_dims` on the fields `_read` read; adds to `problems`."""
    values = {}
    for symbol, key in manifest.dims.items():
        value = fields[key]
        if key not in fields[_INTS] or value <= 0:
            if key in contract.MOE_RULE_FIELDS:  # judged once, by `contract.layer_rule`
                continue
            problems.append(
                problem(
                    Code.CONFIG_FIELD,
                    rule="positive",
                    file=contract.CONFIG_NAME,
                    key=key,
                    value="missing or null" if value is None else repr(value),
                )
            )
        else:
            values[symbol] = value
    for key, pinned in manifest.pinned.items():
        value = fields[key]
        if type(value) is not type(pinned) or value != pinned:
            problems.append(
                problem(
                    Code.PINNED_MISMATCH,
                    file=contract.CONFIG_NAME,
                    key=key,
                    manifest=manifest.name,
                    want=pinned,
                    value=value,
                )
            )
    for symbol in ("K", "N"):
        value = values.get(symbol)
        if value is not None and value % manifest.group_size:
            problems.append(
                problem(
                    Code.CONFIG_FIELD,
                    rule="group",
                    file=contract.CONFIG_NAME,
                    key=manifest.dims[symbol],
                    group=manifest.group_size,
                    value=value,
                )
            )
    problems.extend(_situ_problems(manifest, fields))
    return Dims(values), problems


def _situ_problems(manifest: Manifest, fields: Mapping[str, Any]) -> list[Problem]:
    """The config's SiTU parameters (`fields`: read by `resolve_dims`) against the manifest's."""
    problems = []
    for field_name, want in (
        ("situ_beta", manifest.situ_beta),
        ("situ_linear_beta", manifest.situ_linear_beta),
    ):
        key = contract.SITU_CONFIG_KEYS[field_name]
        value = fields[key]
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            problems.append(
                problem(
                    Code.SITU_MISMATCH,
                    rule="not-numeric",
                    file=contract.CONFIG_NAME,
                    key=key,
                    want=want,
                    value=value,
                )
            )
        elif float(value) != want:
            problems.append(
                problem(
                    Code.SITU_MISMATCH,
                    rule="value",
                    file=contract.CONFIG_NAME,
                    key=key,
                    manifest=manifest.name,
                    want=want,
                    value=value,
                )
            )
    return problems


# -- the non-expert inventory ---------------------------------------------------------------


def _field(fields: Mapping[str, Any], dotted: str) -> Any:
    """A text-model config value; "a.b" reads key b of the object a (e.g. linear_attn_config)."""
    head, _, rest = dotted.partition(".")
    value = fields.get(head)
    for key in filter(None, rest.split(".")):
        value = value.get(key) if isinstance(value, Mapping) else None
    return value


def _kda_layers(fields: Mapping[str, Any], layers: int) -> set[int]:
    """SGLang 0.5.23 (configs/kimi_linear.py `is_kda_layer`): layer i is a KDA layer when
    i + 1 is in linear_attn_config.kda_layers; every other layer is MLA (full attention)."""
    kda = _field(fields, "linear_attn_config.kda_layers")
    ids = kda if isinstance(kda, list) else []
    return {i for i in range(layers) if i + 1 in ids}


def expected_inventory(inventory: Inventory, config: Any) -> dict[str, str]:
    """Every non-expert tensor name the config's model loads -> what requires it."""
    fields, _ = _read((), inventory, config)
    return _required(inventory, fields, contract.moe_layer_ids(config)[0])


def _required(inventory: Inventory, fields: Mapping[str, Any], moe_layers: list[int]) -> dict:
    """`expected_inventory` on the fields `_read` read, with the config's MoE layers."""
    moe = set(moe_layers)
    blocks = fields[_VISION_BLOCKS]
    layers = fields["num_hidden_layers"]
    layers = layers if type(layers) is int and layers > 0 else 0
    kda = _kda_layers(fields, layers)
    places: dict[str, list[int]] = {
        "model": [0],
        "layer": list(range(layers)),
        "kda": sorted(kda),
        "mla": [i for i in range(layers) if i not in kda],
        "moe": sorted(moe),
        "dense": [i for i in range(layers) if i not in moe],
        "vision_block": list(range(blocks)),
    }
    expected: dict[str, str] = {}
    for group in inventory.groups:
        if group.when is not None and not _field(fields, group.when):
            continue
        if group.unless is not None and _field(fields, group.unless):
            continue
        for i in places[group.place]:
            if group.place == "model":
                prefix = ""
            elif group.place == "vision_block":
                prefix = inventory.vision_block_prefix.replace("{B}", str(i))
            else:
                prefix = inventory.layer_prefix.replace("{L}", str(i))
            for name in group.names:
                expected[prefix + name] = group.place
    return expected


# -- one checkpoint's expectation -----------------------------------------------------------


class ExpertSpec(NamedTuple):
    """What one routed-expert tensor ("proj.suffix") must be under a config."""

    dtype: str
    shape: tuple[int, ...] | None  # None when a dimension is unknown (reported already)


@dataclass(frozen=True)
class Expectation:
    """What a checkpoint with a given config must hold under a manifest, resolved once:
    the dimensions, each routed-expert tensor's dtype and shape, the MoE layers, and the
    non-expert tensors the model loads. Validation reads it and never calls back here."""

    manifest: str  # the manifest's name, for messages
    dims: Dims
    tensors: dict[str, ExpertSpec]  # "proj.suffix" -> what it must be
    layers: contract.LayerRule
    # False when the config asks for more than the checkpoint's tensors could hold: nothing
    # of that size is built, and the tensors are not judged.
    bounded: bool = True
    inventory: Inventory | None = None
    required: dict[str, str] = field(default_factory=dict)  # non-expert name -> its place
    # every non-expert tensor's shape from the config (under every manifest)
    shapes: ShapeRule | None = None


def expect(
    manifest: Manifest, config: Any, bound: int | None, converted: bool = False
) -> tuple[Expectation, list[Problem]]:
    """The config read once under the manifest (`bound`: the tensors the checkpoint holds,
    see `contract.layer_rule`), and every problem found reading it."""
    inventory = manifest.inventory
    keys = _dims_read(manifest)
    fields, problems = _read(keys, inventory, config)
    rule, rule_problems = contract.layer_rule(config, bound)
    e_field = manifest.dims["E"]
    experts = fields[e_field] if e_field in fields[_INTS] and fields[e_field] > 0 else 0
    too_big = contract.bound_problem(e_field, experts, bound)
    dims, problems = _dims(manifest, fields, problems)
    if too_big and not any(p.code is Code.CONFIG_BOUND for p in rule_problems):
        rule_problems.append(too_big)  # E as the manifest names it (the rule bounded `num_experts`)
    bounded = not any(p.code is Code.CONFIG_BOUND for p in rule_problems)
    required = _required(inventory, fields, rule.moe) if inventory and bounded else {}
    rules = manifest.rules(converted)
    tensors = {key: ExpertSpec(r.dtype, dims.shape(r.shape)) for key, r in rules.items()}
    shapes = shape_rule(config, None if rule_problems else rule.moe)
    expectation = Expectation(
        manifest.name, dims, tensors, rule, bounded, inventory, required, shapes
    )
    return expectation, problems + rule_problems
