"""Every non-expert tensor's shape, derived from the config as SGLang 0.5.23 builds Kimi-K3.

SGLang copies a checkpoint tensor into its parameter, or into its slice of a fused one
(`fused_qkv_a_proj_with_mqa`, `fused_qkvg_proj`, `qkv_conv1d`, `gate_up_proj`), without
checking that the tensor fills it: a `q_a_proj` with half its rows loads into half the
fused rows and leaves the rest unwritten. So the shape of every tensor the model loads is
derived here from the config, the way the model class sizes its parameters, and a checkpoint
whose tensor differs is refused (`inventory-shape`).

One rule for the converter's validation and for `verify`: free of SGLang, torch and the
planner. The model's code it restates: `models/kimi_k3.py` (KimiK3DecoderLayer,
KimiK3DeltaAttention, KimiK3MLAAttention on deepseek_v2.py's DeepseekV2AttentionMLA,
KimiK3MLP, KimiK3MoE and MoEGate, KimiK3LinearModel, KimiK3LinearForCausalLM), and
`models/kimi_k3_vl.py` (KimiK3VisionTower, KimiK3MultiModalProjector), with the defaults of
`configs/kimi_linear.py` and `configs/kimi_k3.py`. tests/sglang/test_shape_differential.py
holds it to the model SGLang builds. A name the rule does not know, a layer past
`num_hidden_layers` (never built) or a dimension the config does not give as a positive
integer: no shape is derived and the tensor is not judged here (docs/inventory.md).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from . import contract
from .errors import Problem, problem
from .reasons import Code

Shape = tuple[int, ...]
_Dims = Mapping[str, Any]

# KimiK3ForConditionalGeneration.hf_to_sglang_mapper: a prefix and a substring SGLang
# renames before it looks a name up; a checkpoint may use either spelling.
PREFIX_ALIAS = ("language_model.layers.", "language_model.model.layers.")
SUBSTRING_ALIAS = ("block_sparse_moe", "mlp")

LAYER_PREFIX = "language_model.model.layers."
VISION_BLOCK_PREFIX = "vision_tower.encoder.blocks."
_INDEXED = re.compile(r"(0|[1-9][0-9]*)\.(.+)", re.ASCII)


def canonical_name(name: str) -> str:
    """The name SGLang's loader looks up (its mapper applied); the checkpoint keeps its own."""
    old, new = PREFIX_ALIAS
    if name.startswith(old):
        name = new + name[len(old) :]
    return name.replace(*SUBSTRING_ALIAS)


# KimiK3VisionConfig's defaults (used when vision_config or a field of it is absent).
VISION_DEFAULTS: dict[str, Any] = {
    "patch_size": 14,
    "init_pos_emb_height": 64,
    "init_pos_emb_width": 64,
    "vt_num_hidden_layers": 27,
    "vt_hidden_size": 1024,
    "vt_intermediate_size": 4096,
    "merge_kernel_size": [2, 2],
    "mm_hidden_size": None,
    "qkv_hidden_size": 1536,
}
# symbol -> text config field (docs/inventory.md §1 names them alike)
_TEXT_SYMBOLS = {
    "H": "hidden_size",
    "V": "vocab_size",
    "I": "intermediate_size",
    "A": "num_attention_heads",
    "R": "kv_lora_rank",
    "Dn": "qk_nope_head_dim",
    "Dr": "qk_rope_head_dim",
    "Dv": "v_head_dim",
    "E": "num_experts",
    "N": "moe_intermediate_size",
}
_KDA_SYMBOLS = {"h": "num_heads", "d": "head_dim", "C": "short_conv_kernel_size"}


def _size(value: Any) -> int | None:
    """A dimension: a JSON integer above zero, else unknown."""
    return value if type(value) is int and value > 0 else None


def _text(config: Any, key: str) -> Any:
    return contract.config_value(config, key)


def _dims(config: Any) -> dict[str, Any]:
    """Every symbol the shapes use, read once from the config (unknown ones left out)."""
    d: dict[str, Any] = {}
    for symbol, key in _TEXT_SYMBOLS.items():
        d[symbol] = _size(_text(config, key))
    q = _text(config, "q_lora_rank")
    d["Q"] = _size(q)
    d["lora"] = q is not None  # SGLang: `q_lora_rank is not None` picks the LoRA-factored Q
    d["S"] = _text(config, "num_shared_experts")
    k = _text(config, "routed_expert_hidden_size")
    d["latent"] = k is not None  # `_uses_latent_moe`
    d["K"] = _size(k)
    d["latent_norm"] = bool(_text(config, "latent_moe_use_norm"))
    d["out_gate"] = bool(_text(config, "mla_use_output_gate"))
    d["res"] = _text(config, "attn_res_block_size") is not None
    linear = _text(config, "linear_attn_config")
    linear = linear if isinstance(linear, Mapping) else {}
    for symbol, key in _KDA_SYMBOLS.items():
        d[symbol] = _size(linear.get(key))
    d["P"] = d["h"] * d["d"] if d["h"] and d["d"] else None  # the KDA projection size
    d["full_gate"] = bool(linear.get("use_full_rank_gate", False))
    vision = contract.get(config, "vision_config")

    def v(key: str) -> Any:
        value = contract.get(vision, key, VISION_DEFAULTS[key]) if vision is not None else None
        return VISION_DEFAULTS[key] if vision is None else value

    d["Hv"] = _size(v("vt_hidden_size"))
    qkv = v("qkv_hidden_size")
    d["Qv"] = d["Hv"] if qkv is None else _size(qkv)
    d["Iv"] = _size(v("vt_intermediate_size"))
    patch = v("patch_size")
    patch = [patch, patch] if type(patch) is int else patch
    pair = isinstance(patch, (list, tuple)) and len(patch) == 2
    d["p"] = tuple(map(_size, patch)) if pair else None
    d["ph"], d["pw"] = _size(v("init_pos_emb_height")), _size(v("init_pos_emb_width"))
    mm = v("mm_hidden_size")
    mm = d["Hv"] if mm is None else _size(mm)
    merge = v("merge_kernel_size")
    ok = isinstance(merge, (list, tuple)) and len(merge) == 2 and all(map(_size, merge))
    d["M"] = mm * merge[0] * merge[1] if mm is not None and ok else None
    d["blocks"] = v("vt_num_hidden_layers")
    return d


# Each entry: relative name -> the shapes SGLang accepts for it (first: the one it builds),
# or None where it builds no parameter for the name under this config. A KeyError or a
# None dimension means a dimension is unknown.
_Rule = Callable[[_Dims], "list[Shape] | None"]


def _one(*dims: Any) -> list[Shape]:
    return [tuple(dims)]


def _a_log(d: _Dims) -> list[Shape]:
    # Parameter [1, 1, h, 1]; the loader takes a 1-D tensor's first h entries (per rank its
    # slice of them). The published checkpoint stores [head_dim]: h entries, then zeros.
    h, dim = d["h"], d["d"]
    return [(h,), (dim,)] if dim > h else [(h,)]


_EVERY_LAYER: dict[str, _Rule] = {
    "input_layernorm.weight": lambda d: _one(d["H"]),
    "post_attention_layernorm.weight": lambda d: _one(d["H"]),
    "self_attention_res_norm.weight": lambda d: _one(d["H"]) if d["res"] else None,
    "mlp_res_norm.weight": lambda d: _one(d["H"]) if d["res"] else None,
    "self_attention_res_proj.weight": lambda d: _one(1, d["H"]) if d["res"] else None,
    "mlp_res_proj.weight": lambda d: _one(1, d["H"]) if d["res"] else None,
}
_KDA: dict[str, _Rule] = {
    **{f"self_attn.{x}_proj.weight": (lambda d: _one(d["P"], d["H"])) for x in ("q", "k", "v")},
    **{
        f"self_attn.{x}_conv1d.weight": (lambda d: _one(d["P"], 1, d["C"])) for x in ("q", "k", "v")
    },
    "self_attn.g_proj.weight": lambda d: _one(d["P"], d["H"]) if d["full_gate"] else None,
    "self_attn.g_a_proj.weight": lambda d: None if d["full_gate"] else _one(d["d"], d["H"]),
    "self_attn.g_b_proj.weight": lambda d: None if d["full_gate"] else _one(d["P"], d["d"]),
    "self_attn.b_proj.weight": lambda d: _one(d["h"], d["H"]),
    "self_attn.f_a_proj.weight": lambda d: _one(d["d"], d["H"]),
    "self_attn.f_b_proj.weight": lambda d: _one(d["P"], d["d"]),
    "self_attn.A_log": _a_log,
    "self_attn.dt_bias": lambda d: _one(d["P"]),
    "self_attn.o_norm.weight": lambda d: _one(d["d"]),
    "self_attn.o_proj.weight": lambda d: _one(d["H"], d["P"]),
}
_MLA: dict[str, _Rule] = {
    "self_attn.q_a_proj.weight": lambda d: _one(d["Q"], d["H"]) if d["lora"] else None,
    "self_attn.q_a_layernorm.weight": lambda d: _one(d["Q"]) if d["lora"] else None,
    "self_attn.q_b_proj.weight": lambda d: (
        _one(d["A"] * (d["Dn"] + d["Dr"]), d["Q"]) if d["lora"] else None
    ),
    "self_attn.q_proj.weight": lambda d: (
        None if d["lora"] else _one(d["A"] * (d["Dn"] + d["Dr"]), d["H"])
    ),
    "self_attn.kv_a_proj_with_mqa.weight": lambda d: _one(d["R"] + d["Dr"], d["H"]),
    "self_attn.kv_a_layernorm.weight": lambda d: _one(d["R"]),
    "self_attn.kv_b_proj.weight": lambda d: _one(d["A"] * (d["Dn"] + d["Dv"]), d["R"]),
    "self_attn.g_proj.weight": lambda d: _one(d["A"] * d["Dv"], d["H"]) if d["out_gate"] else None,
    "self_attn.o_proj.weight": lambda d: _one(d["H"], d["A"] * d["Dv"]),
}
_DENSE: dict[str, _Rule] = {
    "mlp.gate_proj.weight": lambda d: _one(d["I"], d["H"]),
    "mlp.up_proj.weight": lambda d: _one(d["I"], d["H"]),
    "mlp.down_proj.weight": lambda d: _one(d["H"], d["I"]),
}


def _shared(d: _Dims) -> int | None:
    s = d["S"]
    if type(s) is not int or s < 0:
        raise KeyError("S")
    return s * d["N"] if s > 0 else None


_MOE: dict[str, _Rule] = {
    "mlp.gate.weight": lambda d: _one(d["E"], d["H"]),
    "mlp.gate.e_score_correction_bias": lambda d: _one(d["E"]),
    "mlp.shared_experts.gate_proj.weight": lambda d: (
        None if _shared(d) is None else _one(_shared(d), d["H"])
    ),
    "mlp.shared_experts.up_proj.weight": lambda d: (
        None if _shared(d) is None else _one(_shared(d), d["H"])
    ),
    "mlp.shared_experts.down_proj.weight": lambda d: (
        None if _shared(d) is None else _one(d["H"], _shared(d))
    ),
    "mlp.routed_expert_down_proj.weight": lambda d: _one(d["K"], d["H"]) if d["latent"] else None,
    "mlp.routed_expert_up_proj.weight": lambda d: _one(d["H"], d["K"]) if d["latent"] else None,
    "mlp.routed_expert_norm.weight": lambda d: (
        _one(d["K"]) if d["latent"] and d["latent_norm"] else None
    ),
}
_MODEL: dict[str, _Rule] = {
    "language_model.model.embed_tokens.weight": lambda d: _one(d["V"], d["H"]),
    "language_model.model.norm.weight": lambda d: _one(d["H"]),
    "language_model.lm_head.weight": lambda d: _one(d["V"], d["H"]),
    "language_model.model.output_attn_res_norm.weight": lambda d: (
        _one(d["H"]) if d["res"] else None
    ),
    "language_model.model.output_attn_res_proj.weight": lambda d: (
        _one(1, d["H"]) if d["res"] else None
    ),
    "vision_tower.patch_embed.proj.weight": lambda d: _one(d["Hv"], 3, *d["p"]),
    "vision_tower.patch_embed.pos_emb.weight": lambda d: _one(d["ph"], d["pw"], d["Hv"]),
    "vision_tower.encoder.final_layernorm.weight": lambda d: _one(d["Hv"]),
    "mm_projector.proj.0.weight": lambda d: _one(d["M"], d["M"]),
    "mm_projector.proj.2.weight": lambda d: _one(d["H"], d["M"]),
    "mm_projector.post_norm.weight": lambda d: _one(d["H"]),
}
_VISION_BLOCK: dict[str, _Rule] = {
    "norm0.weight": lambda d: _one(d["Hv"]),
    "norm1.weight": lambda d: _one(d["Hv"]),
    "wqkv.weight": lambda d: _one(3 * d["Qv"], d["Hv"]),
    "wo.weight": lambda d: _one(d["Hv"], d["Qv"]),
    "mlp.fc0.weight": lambda d: _one(d["Iv"], d["Hv"]),
    "mlp.fc1.weight": lambda d: _one(d["Hv"], d["Iv"]),
}


@dataclass(frozen=True)
class ShapeRule:
    """A config's shapes, read once: `shapes(name)` for any tensor name, in O(1), so no
    config size builds anything (a config may claim 10^10 layers)."""

    dims: dict[str, Any]
    layers: int  # num_hidden_layers SGLang builds (0 when unknown)
    kda: frozenset[int] | None  # KDA layer indices; None when linear_attn_config is unusable
    moe: frozenset[int] | None  # MoE layer indices; None when the MoE rule is unknown

    def judge(self, name: str) -> tuple[str, list[Shape]] | None:
        """(the place the tensor is at, the shapes SGLang accepts for it, first the one it
        builds) for a tensor name in any spelling; None when it is not judged (a name or
        layer kind the rule does not know, or a dimension the config does not give)."""
        name = canonical_name(name)
        table, place = _MODEL, "model"
        if name.startswith(LAYER_PREFIX):
            table, place, name = self._layer_table(name[len(LAYER_PREFIX) :])
        elif name.startswith(VISION_BLOCK_PREFIX):
            m = _INDEXED.fullmatch(name[len(VISION_BLOCK_PREFIX) :])
            blocks = self.dims["blocks"]
            if m is None or type(blocks) is not int or int(m[1]) >= blocks:
                return None
            table, place, name = _VISION_BLOCK, "vision_block", m[2]
        rule = table.get(name) if table is not None else None
        if rule is None:
            return None
        try:
            found = rule(self.dims)
        except (KeyError, TypeError):  # a dimension the config does not give
            return None
        if found is None or any(x is None or x <= 0 for s in found for x in s):
            return None
        return place, found

    def _layer_table(self, rest: str) -> tuple[dict[str, _Rule] | None, str, str]:
        m = _INDEXED.fullmatch(rest)
        if m is None or int(m[1]) >= self.layers:
            return None, "layer", rest  # not a layer SGLang builds
        layer, rel = int(m[1]), m[2]
        if rel in _EVERY_LAYER:
            return _EVERY_LAYER, "layer", rel
        if rel.startswith("self_attn.") and self.kda is not None:
            return (_KDA, "kda", rel) if layer in self.kda else (_MLA, "mla", rel)
        if rel.startswith("mlp.") and self.moe is not None:
            return (_MOE, "moe", rel) if layer in self.moe else (_DENSE, "dense", rel)
        return None, "layer", rel


def shape_rule(config: Any, moe_layers: list[int] | None) -> ShapeRule:
    """The config's shape rule; `moe_layers`: the MoE-layer rule's layers (None: unknown)."""
    layers = _size(contract.config_value(config, "num_hidden_layers")) or 0
    linear = _text(config, "linear_attn_config")
    kda: frozenset[int] | None = frozenset()
    if isinstance(linear, Mapping):
        ids = linear.get("kda_layers")
        # SGLang: `(i + 1) in kda_layers` (1-based), every other layer MLA
        kda = frozenset(i - 1 for i in ids if type(i) is int) if isinstance(ids, list) else None
    elif linear is not None:
        kda = None
    moe = None if moe_layers is None else frozenset(moe_layers)
    return ShapeRule(_dims(config), layers, kda, moe)


def shape_text(shapes: list[Shape]) -> str:
    """How a problem states the expected shapes."""
    return " or ".join(str(list(s)) for s in shapes)


def shape_problems(rule: ShapeRule, tensors: Iterable[tuple[str, str, Shape]]) -> list[Problem]:
    """Every tensor, given as (file, name, shape), whose shape is not one the rule derives for
    it: named as the file spells it. Routed experts are the contract's (`expert-shape`)."""
    problems = []
    for file, name, shape in tensors:
        if contract.is_expert_name(name):
            continue
        judged = rule.judge(name)
        if judged is not None and tuple(shape) not in judged[1]:
            problems.append(
                problem(
                    Code.INVENTORY_SHAPE,
                    file=file,
                    tensor=name,
                    place=judged[0],
                    want=shape_text(judged[1]),
                    shape=list(shape),
                )
            )
    return problems
