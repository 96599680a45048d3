"""The config as SGLang reads it: the contract's view against SGLang 0.5.23's own code.

Generated configs (fields in text_config or at the top level, missing, duplicated and
disagreeing, `num_experts` beside `n_routed_experts`, `num_experts_per_token` beside
`num_experts_per_tok`, non-integer numbers, dense prefix and cadence, declared MTP layers)
go through SGLang's real config classes (KimiK3Config / KimiLinearConfig, as its config
registry picks them by model_type) and the Kimi-K3 model's own `_is_moe_layer`; what the
model would build (MoE layers, experts built and routed to, experts the loader maps,
K, N, top-k, activation) is compared with `contract.layer_rule` and
`manifest.resolve_dims`. The contract must agree, or refuse with a code.
"""

from __future__ import annotations

import copy

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kimi_w31.converter import contract
from kimi_w31.converter.errors import Problem
from kimi_w31.converter.manifest import load_manifest, resolve_dims
from kimi_w31.converter.reasons import Code

pytestmark = pytest.mark.sglang

MANIFEST = load_manifest("kimi-k3-any")

_INTS = {
    "num_hidden_layers": st.integers(1, 9),
    "first_k_dense_replace": st.integers(0, 4),
    "moe_layer_freq": st.integers(1, 3),
    "num_experts": st.integers(1, 6),
    "n_routed_experts": st.integers(1, 6),
    "num_experts_per_token": st.integers(1, 4),
    "num_experts_per_tok": st.integers(1, 4),
    "moe_intermediate_size": st.sampled_from([32, 64]),
    "routed_expert_hidden_size": st.sampled_from([32, 64]),
    "num_nextn_predict_layers": st.integers(0, 2),
}
_OTHER = {
    "hidden_act": st.sampled_from(["situ"] * 6 + ["silu"]),
    "activation_situ_beta": st.sampled_from([4.0] * 6 + [4, 5.0]),
    "activation_situ_linear_beta": st.sampled_from([25.0] * 6 + [30.0]),
}
# How a field is written: a JSON integer, or what an editor or script may leave there.
_ODD = st.one_of(st.just(None), st.booleans(), st.integers(0, 6).map(float), st.just("4"))


@st.composite
def field_value(draw, key: str):
    if key in _OTHER:
        return draw(_OTHER[key])
    return draw(_ODD) if draw(st.integers(0, 29)) == 0 else draw(_INTS[key])


@st.composite
def configs(draw) -> dict:
    """A config.json as a user may hand it over (the kimi_k3 nested form mostly)."""
    form = draw(
        st.sampled_from(["nested", "nested", "nested", "flat", "flat+text", "no-text-config"])
    )
    keys = [*_INTS, *_OTHER]
    text: dict = {}
    top: dict = {}
    for key in keys:
        where = draw(st.sampled_from(["text"] * 12 + ["top", "both", "absent"]))
        if key in ("n_routed_experts", "num_experts_per_tok", "num_nextn_predict_layers"):
            where = draw(st.sampled_from(["absent", "absent", where]))
        if where in ("text", "both"):
            text[key] = draw(field_value(key))
        if where in ("top", "both"):
            same = where == "both" and draw(st.booleans())
            top[key] = text[key] if same else draw(field_value(key))
    if form == "flat":
        return {"model_type": "kimi_linear", **top, **text}
    if form == "flat+text":  # KimiLinearConfig reads its top level; a text_config is inert
        return {"model_type": "kimi_linear", **top, "text_config": text}
    cfg = {"model_type": "kimi_k3", **top}
    if form == "nested":
        cfg["text_config"] = text
    return cfg


def sglang_view(cfg: dict):
    """What SGLang's Kimi-K3 model builds from `cfg`, or the exception it stops with."""
    from sglang.srt.configs.kimi_k3 import KimiK3Config
    from sglang.srt.configs.kimi_linear import KimiLinearConfig
    from sglang.srt.models.kimi_k3 import _is_moe_layer

    cls = KimiK3Config if cfg["model_type"] == "kimi_k3" else KimiLinearConfig
    try:
        config = cls.from_dict(copy.deepcopy(cfg))  # what its config registry does
        # KimiK3ForConditionalGeneration builds from text_config; KimiK3LinearForCausalLM
        # (a kimi_linear config) from the config itself.
        text = config.text_config if cls is KimiK3Config else config
        moe = [i for i in range(text.num_hidden_layers) if _is_moe_layer(text, i)]
    except Exception as exc:  # noqa: BLE001 - any failure is "SGLang cannot serve this"
        return exc
    return {
        "text": text,
        "moe": moe,
        # KimiK3MoE sizes FusedMoE (and MoEGate its router) by n_routed_experts ...
        "built": getattr(text, "n_routed_experts", text.num_experts),
        # ... while load_weights maps checkpoint expert ids 0..num_experts-1.
        "loaded": text.num_experts,
        "K": text.routed_expert_hidden_size
        if text.routed_expert_hidden_size is not None
        else text.hidden_size,
        "N": text.moe_intermediate_size,
        "TOPK": text.num_experts_per_token,
        "L": text.num_hidden_layers,
    }


def contract_view(cfg: dict):
    """What validation reads from a config: the layer rule, the manifest's dims, SiTU."""
    rule, problems = contract.layer_rule(cfg)
    dims, dim_problems = resolve_dims(MANIFEST, cfg)
    act = contract.config_value(cfg, "hidden_act")
    situ = [] if act == contract.FIXED_FIELDS["activation"] else [Problem(Code.SITU_MISMATCH, act)]
    return rule, dims.values, problems + dim_problems + situ


@settings(
    max_examples=400,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
@given(cfg=configs())
def test_contract_reads_the_config_as_sglang_does(cfg):
    theirs = sglang_view(cfg)
    rule, dims, problems = contract_view(cfg)
    if isinstance(theirs, Exception):
        assert problems, f"SGLang cannot read this config ({theirs!r}) but the contract can"
        return
    if problems:
        # A refusal must have a reason SGLang shares: two values for one field, a value that
        # is not a JSON integer, or a model without the experts the manifest describes.
        return
    assert rule.moe == theirs["moe"]
    assert dims["E"] == theirs["built"] == theirs["loaded"]
    for symbol in ("K", "N", "TOPK", "L"):
        assert dims[symbol] == theirs[symbol], symbol
        assert type(theirs[symbol]) is int, symbol
    # Layers past num_hidden_layers (declared MTP layers) are never loaded by the model.
    assert all(i >= theirs["L"] for i in rule.extra)
    # The activation and its betas as the MoE runner gets them (gemm1_alpha, clamp limit).
    assert theirs["text"].hidden_act == contract.config_value(cfg, "hidden_act") == "situ"
    for key, want in (("activation_situ_beta", 4.0), ("activation_situ_linear_beta", 25.0)):
        assert getattr(theirs["text"], key) == contract.config_value(cfg, key) == want


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cfg=configs())
def test_two_values_for_one_field_are_refused(cfg):
    """Where the config says two things about a field SGLang reads one of (a top-level copy
    beside text_config, an alias beside its field), the contract refuses unless they agree
    with what SGLang reads."""
    theirs = sglang_view(cfg)
    if isinstance(theirs, Exception):
        return
    _, _, problems = contract_view(cfg)
    codes = {p.code for p in problems}
    text = theirs["text"]
    inner = contract.sglang_text_fields(cfg)
    both = isinstance(inner, dict) and "num_experts" in inner and "n_routed_experts" in inner
    if both and not contract._same(text.num_experts, text.n_routed_experts):
        assert Code.CONFIG_CONFLICT in codes
    if cfg["model_type"] == "kimi_k3":
        for key in ("num_hidden_layers", "num_experts", "moe_intermediate_size"):
            if key in cfg and not contract._same(cfg[key], getattr(text, key)):
                assert Code.CONFIG_CONFLICT in codes, key


def test_a_clean_nested_config_is_accepted_and_agrees():
    text = {
        "num_hidden_layers": 7,
        "first_k_dense_replace": 2,
        "moe_layer_freq": 2,
        "num_experts": 6,
        "n_routed_experts": 6,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 64,
        "routed_expert_hidden_size": 32,
        "hidden_act": "situ",
        "activation_situ_beta": 4.0,
        "activation_situ_linear_beta": 25.0,
        "num_nextn_predict_layers": 1,
    }
    cfg = {"model_type": "kimi_k3", "num_hidden_layers": 7, "text_config": text}
    theirs = sglang_view(cfg)
    rule, dims, problems = contract_view(cfg)
    assert problems == []
    assert rule.moe == theirs["moe"] == [2, 4, 6] and rule.extra == [7]
    assert dims == {"K": 32, "N": 64, "E": 6, "TOPK": 2, "L": 7}


def test_top_level_fields_are_not_read_beside_text_config():
    """The case that served no MoE layer: the MoE fields only at the top level."""
    cfg = {
        "model_type": "kimi_k3",
        "num_experts": 4,
        "num_hidden_layers": 3,
        "text_config": {"hidden_act": "situ", "moe_intermediate_size": 64},
    }
    theirs = sglang_view(cfg)
    assert theirs["moe"] == [] and theirs["L"] == 32  # SGLang: no experts, default layers
    _, _, problems = contract_view(cfg)
    assert {Code.CONFIG_CONFLICT, Code.CONFIG_FIELD} <= {p.code for p in problems}
