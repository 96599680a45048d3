"""Manifests: what a Kimi-K3 checkpoint must look like, checked from headers alone.

A manifest (JSON under `manifests/`) names the config fields that give the dimensions,
the tensor-name rule for routed experts, each expert tensor's dtype and shape as a
formula of those dimensions (before and after conversion), the expected SiTU parameters,
and optionally pinned config values. Checks return every `Problem` found, never just the
first, so a user fixes a bad checkpoint in one round.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import NamedTuple

from .errors import ConvertError, Problem, fail
from .safetensors_format import TensorInfo

DEFAULT_MANIFEST = "kimi-k3"
_FORMULA = re.compile(r"^(?:(\d+)\*)?([A-Za-z_]+)(?:/(\d+))?$")


@dataclass(frozen=True)
class Manifest:
    name: str
    sha256: str
    raw: dict
    pattern: re.Pattern[str]
    tail_cache: dict = field(default_factory=dict, compare=False, repr=False)

    @property
    def group_size(self) -> int:
        return int(self.raw["group_size"])

    @property
    def situ_beta(self) -> float:
        return float(self.raw["situ"]["beta"])

    @property
    def situ_linear_beta(self) -> float:
        return float(self.raw["situ"]["linear_beta"])


def available_manifests() -> list[str]:
    root = resources.files("kimi_w31.manifests")
    return sorted(p.name[:-5] for p in root.iterdir() if p.name.endswith(".json"))


def load_manifest(name_or_path: str) -> Manifest:
    """A bundled manifest by name (`kimi-k3`, `kimi-k3-any`) or a JSON file path."""
    path = Path(name_or_path)
    if path.suffix == ".json" and path.exists():
        data = path.read_bytes()
    else:
        res = resources.files("kimi_w31.manifests") / f"{name_or_path}.json"
        if not res.is_file():
            raise ConvertError(
                [
                    Problem(
                        f"unknown manifest {name_or_path!r}",
                        expected=" or ".join(available_manifests()) + " or a .json path",
                        found=name_or_path,
                    )
                ],
                exit_code=2,
            )
        data = res.read_bytes()
    try:
        raw = json.loads(data)
        pattern = re.compile(raw["expert_pattern"])
    except (json.JSONDecodeError, KeyError, re.error) as exc:
        raise fail(f"manifest is malformed ({exc})", file=str(name_or_path)) from None
    return Manifest(raw["name"], hashlib.sha256(data).hexdigest(), raw, pattern)


def text_config(config: dict) -> dict:
    """The dict holding the language model's hyper-parameters (`text_config` if nested)."""
    inner = config.get("text_config")
    return inner if isinstance(inner, dict) else config


def config_value(config: dict, key: str):
    """Look a key up in `text_config` first, then at the top level."""
    inner = text_config(config)
    if key in inner:
        return inner[key]
    return config.get(key)


class ExpertTensor(NamedTuple):
    """A routed-expert tensor name taken apart: `<prefix>experts.<expert>.<proj>.<suffix>`."""

    prefix: str
    expert: int
    proj: str
    suffix: str
    canonical: bool = True  # False for ids such as "01" that would alias expert 1

    def name(self, proj: str | None = None) -> str:
        return f"{self.prefix}experts.{self.expert}.{proj or self.proj}.{self.suffix}"


def split_expert_name(name: str) -> tuple[str, str] | None:
    r"""("<prefix>", "E.proj.suffix") for a name that may be a routed-expert tensor, else None.

    The one place that decides where an expert name splits: validation and the planner both
    go through it, so they can never disagree on which tensors are experts. The pattern is
    then matched on the short tail only: its `(?:.*\.)?` prefix costs ~3 us a name by
    backtracking, x500k names.
    """
    head, sep, tail = name.rpartition("experts.")
    if not sep or (head and head[-1] != "."):
        return None
    return head, tail


def parse_expert(manifest: Manifest, name: str) -> ExpertTensor | None:
    split = split_expert_name(name)
    if split is None:
        return None
    head, tail = split
    # ~7k distinct tails ("E.wX.suffix") serve 500k names: match each tail once.
    cache = manifest.tail_cache
    parts = cache.get(tail)
    if parts is None:
        m = manifest.pattern.match("experts." + tail)
        if m is None:
            cache[tail] = False
            return None
        digits = m["expert"]
        expert = int(digits)
        parts = cache[tail] = (expert, m["proj"], m["suffix"], str(expert) == digits)
    elif parts is False:
        return None
    return ExpertTensor(head, *parts)


@dataclass
class Dims:
    values: dict[str, int] = field(default_factory=dict)

    def shape(self, formula: list[str]) -> tuple[int, ...] | None:
        out = []
        for term in formula:
            m = _FORMULA.match(term)
            if not m or m[2] not in self.values:
                return None
            value = self.values[m[2]] * int(m[1] or 1)
            div = int(m[3] or 1)
            if value % div:
                return None
            out.append(value // div)
        return tuple(out)


def resolve_dims(manifest: Manifest, config: dict) -> tuple[Dims, list[Problem]]:
    """Read dimensions from the config and check pinned values and SiTU parameters."""
    problems: list[Problem] = []
    dims = Dims()
    for symbol, key in manifest.raw["dims"].items():
        value = config_value(config, key)
        if type(value) is not int or value <= 0:
            problems.append(
                Problem(
                    f"config field {key} is missing or not a positive integer",
                    file="config.json",
                    found=repr(value),
                )
            )
        else:
            dims.values[symbol] = value
    for key, pinned in manifest.raw.get("pinned", {}).items():
        value = config_value(config, key)
        if value != pinned:
            problems.append(
                Problem(
                    f"config field {key} does not match manifest {manifest.name}",
                    file="config.json",
                    expected=repr(pinned),
                    found=repr(value),
                )
            )
    group = manifest.group_size
    for symbol in ("K", "N"):
        value = dims.values.get(symbol)
        if value is not None and value % group:
            problems.append(
                Problem(
                    f"{manifest.raw['dims'][symbol]} is not a multiple of the MXFP4 "
                    f"group size {group}",
                    file="config.json",
                    found=str(value),
                )
            )
    problems.extend(check_situ_config(manifest, config))
    return dims, problems


def check_situ_config(manifest: Manifest, config: dict) -> list[Problem]:
    problems = []
    situ = manifest.raw["situ"]
    for field_name in ("beta", "linear_beta"):
        key = situ["config_keys"][field_name]
        value = config_value(config, key)
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            problems.append(
                Problem(
                    f"config has no numeric {key}",
                    file="config.json",
                    expected=repr(situ[field_name]),
                    found=repr(value),
                )
            )
        elif float(value) != float(situ[field_name]):
            problems.append(
                Problem(
                    f"{key} does not match manifest {manifest.name}",
                    file="config.json",
                    expected=repr(situ[field_name]),
                    found=repr(value),
                )
            )
    return problems


class _Expected(NamedTuple):
    """What the manifest requires of every tensor with one name tail ("E.proj.suffix")."""

    expert: int
    key: str  # "proj.suffix"
    dtype: str
    shape: tuple[int, ...] | None  # None when a dimension is unknown (reported already)


_REJECTED = "rejected"  # a tail no expert tensor may have (bad id, unknown or stale proj)
_UNSEEN = object()


def check_expert_tensors(
    manifest: Manifest,
    dims: Dims,
    tensors: Iterable[tuple[str, TensorInfo]],
    converted: bool,
) -> tuple[dict[str, int], list[Problem]]:
    """Check every routed-expert tensor, given as (file, info) pairs, against the manifest.

    Returns the number of experts found per MoE layer prefix, and every problem: wrong
    dtype/shape, ids out of range, missing partners or experts, and tensors that must not
    exist in this layout (w31 in a source, w1/w3 in an output).

    The real model has ~500k expert tensors but only a few thousand distinct name tails
    ("E.proj.suffix"): each tail is judged once, and a layer whose set of tails is exactly
    the expected one needs no per-expert bookkeeping at all.
    """
    rules = manifest.raw["converted_tensors" if converted else "source_tensors"]
    shapes = {key: dims.shape(rule["shape"]) for key, rule in rules.items()}
    num_experts = dims.values.get("E")
    problems: list[Problem] = []
    tails_by_layer: dict[str, list[str]] = {}
    verdicts: dict[str, _Expected | str | None] = {}
    for file, info in tensors:
        name = info.name
        split = split_expert_name(name)
        if split is None:
            continue
        head, tail = split
        verdict = verdicts.get(tail, _UNSEEN)
        if verdict is _UNSEEN:
            verdict = verdicts[tail] = _judge_tail(manifest, tail, rules, shapes, num_experts)
        if verdict is None:
            continue
        if verdict is _REJECTED:
            problems.append(_rejection(manifest, rules, num_experts, converted, file, name))
            continue
        tails = tails_by_layer.get(head)
        if tails is None:
            tails = tails_by_layer[head] = []
        tails.append(tail)
        if info.dtype != verdict.dtype:
            problems.append(
                Problem(
                    "wrong dtype", file=file, tensor=name, expected=verdict.dtype, found=info.dtype
                )
            )
        if verdict.shape is not None and info.shape != verdict.shape:
            problems.append(
                Problem(
                    "wrong shape",
                    file=file,
                    tensor=name,
                    expected=str(list(verdict.shape)),
                    found=str(list(info.shape)),
                )
            )

    layers: dict[str, int] = {}
    complete = num_experts * len(rules) if num_experts is not None else None
    for prefix, tails in sorted(tails_by_layer.items()):
        # Every accepted tail has an id below E and a key from the rules, so E x rules
        # distinct tails is exactly "every expert with every tensor".
        if len(tails) == complete and len(set(tails)) == complete:
            layers[prefix] = num_experts
            continue
        experts: dict[int, set[str]] = {}
        for tail in tails:
            verdict = verdicts[tail]
            experts.setdefault(verdict.expert, set()).add(verdict.key)
        layers[prefix] = len(experts)
        problems.extend(_missing_in_layer(prefix, experts, rules, num_experts))
    return layers, problems


def _judge_tail(
    manifest: Manifest, tail: str, rules: dict, shapes: dict, num_experts: int | None
) -> _Expected | str | None:
    parsed = parse_expert(manifest, "experts." + tail)
    if parsed is None:
        return None
    key = f"{parsed.proj}.{parsed.suffix}"
    if not parsed.canonical or key not in rules:
        return _REJECTED
    if num_experts is not None and parsed.expert >= num_experts:
        return _REJECTED
    return _Expected(parsed.expert, key, rules[key]["dtype"], shapes[key])


def _rejection(
    manifest: Manifest, rules: dict, num_experts: int | None, converted: bool, file: str, name: str
) -> Problem:
    """Why a routed-expert tensor must not exist (the rare path: worded in full)."""
    parsed = parse_expert(manifest, name)
    assert parsed is not None
    key = f"{parsed.proj}.{parsed.suffix}"
    if not parsed.canonical:  # "experts.01." would alias expert 1 and be lost
        return Problem("expert id is not a plain decimal number", file=file, tensor=name,
                       expected=parsed.name(), found=name)  # fmt: skip
    if key not in rules:
        what = (
            "w1/w3 expert tensor left in a converted checkpoint"
            if converted and parsed.proj in ("w1", "w3")
            else "fused w31 tensor in a source checkpoint"
            if parsed.proj == "w31"
            else "unexpected routed-expert tensor"
        )
        return Problem(what, file=file, tensor=name, expected=" / ".join(sorted(rules)), found=key)
    return Problem("expert id out of range", file=file, tensor=name,
                   expected=f"< {num_experts}", found=str(parsed.expert))  # fmt: skip


def _missing_in_layer(
    prefix: str, experts: dict[int, set[str]], rules: dict, num_experts: int | None
) -> list[Problem]:
    problems = []
    if num_experts is not None:
        missing = sorted(set(range(num_experts)) - set(experts))
        if missing:
            problems.append(
                Problem(
                    f"MoE layer is missing {len(missing)} of {num_experts} experts",
                    tensor=f"{prefix}experts.*",
                    expected=f"ids 0..{num_experts - 1}",
                    found=f"missing {_id_ranges(missing)}",
                )
            )
    for expert, parts in sorted(experts.items()):
        for key in sorted(set(rules) - parts):
            problems.append(
                Problem(
                    "expert tensor is missing (its partners exist)",
                    tensor=f"{prefix}experts.{expert}.{key}",
                )
            )
    return problems


def _id_ranges(ids: list[int]) -> str:
    out, start, prev = [], ids[0], ids[0]
    for i in ids[1:] + [None]:
        if i is not None and i == prev + 1:
            prev = i
            continue
        out.append(str(start) if start == prev else f"{start}-{prev}")
        if i is not None:
            start = prev = i
    return ", ".join(out[:10]) + (" ..." if len(out) > 10 else "")
