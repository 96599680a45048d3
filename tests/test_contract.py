"""The w31 contract: the name grammar, the MoE-layer rule and the config block, and the
rule that validation and planning read every name the same way (headers only)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from kimi_w31.converter import contract
from kimi_w31.converter.manifest import load_manifest
from kimi_w31.converter.plan import plan_conversion
from kimi_w31.converter.reasons import Code
from kimi_w31.converter.synth import SynthSpec, make_config
from kimi_w31.converter.validate import validate_source
from sources import header_only_source, synth_source

MANIFEST = load_manifest("kimi-k3-any")
P = "language_model.model.layers.1.mlp."

# -- the name grammar ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "parsed"),
    [
        (P + "experts.17.w3.weight_scale", (P, 17, "w3", "weight_scale")),
        ("experts.0.w31.weight_packed", ("", 0, "w31", "weight_packed")),
        ("mtp.0.experts.3.w1.weight_packed", ("mtp.0.", 3, "w1", "weight_packed")),
        (P + "experts.01.w1.weight_packed", None),  # would alias expert 1
        (P + "experts.1.w1.weight_packed\n", None),  # `$` would match before the newline
        (P + "experts.\u0663.w1.weight_packed", None),  # Arabic-Indic three
        (P + "experts.\uff13.w1.weight_packed", None),  # fullwidth three
        (P + "experts. 3.w1.weight_packed", None),
        (P + "experts.3.w1.weight", None),
        (P + "experts.3.gate_proj.weight", None),
        (P + "experts.3.W1.weight_packed", None),
        (P + "shared_experts.w1.weight", None),
    ],
)
def test_grammar_is_full_match_ascii_and_canonical(name, parsed):
    got = contract.parse_expert_name(name)
    assert (tuple(got) if got else None) == parsed


def test_any_name_under_an_experts_component_must_follow_the_grammar():
    assert contract.expert_prefix_and_tail(P + "shared_experts.w1.weight") is None
    assert contract.expert_prefix_and_tail(P + "experts.3.gate_proj.weight") == (
        P,
        "3.gate_proj.weight",
    )
    # The last `experts` component decides; an earlier one may be part of the prefix.
    assert contract.expert_prefix_and_tail("a.experts.b.experts.2.w2.weight_scale") == (
        "a.experts.b.",
        "2.w2.weight_scale",
    )
    # A look-alike `shared_experts` later in the name does not hide a real component.
    assert contract.expert_prefix_and_tail("m.experts.0.w1.shared_experts.x")[1] == (
        "0.w1.shared_experts.x"
    )


@pytest.mark.parametrize(
    ("prefix", "layer"),
    [
        ("language_model.model.layers.12.mlp.", 12),
        ("model.layers.0.mlp.", 0),
        ("layers.3.", 3),
        ("mtp.0.", None),
        ("model.layers.01.mlp.", None),
        ("model.layers.\u0663.mlp.", None),
        ("model.xlayers.3.mlp.", None),
    ],
)
def test_layer_of_a_prefix(prefix, layer):
    assert contract.layer_of(prefix) == layer


_ALPHABET = st.sampled_from(
    list("0123456789.w_experts")
    + ["\n", " ", "\t", "\x00", "\u0663", "\uff13", "\u00e9", "W", "1", "3", "31", "."]
)
_PIECES = st.sampled_from(
    [
        "experts.",
        "w1.",
        "w3.",
        "w31.",
        "w2.",
        "weight_packed",
        "weight_scale",
        "0.",
        "7.",
        "01.",
        "layers.1.",
        "mlp.",
    ]
)


@st.composite
def hostile_names(draw) -> str:
    """A real expert name with a few generated edits (characters or grammar pieces)."""
    e, proj, suffix = (
        draw(st.integers(0, 1)),
        draw(st.sampled_from(["w1", "w2", "w3"])),
        draw(st.sampled_from(contract.SUFFIXES)),
    )
    name = f"{P}experts.{e}.{proj}.{suffix}"
    for _ in range(draw(st.integers(1, 3))):
        i = draw(st.integers(0, len(name)))
        piece = draw(st.one_of(_ALPHABET, _PIECES))
        name = name[:i] + piece + name[i + draw(st.integers(0, 2)) :]
    return name


@settings(max_examples=300, deadline=None)
@given(hostile=st.lists(hostile_names(), min_size=1, max_size=3, unique=True))
def test_validation_and_planning_read_every_name_the_same_way(hostile):
    """Any source the validator accepts is planned exactly as the grammar says: each w1/w3
    pair becomes prefix + experts.E.w31.suffix, everything else keeps its name."""
    spec = SynthSpec(layers=2, dense_layers=0, experts=2, k=64, n=32)
    source, tensors = synth_source(spec)
    names = {t[0] for t in tensors}
    extra = [(n, "U8", (4,)) for n in hostile if n not in names]
    source = header_only_source(tensors + extra, make_config(spec), files=2)
    table, problems = validate_source(source, MANIFEST)
    if problems:
        return
    plan = plan_conversion(source, table, 1 << 30)
    expected = set()
    for name, *_ in tensors + extra:
        parsed = contract.parse_expert_name(name)
        if parsed is not None and parsed.proj in (contract.GATE, contract.UP):
            expected.add(parsed.with_proj(contract.FUSED))
        else:
            assert contract.expert_prefix_and_tail(name) is None or parsed is not None, name
            expected.add(name)
    assert set(plan.weight_map()) == expected


# -- the MoE-layer rule ----------------------------------------------------------------------


def sglang_is_moe_layer(layers: int, dense: int | None, freq: int | None, i: int) -> bool:
    """SGLang 0.5.23 models/kimi_k3.py `_is_moe_layer`, with configs/kimi_linear.py's
    defaults (first_k_dense_replace=0, moe_layer_freq=1), stated here independently."""
    dense = 0 if dense is None else dense
    freq = 1 if freq is None else freq
    return i >= dense and i % freq == 0


@given(
    layers=st.integers(1, 12),
    dense=st.one_of(st.none(), st.integers(0, 5)),
    freq=st.one_of(st.none(), st.integers(1, 4)),
    nested=st.booleans(),
)
def test_moe_layers_follow_sglang(layers, dense, freq, nested):
    text = {"num_hidden_layers": layers, "num_experts": 4}
    if dense is not None:
        text["first_k_dense_replace"] = dense
    if freq is not None:
        text["moe_layer_freq"] = freq
    config = {"text_config": text} if nested else text
    ids, problems = contract.moe_layer_ids(config)
    assert problems == []
    assert ids == [i for i in range(layers) if sglang_is_moe_layer(layers, dense, freq, i)]


@pytest.mark.parametrize(
    "bad",
    [
        {"moe_layer_freq": 0},
        {"first_k_dense_replace": -1},
        {"first_k_dense_replace": None},
        {"num_experts": None},
        {"num_hidden_layers": "4"},
    ],
)
def test_unusable_rule_fields_are_config_problems(bad):
    config = {"num_hidden_layers": 4, "num_experts": 4, **bad}
    ids, problems = contract.moe_layer_ids(config)
    assert ids == [] and [p.code for p in problems] == [Code.CONFIG_FIELD]


# -- validation of the whole class "missing structure" --------------------------------------


def _codes(spec: SynthSpec, edit) -> set[Code]:
    source, tensors = synth_source(spec)
    tensors = edit(list(tensors))
    source = header_only_source(tensors, make_config(spec), files=2)
    _, problems = validate_source(source, MANIFEST)
    return {p.code for p in problems}


def _experts_of(layer: int):
    """The routed experts of one layer, in either spelling (published: `block_sparse_moe`)."""
    return lambda n: any(
        f".layers.{layer}.{ffn}.experts." in n for ffn in ("mlp", "block_sparse_moe")
    )


@settings(max_examples=40, deadline=None)
@given(
    layers=st.integers(2, 5),
    dense=st.integers(0, 2),
    freq=st.integers(1, 2),
    experts=st.integers(1, 3),
)
def test_missing_or_misplaced_experts_are_refused(layers, dense, freq, experts):
    spec = SynthSpec(layers=layers, dense_layers=dense, moe_every=freq, experts=experts, k=64, n=32)
    moe = spec.moe_layers()
    if not moe:
        return
    assert _codes(spec, lambda ts: ts) == set()
    first = moe[0]
    # A whole MoE layer gone (index and headers consistent).
    assert Code.LAYER_MISSING in _codes(
        spec, lambda ts: [t for t in ts if not _experts_of(first)(t[0])]
    )
    # The same experts moved to a layer beyond num_hidden_layers, or to a dense layer.
    for target in [layers + 1, *[i for i in range(layers) if i not in moe][:1]]:
        moved = lambda ts, target=target: [  # noqa: E731
            (n.replace(f".layers.{first}.", f".layers.{target}."), d, s)
            if _experts_of(first)(n)
            else (n, d, s)
            for n, d, s in ts
        ]
        assert Code.LAYER_UNEXPECTED in _codes(spec, moved)

    # Routed experts under other names: nothing would be fused.
    def renamed(ts):
        names = {".w1.": ".gate_proj.", ".w3.": ".up_proj.", ".w2.": ".down_proj."}
        out = []
        for n, d, s in ts:
            for old, new in names.items():
                n = n.replace(old, new)
            out.append((n, d, s))
        return out

    assert {Code.EXPERT_NAME, Code.NO_EXPERTS} <= _codes(spec, renamed)


def test_a_source_with_zero_routed_experts_is_refused():
    spec = SynthSpec(layers=2, experts=2, k=64, n=32)
    codes = _codes(spec, lambda ts: [t for t in ts if ".experts." not in t[0]])
    assert {Code.NO_EXPERTS, Code.LAYER_MISSING} <= codes


# -- the config block and the wrapper -------------------------------------------------------


def _converted(published: bool = True) -> dict:
    config = make_config(SynthSpec(published=published))
    return contract.converted_config(config, contract.make_block(4.0, 25.0, converter="x"))


def _holder(config: dict) -> dict:
    """Where the one quantization_config sits: inside text_config only, as published, or at
    the top level only (the coverage layout)."""
    return config["text_config"] if "quantization_config" in config["text_config"] else config


@pytest.mark.parametrize("published", [True, False])
def test_block_and_wrapper_round_trip(published):
    config = make_config(SynthSpec(published=published))
    assert ("quantization_config" in config) != published
    converted = _converted(published)
    assert contract.check_block(converted) == [] and contract.check_wrapped(converted) == []
    assert contract.unwrap_config(converted) == config
    assert (
        _holder(converted)["quantization_config"]["base"] == _holder(config)["quantization_config"]
    )
    assert contract.marks(config) == [] and contract.marks(converted)


@pytest.mark.parametrize(
    ("edit", "code"),
    [
        (lambda c: c.pop("kimi_w31"), Code.BLOCK_MISSING),
        (lambda c: c["kimi_w31"].update(format_version=2), Code.BLOCK_FIELD),
        (lambda c: c["kimi_w31"].update(fc1_order=["gate", "up"]), Code.BLOCK_FIELD),
        (lambda c: c["kimi_w31"].update(group_size=32.0), Code.BLOCK_FIELD),
        (lambda c: c["kimi_w31"].update(situ_beta=-1), Code.BLOCK_FIELD),
        (lambda c: c["kimi_w31"].update(situ_beta=25.0), Code.BLOCK_MISMATCH),
        (lambda c: c["text_config"].update(hidden_act="silu"), Code.BLOCK_MISMATCH),
    ],
)
def test_check_block_one_code_per_reason(edit, code):
    config = _converted()
    edit(config)
    assert code in {p.code for p in contract.check_block(config)}


@pytest.mark.parametrize(
    ("edit", "code"),
    [
        (
            lambda h: h.update(quantization_config=h["quantization_config"]["base"]),
            Code.NOT_WRAPPED,
        ),
        (lambda h: h["quantization_config"].update(base=None), Code.NOT_WRAPPED),
        (lambda h: h.pop("quantization_config"), Code.NO_QUANTIZATION_CONFIG),
    ],
)
@pytest.mark.parametrize("published", [True, False])
def test_check_wrapped_one_code_per_reason(edit, code, published):
    config = _converted(published)
    edit(_holder(config))
    assert [p.code for p in contract.check_wrapped(config)] == [code]


def test_a_config_already_marked_is_refused_as_a_source():
    for marked in (_converted(), {**make_config(SynthSpec()), "kimi_w31": {}}):
        spec = SynthSpec(layers=2, experts=2, k=64, n=32)
        source, tensors = synth_source(spec)
        source.config = marked
        _, problems = validate_source(source, MANIFEST)
        assert Code.ALREADY_MARKED in {p.code for p in problems}


# -- the config as SGLang reads it (held to SGLang itself in tests/sglang/) ---------------------

RULE = {"num_hidden_layers": 4, "num_experts": 4, "first_k_dense_replace": 1}


@pytest.mark.parametrize(
    ("config", "code"),
    [
        # The MoE fields only at the top level: SGLang reads text_config alone.
        ({"model_type": "kimi_k3", **RULE, "text_config": {}}, Code.CONFIG_CONFLICT),
        # A top-level copy that disagrees with the text config.
        ({"num_experts": 8, "text_config": RULE}, Code.CONFIG_CONFLICT),
        # Experts sized by one count and loaded by another.
        ({"text_config": {**RULE, "n_routed_experts": 8}}, Code.CONFIG_CONFLICT),
        ({**RULE, "n_routed_experts": 4.0}, Code.CONFIG_CONFLICT),
        # A config integer is a JSON integer.
        ({**RULE, "num_hidden_layers": 4.0}, Code.CONFIG_FIELD),
        ({**RULE, "moe_layer_freq": True}, Code.CONFIG_FIELD),
        ({**RULE, "first_k_dense_replace": "1"}, Code.CONFIG_FIELD),
        # A kimi_k3 config without text_config: SGLang's text model has no experts.
        ({"model_type": "kimi_k3"}, Code.CONFIG_FIELD),
        ({"text_config": [RULE]}, Code.CONFIG_FIELD),
        ({"model_type": "kimi_k3", "hidden_size": 64, "text_config": RULE}, Code.CONFIG_FIELD),
    ],
)
def test_config_read_as_sglang_reads_it(config, code):
    ids, problems = contract.moe_layer_ids(config)
    assert ids == [] and code in {p.code for p in problems}


def test_defaults_and_aliases_are_sglangs():
    # num_hidden_layers absent from text_config: KimiLinearConfig's 32, not the top level's.
    cfg = {"text_config": {"num_experts": 2, "num_experts_per_tok": 3}}
    assert contract.moe_layer_ids(cfg) == (list(range(32)), [])
    assert contract.config_value(cfg, "num_experts_per_token") == 3
    assert contract.config_value(cfg, "hidden_act") == "silu"
    agreeing = {"num_experts": 2, "text_config": {"num_experts": 2, "n_routed_experts": 2}}
    assert contract.config_problems(agreeing, ["num_experts"]) == []


@given(
    layers=st.integers(1, 10**12),
    dense=st.integers(0, 10**12),
    freq=st.integers(1, 10**12),
    experts=st.integers(1, 10**12),
    extra=st.integers(0, 10**12),
    bound=st.integers(1, 10**6),
)
def test_layer_sizes_are_bounded_before_anything_is_built(
    layers, dense, freq, experts, extra, bound
):
    cfg = {
        "num_hidden_layers": layers,
        "first_k_dense_replace": dense,
        "moe_layer_freq": freq,
        "num_experts": experts,
        "num_nextn_predict_layers": extra,
    }
    moe = range(-(-dense // freq) * freq, layers, freq)  # the rule, without building it
    rule, problems = contract.layer_rule(cfg, bound)
    if max(experts, (len(moe) + extra) * experts) > bound:
        assert [p.code for p in problems] == [Code.CONFIG_BOUND] and rule.moe == []
    else:
        assert problems == [] and rule.moe == list(moe)
        assert rule.extra == list(range(layers, layers + extra))


def test_declared_mtp_layers_may_hold_whole_experts_only():
    spec = SynthSpec(layers=3, dense_layers=1, experts=2, k=64, n=32)
    source, tensors = synth_source(spec)
    config = make_config(spec)
    config["text_config"]["num_nextn_predict_layers"] = 1
    mtp = [
        (n.replace(".layers.2.", ".layers.3."), d, s) for n, d, s in tensors if ".layers.2." in n
    ]
    experts = [t for t in mtp if ".experts." in t[0]]
    whole = header_only_source(list(tensors) + experts, config, files=2)
    table, problems = validate_source(whole, MANIFEST)
    assert problems == [] and 3 in table.layers.values()
    partial = header_only_source(list(tensors) + experts[:-1], config, files=2)
    assert Code.EXPERT_PARTNER_MISSING in {p.code for p in validate_source(partial, MANIFEST)[1]}
    beyond = [(n.replace(".layers.3.", ".layers.4."), d, s) for n, d, s in experts]
    refused = header_only_source(list(tensors) + beyond, config, files=2)
    assert Code.LAYER_UNEXPECTED in {p.code for p in validate_source(refused, MANIFEST)[1]}
