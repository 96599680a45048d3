"""The w31 data contract: what a converted checkpoint is, in one place.

Everything the converter writes and everything `verify`, the SGLang adapter and `serve`
check against is defined here, free of SGLang, torch and FlashInfer:

- the expert-name grammar (`<prefix>experts.<E>.<w1|w2|w3|w31>.<weight_packed|weight_scale>`,
  matched in full, ASCII digits only, no leading zeros) and `w31 = w3 ++ w1` by name;
- which layers are MoE layers (SGLang 0.5.23's Kimi-K3 rule);
- the `kimi_w31` config block and the fail-closed `quantization_config` wrapper.

Configs may be plain dicts (config.json) or transformers config objects: every read goes
through `get`, so the adapter and the converter share the same rules.
"""

from __future__ import annotations

import copy
import functools
import math
import re
from collections.abc import Callable, Iterable, Mapping
from itertools import repeat
from typing import Any, NamedTuple

from .errors import Problem, problem
from .reasons import Code

# -- the config block and the wrapper -----------------------------------------------------

BLOCK_KEY = "kimi_w31"
WRAPPER_METHOD = "kimi_w31"
FORMAT_VERSION = 1
FORMAT_VERSIONS = (1,)
GROUP_SIZE = 32
SITU_CONFIG_KEYS = {
    "situ_beta": "activation_situ_beta",
    "situ_linear_beta": "activation_situ_linear_beta",
}
# The fields every consumer relies on, with their only allowed values (betas: from config).
FIXED_FIELDS: dict[str, Any] = {
    "fc1_layout": "w31",
    "fc1_order": ["up", "gate"],
    "activation": "situ",
    "weight_format": "mxfp4",
    "group_size": GROUP_SIZE,
}
# The eight fields every consumer relies on (more, informational ones may follow them).
REQUIRED_FIELDS = ("format_version", *FIXED_FIELDS, *SITU_CONFIG_KEYS)
# File names of a converted checkpoint (a Hugging Face-style repo).
CONFIG_NAME = "config.json"
INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
CHECKSUMS_NAME = "kimi_w31.checksums.json"
CHECKSUMS_FORMAT = 1  # the checksums file's "format_version"
# The output's state folder (records of the run; never published as part of the model).
STATE_DIR = ".kimi_w31"


def get(cfg: Any, key: str, default: Any = None) -> Any:
    if isinstance(cfg, Mapping):
        return cfg.get(key, default)
    return getattr(cfg, key, default)


def _set(cfg: Any, key: str, value: Any) -> None:
    if isinstance(cfg, dict):
        cfg[key] = value
    else:
        setattr(cfg, key, value)


def text_config(cfg: Any) -> Any:
    """The (sub-)config holding the language model's hyper-parameters (VL models nest it).

    Structural only (where a `quantization_config` or the block may sit); what a field means
    is `config_value`'s business."""
    inner = get(cfg, "text_config")
    if inner is None or (isinstance(cfg, Mapping) and not isinstance(inner, Mapping)):
        return cfg
    return inner


# -- the config as SGLang 0.5.23 reads it ---------------------------------------------------
#
# SGLang builds Kimi-K3's text model from `text_config` alone: configs/kimi_k3.py KimiK3Config
# (model_type "kimi_k3") makes `KimiLinearConfig(**text_config)`, or `KimiLinearConfig()` when
# there is none; a flat config (model_type "kimi_linear", the text-only form) is a
# KimiLinearConfig itself. A field missing there takes KimiLinearConfig's default; a top-level
# copy beside a text_config is never read by the model. These are the defaults of the fields
# the contract reads (held to SGLang by tests/sglang/test_config_differential.py).
TEXT_DEFAULTS: dict[str, Any] = {
    "num_hidden_layers": 32,
    "first_k_dense_replace": 0,
    "moe_layer_freq": 1,
    "num_experts": None,
    "num_experts_per_token": None,
    "moe_intermediate_size": None,
    "routed_expert_hidden_size": None,
    "hidden_size": 4096,
    "hidden_act": "silu",
    "activation_situ_beta": None,
    "activation_situ_linear_beta": None,
    "num_nextn_predict_layers": 0,
    # the fields the non-expert shapes read (`shapes.py`)
    "vocab_size": 163840,
    "intermediate_size": 11008,
    "num_attention_heads": 32,
    "q_lora_rank": None,
    "kv_lora_rank": None,
    "qk_nope_head_dim": None,
    "qk_rope_head_dim": None,
    "v_head_dim": None,
    "num_shared_experts": 0,
    "latent_moe_use_norm": False,
    "mla_use_output_gate": False,
    "attn_res_block_size": None,
    "linear_attn_config": None,
}
# A second key for the same value; the two must agree (`config_problems`). PretrainedConfig
# applies extra keyword arguments after the class's own: `num_experts_per_tok`, the
# attribute_map alias of `num_experts_per_token`, wins when given. `n_routed_experts` sizes
# the experts and the router (models/kimi_k3.py KimiK3MoE, deepseek_v2.py MoEGate), while
# `num_experts` alone decides whether there are experts at all and which ids the loader maps.
ALIASES = {"num_experts": "n_routed_experts", "num_experts_per_token": "num_experts_per_tok"}
ALIAS_WINS = {"num_experts_per_token"}
KIMI_K3_MODEL_TYPE = "kimi_k3"
KIMI_LINEAR_MODEL_TYPE = "kimi_linear"
# KimiK3Config answers these from its text_config (read-only properties): a top-level one
# stops SGLang before it has a config at all.
KIMI_K3_PROPERTIES = ("hidden_size", "vocab_size")


def sglang_text_fields(cfg: Any) -> Any:
    """The mapping (or config object) SGLang builds the text model from."""
    if not isinstance(cfg, Mapping):
        return text_config(cfg)  # a config object: SGLang's own classes already resolved it
    if cfg.get("model_type") == KIMI_LINEAR_MODEL_TYPE:
        return cfg  # KimiLinearConfig reads its own top level (a text_config there is inert)
    if "text_config" in cfg:
        inner = cfg["text_config"]
        return {} if inner is None else inner
    return {} if cfg.get("model_type") == KIMI_K3_MODEL_TYPE else cfg


def config_value(cfg: Any, key: str) -> Any:
    """What SGLang's Kimi-K3 model makes of config field `key`: from the text model's
    config alone, its alias when given, else KimiLinearConfig's default."""
    inner = sglang_text_fields(cfg)
    if not isinstance(inner, Mapping):
        return get(inner, key, TEXT_DEFAULTS.get(key))
    alias = ALIASES.get(key)
    if key in ALIAS_WINS and alias in inner:
        return inner[alias]
    return inner.get(key, TEXT_DEFAULTS.get(key))


def _same(a: Any, b: Any) -> bool:
    """Equal as JSON values (so 8 and 8.0, 1 and true, are not the same field value)."""
    return type(a) is type(b) and a == b


def config_problems(cfg: Any, keys: Any, whole: bool = False) -> list[Problem]:
    """Every place the config says two things about a field the contract reads (`keys`):
    an alias that disagrees with its field, or a top-level copy that disagrees with what the
    model reads. `whole`: also what stops SGLang reading the config at all (said once, by
    `layer_rule`)."""
    if not isinstance(cfg, Mapping):
        return []
    inner = sglang_text_fields(cfg)
    if not isinstance(inner, Mapping):
        if not whole:
            return []
        return [
            problem(
                Code.CONFIG_FIELD,
                rule="text-config",
                file=CONFIG_NAME,
                kind=type(inner).__name__,
            )
        ]
    problems = [
        problem(
            Code.CONFIG_FIELD,
            rule="top-level",
            file=CONFIG_NAME,
            key=key,
            model_type=KIMI_K3_MODEL_TYPE,
            value=cfg[key],
        )
        for key in KIMI_K3_PROPERTIES
        if whole and key in cfg and cfg.get("model_type") == KIMI_K3_MODEL_TYPE
    ]
    for key in keys:
        value = config_value(cfg, key)
        alias = ALIASES.get(key)
        if alias in inner and key in inner and not _same(inner[key], inner[alias]):
            problems.append(_conflict(f"{_where(cfg)}{key}", f"{_where(cfg)}{alias}", inner))
        if inner is cfg:
            continue
        for name in (key, alias):
            if name in cfg and name is not None and not _same(cfg[name], value):
                problems.append(
                    problem(
                        Code.CONFIG_CONFLICT,
                        rule="top-level",
                        file=CONFIG_NAME,
                        key=name,
                        want=value,
                        value=cfg[name],
                    )
                )
    return problems


def _where(cfg: Mapping) -> str:
    return "" if sglang_text_fields(cfg) is cfg else "text_config."


def _conflict(first: str, second: str, inner: Mapping) -> Problem:
    a, b = first.rsplit(".", 1)[-1], second.rsplit(".", 1)[-1]  # as `inner` spells them
    return problem(
        Code.CONFIG_CONFLICT,
        rule="alias",
        file=CONFIG_NAME,
        first=first,
        second=second,
        first_value=inner[a],
        second_value=inner[b],
    )


def is_config_int(value: Any) -> bool:
    """A config integer is a JSON integer: not 8.0, not true (SGLang would index a range
    with one, or take `true` for 1)."""
    return type(value) is int


def _holders(cfg: Any) -> list[Any]:
    """The config and its text config (once if they are the same object)."""
    inner = text_config(cfg)
    return [cfg] if inner is cfg else [cfg, inner]


def make_block(situ_beta: float, situ_linear_beta: float, **extra: Any) -> dict:
    """The `kimi_w31` block: the contract's fields, then informational ones (`extra`)."""
    return {
        "format_version": FORMAT_VERSION,
        **copy.deepcopy(FIXED_FIELDS),
        "situ_beta": float(situ_beta),
        "situ_linear_beta": float(situ_linear_beta),
        **extra,
    }


def converted_config(source_config: dict, block: dict) -> dict:
    """The source config with exactly two changes: every quantization_config wrapped, the
    block added at the top level."""
    config = copy.deepcopy(source_config)
    for holder in _holders(config):
        original = holder.get("quantization_config")
        if isinstance(original, dict):
            holder["quantization_config"] = {"quant_method": WRAPPER_METHOD, "base": original}
    config[BLOCK_KEY] = copy.deepcopy(block)
    return config


def unwrap_config(converted: dict) -> dict:
    """What the source config must have been, given a converted one (a copy)."""
    config = copy.deepcopy(converted)
    config.pop(BLOCK_KEY, None)
    unwrap_quantization_config(config)
    return config


def unwrap_quantization_config(cfg: Any) -> int:
    """Replace each `{"quant_method": "kimi_w31", "base": X}` by X, in place; count them.

    Raises ContractError for a wrapper without a usable base (or wrapped twice).
    """
    count = 0
    for holder in _holders(cfg):
        qc = get(holder, "quantization_config")
        if isinstance(qc, Mapping) and qc.get("quant_method") == WRAPPER_METHOD:
            _set(holder, "quantization_config", unwrap_one(qc))
            count += 1
    return count


class ContractError(ValueError):
    """A config that breaks the contract where no list of problems can be returned."""

    def __init__(self, problem: Problem) -> None:
        super().__init__(problem.render())
        self.problem = problem


def unwrap_one(qc: Mapping) -> dict:
    """`{"quant_method": "kimi_w31", "base": X}` -> X; ContractError if X is not usable."""
    problems = _wrapper_problems(qc)
    if problems:
        raise ContractError(problems[0])
    return dict(qc["base"])


def _wrapper_problems(qc: Mapping) -> list[Problem]:
    base = qc.get("base")
    if not isinstance(base, Mapping) or not isinstance(base.get("quant_method"), str):
        return [
            problem(
                Code.NOT_WRAPPED, rule="no-base", file=CONFIG_NAME, method=WRAPPER_METHOD, base=base
            )
        ]
    if base["quant_method"] == WRAPPER_METHOD:
        return [problem(Code.NOT_WRAPPED, rule="twice", file=CONFIG_NAME, method=WRAPPER_METHOD)]
    return []


def marks(cfg: Any) -> list[str]:
    """Where a config already carries this contract's markers (a converted or tampered one)."""
    found = []
    for where, holder in zip(("", "text_config."), _holders(cfg), strict=False):
        if get(holder, BLOCK_KEY) is not None:
            found.append(f"{where}{BLOCK_KEY}")
        qc = get(holder, "quantization_config")
        if isinstance(qc, Mapping) and qc.get("quant_method") == WRAPPER_METHOD:
            found.append(f"{where}quantization_config.quant_method = {WRAPPER_METHOD!r}")
    return found


def find_block(*configs: Any) -> Any:
    """The first `kimi_w31` block on the given configs or their text configs, or None."""
    for cfg in configs:
        if cfg is None:
            continue
        for holder in _holders(cfg):
            block = get(holder, BLOCK_KEY)
            if block is not None:
                return block
    return None


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def check_block(cfg: Any) -> list[Problem]:
    """Every problem with the `kimi_w31` block and its agreement with the model config."""
    block = find_block(cfg)

    if block is None:
        return [problem(Code.BLOCK_MISSING, rule="absent", file=CONFIG_NAME)]
    if not isinstance(block, Mapping):
        kind = type(block).__name__
        return [problem(Code.BLOCK_FIELD, rule="not-object", file=CONFIG_NAME, kind=kind)]
    problems = []
    version = block.get("format_version")
    if type(version) is not int or version not in FORMAT_VERSIONS:
        problems.append(
            problem(
                Code.BLOCK_FIELD,
                rule="format-version",
                file=CONFIG_NAME,
                known=" or ".join(map(str, FORMAT_VERSIONS)),
                value=version,
            )
        )
    for key, want in FIXED_FIELDS.items():
        found = block.get(key)
        if found != want or type(found) is not type(want):
            problems.append(
                problem(
                    Code.BLOCK_FIELD,
                    rule="value",
                    file=CONFIG_NAME,
                    key=key,
                    want=want,
                    value=found,
                )
            )
    for key, config_key in SITU_CONFIG_KEYS.items():
        value = block.get(key)
        if not _is_number(value) or not math.isfinite(value) or value <= 0:
            problems.append(
                problem(Code.BLOCK_FIELD, rule="positive", file=CONFIG_NAME, key=key, value=value)
            )
            continue
        in_config = config_value(cfg, config_key)
        if not _is_number(in_config) or float(in_config) != float(value):
            problems.append(
                problem(
                    Code.BLOCK_MISMATCH,
                    rule="config",
                    file=CONFIG_NAME,
                    key=key,
                    config_key=config_key,
                    want=in_config,
                    value=value,
                )
            )
    act = config_value(cfg, "hidden_act")
    if act != FIXED_FIELDS["activation"]:
        problems.append(problem(Code.BLOCK_MISMATCH, rule="activation", file=CONFIG_NAME, act=act))
    return problems


def check_wrapped(cfg: Any) -> list[Problem]:
    """Every quantization_config is wrapped (so loaders without the adapter refuse it)."""
    problems, seen = [], 0
    for holder in _holders(cfg):
        qc = get(holder, "quantization_config")
        if qc is None:
            continue
        seen += 1
        if not isinstance(qc, Mapping) or qc.get("quant_method") != WRAPPER_METHOD:
            found = qc.get("quant_method") if isinstance(qc, Mapping) else qc
            problems.append(
                problem(
                    Code.NOT_WRAPPED,
                    rule="not-wrapped",
                    file=CONFIG_NAME,
                    method=WRAPPER_METHOD,
                    value=found,
                )
            )
        else:
            problems.extend(_wrapper_problems(qc))
    if not seen:
        problems.append(problem(Code.NO_QUANTIZATION_CONFIG, rule="output", file=CONFIG_NAME))
    return problems


# -- the expert-name grammar --------------------------------------------------------------

GATE, UP, DOWN, FUSED = "w1", "w3", "w2", "w31"
SUFFIXES = ("weight_packed", "weight_scale")
# How every name of a w1/w3 expert tensor ends (a cheap test before the full grammar).
FUSED_HALF_ENDINGS = tuple(f".{proj}.{suffix}" for proj in (GATE, UP) for suffix in SUFFIXES)


# A routed-expert tensor name's tail after "experts.": matched in full, ASCII only, expert
# ids without leading zeros (so "01" cannot alias "1"). Nothing else under an `experts`
# path component is accepted (see `expert_prefix_and_tail`).
@functools.cache
def _tail_pattern(suffixes: tuple[str, ...]) -> re.Pattern[str]:
    alternatives = "|".join(map(re.escape, suffixes))
    return re.compile(rf"(0|[1-9][0-9]*)\.(w1|w2|w3|w31)\.({alternatives})", re.ASCII)


_LAYER = re.compile(r"(?:^|\.)layers\.([^.]*)\.", re.ASCII)
_DECIMAL = re.compile(r"0|[1-9][0-9]*", re.ASCII)


class ExpertTail(NamedTuple):
    """A routed-expert name's tail "E.proj.suffix" taken apart."""

    expert: int
    proj: str
    suffix: str


class ExpertName(NamedTuple):
    prefix: str  # everything before "experts." ("" or ending with ".")
    expert: int
    proj: str
    suffix: str

    def with_proj(self, proj: str) -> str:
        return expert_name(self.prefix, self.expert, proj, self.suffix)


def expert_name(prefix: str, expert: int, proj: str, suffix: str) -> str:
    return f"{prefix}experts.{expert}.{proj}.{suffix}"


def is_expert_name(name: str) -> bool:
    """Whether `expert_prefix_and_tail` splits it, without building the parts (~500k names)."""
    return ".experts." in name or name.startswith("experts.")


def expert_prefix_and_tail(name: str) -> tuple[str, str] | None:
    """(prefix, tail) for a name with an `experts` path component followed by more, else None.

    Every such name must be a routed-expert tensor (`parse_expert_tail(tail)` not None);
    the split is on the last `experts` component, so a prefix may itself contain one.
    """
    i = name.rfind(".experts.")
    if i >= 0:
        return name[: i + 1], name[i + 9 :]
    if name.startswith("experts."):
        return "", name[8:]
    return None


def parse_expert_tail(tail: str, suffixes: tuple[str, ...] = SUFFIXES) -> ExpertTail | None:
    """A tail "E.proj.suffix" under the grammar (`suffixes`: a loader that renames
    `weight_packed` to `weight` passes its own list), else None."""
    m = _tail_pattern(suffixes).fullmatch(tail)
    return None if m is None else ExpertTail(int(m[1]), m[2], m[3])


def parse_expert_name(name: str) -> ExpertName | None:
    """The name taken apart if it is a routed-expert tensor under the grammar, else None."""
    split = expert_prefix_and_tail(name)
    parsed = split and parse_expert_tail(split[1])
    return ExpertName(split[0], *parsed) if parsed else None


E8M0_DTYPE = "F8_E8M0"  # safetensors' own E8M0 dtype


def is_e8m0_scale(name: str, dtype: str, every_u8_scale: bool = False) -> bool:
    """Whether a tensor holds E8M0 scale bytes, where 0xFF (NaN) is not a valid scale: the
    routed experts' U8 `weight_scale` tensors (MXFP4 group scales), any tensor of
    safetensors' E8M0 dtype and, with `every_u8_scale`, every other U8 `*.weight_scale`.
    Never a scale of another dtype (F32, BF16 scales are real numbers)."""
    if dtype == E8M0_DTYPE:
        return True
    if dtype != "U8" or not name.endswith(".weight_scale"):
        return False
    return every_u8_scale or parse_expert_name(name) is not None


def layer_of(prefix: str) -> int | None:
    """The layer index in an expert prefix (the first `layers.<i>.` component, as SGLang's
    loader reads it); None if there is none or it is not a plain decimal."""
    m = _LAYER.search(prefix)
    if m is None or not _DECIMAL.fullmatch(m[1]):
        return None
    return int(m[1])


def source_halves(name: str) -> tuple[str, str] | None:
    """For an output `w31` tensor name: the (up = w3, gate = w1) source names it concatenates."""
    parsed = parse_expert_name(name)
    if parsed is None or parsed.proj != FUSED:
        return None
    return parsed.with_proj(UP), parsed.with_proj(GATE)


# -- SGLang's name mapping: which model parameter a checkpoint name loads into ----------------

# SGLang 0.5.23 folds names before it looks a parameter up (models/kimi_k3.py): the VL
# wrapper's `hf_to_sglang_mapper` replaces the first "block_sparse_moe" with "mlp", then a
# leading "language_model.layers." with "language_model.model.layers."; a name holding
# "vision_tower" or "mm_projector" then loads by that name; any other has every
# "language_model." removed and reaches the text model, where (after the adapter splits a
# w31 into its w3 and w1 halves) every "weight_packed" becomes "weight". Two names with one
# key reach one parameter: the one loaded last wins, so which one is served depends on the
# shard order. Held to SGLang's own loader by tests/sglang/test_name_mapping_differential.py.
_SERVED_SUBSTR = ("block_sparse_moe", "mlp")
_SERVED_PREFIX = ("language_model.layers.", "language_model.model.layers.")
_SERVED_VISION = ("vision_tower", "mm_projector")
_SERVED_SUFFIXES = ("weight", "weight_scale")


def served_keys(name: str) -> tuple[str, ...]:
    """The model parameter(s) a checkpoint tensor name loads into under SGLang's mapping
    (a converted w31: its up and gate halves).

    A routed expert's name is its layer's head, `.experts.`, and a plain tail: the mapping
    acts on the two apart, and the real model's ~500k names share a few hundred heads and a
    few thousand tails, so both are cached (`_served_keys_whole` is the rule itself; a test
    holds the two equal)."""
    head, mark, tail = name.partition(".experts.")
    if mark:
        mapped_head, tails = _served_head(head), _served_expert_tails(tail)
        if mapped_head is not None and tails is not None:
            return tuple(f"{mapped_head}.experts.{t}" for t in tails)
    return _served_keys_whole(name)


# What, in a head or a tail, lets the mapping act across the `.experts.` between them.
_HEAD_UNSAFE = ("vision_tower", "mm_projector", ".w31.")
_TAIL_UNSAFE = ("experts.", "block_sparse_moe", "vision_tower", "mm_projector", "language_model")


@functools.lru_cache(maxsize=4096)
def _served_head(head: str) -> str | None:
    if any(u in head for u in _HEAD_UNSAFE) or head.endswith("language_model"):
        return None
    if _SERVED_PREFIX[0].startswith(head + "."):  # the prefix would reach past the head
        return None
    (key,) = _served_keys_whole(head)
    return key


@functools.lru_cache(maxsize=65536)
def _served_expert_tails(tail: str) -> tuple[str, ...] | None:
    if any(u in tail for u in _TAIL_UNSAFE):
        return None
    return _served_tails(tail.replace("weight_packed", "weight"))


def _served_keys_whole(name: str) -> tuple[str, ...]:
    key = name
    old, new = _SERVED_SUBSTR
    if old in key:
        key = key.replace(old, new, 1)
    old, new = _SERVED_PREFIX
    if key.startswith(old):
        key = new + key[len(old) :]
    if any(v in key for v in _SERVED_VISION):
        return (key,)
    # The rename commutes with the split, which reads either spelling (adapter/split.py).
    key = key.replace("language_model.", "").replace("weight_packed", "weight")
    split = expert_prefix_and_tail(key) if f".{FUSED}." in key else None
    if split is None:
        return (key,)
    return tuple(split[0] + "experts." + tail for tail in _served_tails(split[1]))


@functools.lru_cache(maxsize=65536)
def _served_tails(tail: str) -> tuple[str, ...]:
    """A routed-expert tail as the loader receives it: a w31's two halves, up first. Cached:
    the real model's ~500k names share a few thousand tails."""
    parsed = parse_expert_tail(tail, _SERVED_SUFFIXES)
    if parsed is None or parsed.proj != FUSED:
        return (tail,)
    return tuple(f"{parsed.expert}.{p}.{parsed.suffix}" for p in (UP, GATE))


def name_collisions(names: Iterable[str]) -> list[tuple[str, str, str]]:
    """(first name, second name, parameter) for every name that reaches a parameter an
    earlier name (in sorted order) already reaches: each pair once.

    Most checkpoints have none: `_may_collide` rules that out from the names' heads and
    tails (the real model's ~500k names in a fraction of the rule's time); only where it
    cannot does `_collisions_in_order`, the rule itself, run (a test holds the two equal)."""
    unique = set(names)
    return _collisions_in_order(unique) if _may_collide(unique) else []


def _may_collide(names: set[str]) -> bool:
    """False only where no two names reach one parameter; True may be a false alarm.

    A routed expert's parameter is its mapped head, `.experts.`, and a mapped tail. Where
    the heads present map one-to-one and the tails present reach disjoint parameters, no
    two experts meet; the few other names are then checked against them key by key. The
    heads and tails are a few thousand distinct strings, split from the names in C calls."""
    experts = [n for n in names if ".experts." in n]
    others = names.difference(experts)
    if experts:
        heads, _, tails = zip(*map(str.partition, experts, repeat(".experts.")), strict=True)
        heads, tails = set(heads), set(tails)
    else:
        heads, tails = set(), set()
    mapped_heads = {_served_head(h) for h in heads}
    if None in mapped_heads or len(mapped_heads) != len(heads):
        return True
    if any(f"{h}.experts.".find(".experts.") != len(h) for h in mapped_heads):
        return True  # a key that would not split back at its head: the rule decides
    mapped_tails: set[str] = set()
    count = 0
    for tail in tails:
        keys = _served_expert_tails(tail)
        if keys is None:
            return True
        count += len(keys)
        mapped_tails.update(keys)
    if len(mapped_tails) != count:
        return True
    seen: set[str] = set()
    for name in others:
        for key in served_keys(name):
            head, mark, tail = key.partition(".experts.")
            if key in seen or (mark and head in mapped_heads and tail in mapped_tails):
                return True
            seen.add(key)
    return False


def _collisions_in_order(names: Iterable[str]) -> list[tuple[str, str, str]]:
    owner: dict[str, str] = {}
    found: list[tuple[str, str, str]] = []
    for name in sorted(names):
        for key in served_keys(name):
            first = owner.setdefault(key, name)
            if first != name:
                found.append((first, name, key))
                break
    return found


def collision_problems(names: Iterable[str], file_of: Callable[[str], str | None]) -> list:
    """A `name-collision` problem per name that reaches an earlier name's parameter."""
    return [
        problem(Code.NAME_COLLISION, file=file_of(second), tensor=second, first=first,
                second=second, key=key)
        for first, second, key in name_collisions(names)
    ]  # fmt: skip


# -- which layers are MoE layers ------------------------------------------------------------

# SGLang 0.5.23 (models/kimi_k3.py `_is_moe_layer`): layer i of num_hidden_layers is a MoE
# layer when the model has experts (num_experts set), i >= first_k_dense_replace and
# i % moe_layer_freq == 0, every field read as `config_value` reads it. Layers from
# num_hidden_layers on are never built: `load_weights` skips their tensors. The
# num_nextn_predict_layers layers declared there (MTP) are stored but not served; their
# experts, where a checkpoint has them, are converted like any MoE layer's.
# Fields the rule reads, with the least value each may take.
MOE_RULE_FIELDS = {
    "num_hidden_layers": 1,
    "num_experts": 1,
    "first_k_dense_replace": 0,
    "moe_layer_freq": 1,
    "num_nextn_predict_layers": 0,
}


class LayerRule(NamedTuple):
    moe: list[int]  # layers SGLang builds as MoE layers: every expert must be there
    extra: list[int]  # declared layers past num_hidden_layers: experts allowed, not required


def layer_rule(cfg: Any, bound: int | None = None) -> tuple[LayerRule, list[Problem]]:
    """The config's MoE layers and declared extra layers, and every problem reading them.

    `bound`: the number of tensors the checkpoint holds. Each expert of each layer has
    tensors of its own, so (layers x experts) beyond it cannot all be there: refused before
    anything that size is built (a config may claim 10^10 layers).
    """
    problems = config_problems(cfg, MOE_RULE_FIELDS, whole=True)
    values: dict[str, int] = {}
    for key, minimum in MOE_RULE_FIELDS.items():
        value = config_value(cfg, key)
        if not is_config_int(value) or value < minimum:
            shown = "missing or null" if value is None else repr(value)
            problems.append(
                problem(
                    Code.CONFIG_FIELD,
                    rule="num-experts",
                    file=CONFIG_NAME,
                    key=key,
                    minimum=minimum,
                    value=shown,
                )
                if key == "num_experts"
                else problem(
                    Code.CONFIG_FIELD,
                    rule="integer",
                    file=CONFIG_NAME,
                    key=key,
                    minimum=minimum,
                    value=shown,
                )
            )
        else:
            values[key] = value
    freq = values.get("moe_layer_freq", 1)
    first = -(-values.get("first_k_dense_replace", 0) // freq) * freq  # a multiple of freq
    layers = values.get("num_hidden_layers", 0)
    count = max(0, -(-(layers - first) // freq))  # len(range(first, layers, freq)), unbuilt
    experts, extra = values.get("num_experts", 0), values.get("num_nextn_predict_layers", 0)
    # Judged even when other fields are wrong: callers build nothing from a refused size.
    too_big = bound_problem(
        "(MoE layers + num_nextn_predict_layers) x num_experts",
        (count + extra) * experts,
        bound,
        f"({count} + {extra}) x {experts}",
    ) or bound_problem("num_experts", experts, bound)
    if too_big is not None:
        return LayerRule([], []), [*problems, too_big]
    if problems:
        return LayerRule([], []), problems
    return LayerRule(list(range(first, layers, freq)), list(range(layers, layers + extra))), []


def bound_problem(what: str, value: int, bound: int | None, found: str = "") -> Problem | None:
    """A CONFIG_BOUND problem if `value` (a count of tensors the config asks for) is above
    `bound` (the tensors the checkpoint holds), else None."""
    if bound is None or value <= bound:
        return None
    return problem(
        Code.CONFIG_BOUND, file=CONFIG_NAME, field=what, bound=bound, value=found or value
    )


def moe_layer_ids(cfg: Any, bound: int | None = None) -> tuple[list[int], list[Problem]]:
    """The MoE layer indices the config describes, and any problem reading the fields."""
    rule, problems = layer_rule(cfg, bound)
    return rule.moe, problems


# -- file names of a checkpoint ---------------------------------------------------------------
# A hidden path (any part starting with ".") is not part of a checkpoint: loaders read only
# what the index names, and the state kept beside a checkpoint lives there (the converter's
# `.kimi_w31/`, git's `.git/` and `.gitattributes`, huggingface_hub's `.cache/huggingface/`).
# A converter never copies one and a checker ignores them, saying which. A differential test
# holds this to huggingface_hub's own upload filter: everything it skips, we ignore too.


def not_part_of_checkpoint(rel: str) -> bool:
    """Whether the relative path (a file or folder) is none of the checkpoint's business."""
    return any(part.startswith(".") for part in rel.split("/"))


def file_name_problem(name: object) -> str | None:
    """Why `name` cannot be a file of a converted checkpoint, or None if it can."""
    if not isinstance(name, str) or not name:
        return "is not a file name"
    try:
        name.encode("utf-8")
    except UnicodeEncodeError:  # bytes that are not UTF-8, as the OS hands them over
        return "is not valid UTF-8"
    if any(ord(c) < 0x20 or ord(c) == 0x7F for c in name) or "\\" in name:
        return "holds a control character or a backslash"
    parts = name.split("/")
    if name.startswith("/") or any(p in ("", ".", "..") for p in parts):
        return "is not a plain relative path"
    if any(p.startswith(".") for p in parts):
        return "is hidden (not part of a checkpoint)"
    return None
