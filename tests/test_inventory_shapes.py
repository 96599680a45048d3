"""Every non-expert tensor's shape from the config (converter/shapes.py, `inventory-shape`).

Over generated checkpoints (synth specs with varied attention, MLP, MoE and vision dims, layer
kinds and spellings): a tensor with one dimension off is refused, named as its file spells
it, with the expected and found shapes; every such tensor is reported; the correct shapes
pass (the negative control). tests/sglang/test_shape_differential.py holds the derived
shapes to the model SGLang builds.
"""

from __future__ import annotations

import dataclasses
import json
from importlib import resources

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kimi_w31.converter import contract
from kimi_w31.converter.manifest import expect, load_manifest, parse_manifest
from kimi_w31.converter.reasons import Code
from kimi_w31.converter.safetensors_format import TensorInfo
from kimi_w31.converter.shapes import canonical_name, shape_rule
from kimi_w31.converter.synth import AttnDims, SynthSpec, VisionDims, make_config, tensor_specs
from kimi_w31.converter.validate import check_inventory, check_shapes, validate_source
from sources import header_only_source

SETTINGS = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
ANY = load_manifest("kimi-k3-any")


def _unpinned_kimi_k3():
    raw = json.loads((resources.files("kimi_w31.manifests") / "kimi-k3.json").read_bytes())
    raw["pinned"] = {}
    return parse_manifest(json.dumps(raw).encode(), "kimi-k3-unpinned")


KIMI_K3 = _unpinned_kimi_k3()
# The spellings SGLang's loader maps alike (KimiK3ForConditionalGeneration.hf_to_sglang_mapper).
SPELLINGS = {
    "as synth writes it": lambda n: n,
    "language_model.layers.": lambda n: n.replace(
        "language_model.model.layers.", "language_model.layers."
    ),
    "block_sparse_moe": lambda n: n.replace(".mlp.", ".block_sparse_moe."),
}


@st.composite
def specs(draw) -> SynthSpec:
    layers = draw(st.integers(1, 8))
    attn = AttnDims(
        heads=draw(st.integers(1, 6)),
        q_lora_rank=draw(st.sampled_from([16, 32, 48])),
        kv_lora_rank=draw(st.sampled_from([16, 32, 64])),
        qk_nope_head_dim=draw(st.sampled_from([8, 16, 32])),
        qk_rope_head_dim=draw(st.sampled_from([8, 16])),
        v_head_dim=draw(st.sampled_from([8, 16, 32])),
        kda_heads=draw(st.integers(1, 6)),
        kda_head_dim=draw(st.sampled_from([8, 16, 32])),
        conv_size=draw(st.integers(2, 5)),
        intermediate=draw(st.sampled_from([64, 96, 160])),
        shared_experts=draw(st.integers(0, 2)),
    )
    vision = VisionDims(
        hidden=draw(st.sampled_from([16, 32])),
        qkv=draw(st.sampled_from([16, 48])),
        intermediate=draw(st.sampled_from([32, 40])),
        layers=draw(st.integers(0, 3)),
        patch=draw(st.sampled_from([2, 14])),
        pos_emb=draw(st.integers(1, 5)),
    )
    spec = SynthSpec(
        layers=layers,
        dense_layers=draw(st.integers(0, layers - 1)),
        moe_every=draw(st.integers(1, 3)),
        experts=2,
        hidden=draw(st.sampled_from([64, 96, 128])),
        k=draw(st.sampled_from([32, 64])),
        n=32,
        vocab=draw(st.sampled_from([64, 100])),
        attn=attn,
        vision=vision,
    )
    return spec if spec.moe_layers() else dataclasses.replace(spec, moe_every=1)


def _infos(tensors) -> list[tuple[str, TensorInfo]]:
    return [("s0.safetensors", TensorInfo(n, d, tuple(s), 0, 0)) for n, d, s in tensors]


def _shape_problems(spec: SynthSpec, tensors, manifest=ANY):
    return check_shapes(expect(manifest, make_config(spec), None)[0], _infos(tensors))


def _non_expert(tensors) -> list[int]:
    return [i for i, t in enumerate(tensors) if contract.expert_prefix_and_tail(t[0]) is None]


@SETTINGS
@given(specs())
def test_synth_shapes_pass_and_every_non_expert_tensor_is_judged(spec):
    """The negative control, and the rule knows every name the model loads."""
    tensors = tensor_specs(spec)
    assert _shape_problems(spec, tensors) == []
    rule = expect(ANY, make_config(spec), None)[0].shapes
    unjudged = [tensors[i][0] for i in _non_expert(tensors) if rule.judge(tensors[i][0]) is None]
    assert unjudged == []


def _off_by_one_dimension(data, shape: tuple[int, ...]) -> tuple[int, ...]:
    axis = data.draw(st.integers(0, len(shape) - 1))
    wrong = data.draw(
        st.sampled_from(sorted({shape[axis] + 1, shape[axis] * 2, shape[axis] // 2} - {0}))
    )
    return (*shape[:axis], wrong, *shape[axis + 1 :])


@SETTINGS
@given(specs(), st.data(), st.sampled_from(sorted(SPELLINGS)))
def test_one_wrong_dimension_is_refused_named_as_the_file_spells_it(spec, data, spelling):
    respell = SPELLINGS[spelling]
    tensors = [(respell(n), d, s) for n, d, s in tensor_specs(spec)]
    i = data.draw(st.sampled_from(_non_expert(tensors)))
    name, dtype, shape = tensors[i]
    wrong = _off_by_one_dimension(data, shape)
    if name.endswith(".A_log") and len(wrong) == 1:
        # [heads] is right, and so is the published padding [head_dim] when wider: halving
        # a padded [head_dim] can land on [heads]. Neither is a wrong dimension.
        heads, head_dim = spec.attn.kda_heads, spec.attn.kda_head_dim
        right = {heads, head_dim} if head_dim > heads else {heads}
        while wrong[0] in right:
            wrong = (wrong[0] + 1,)
    tensors[i] = (name, dtype, wrong)
    problems = _shape_problems(spec, tensors)
    assert [(p.code, p.tensor, p.found) for p in problems] == [
        (Code.INVENTORY_SHAPE, name, str(list(wrong)))
    ]
    assert problems[0].file == "s0.safetensors"
    assert str(list(shape)) in problems[0].expected


@SETTINGS
@given(specs(), st.data())
def test_every_wrong_tensor_is_reported(spec, data):
    tensors = tensor_specs(spec)
    victims = data.draw(st.lists(st.sampled_from(_non_expert(tensors)), min_size=2, unique=True))
    for i in victims:
        name, dtype, shape = tensors[i]
        tensors[i] = (name, dtype, (*shape, 1))  # one more dimension: never accepted
    problems = _shape_problems(spec, tensors)
    assert {p.tensor for p in problems} == {tensors[i][0] for i in victims}
    assert {p.code for p in problems} == {Code.INVENTORY_SHAPE}


def test_a_log_is_its_heads_or_the_published_head_dim_padding():
    """SGLang takes a 1-D A_log's first `num_heads` entries; the published checkpoint stores
    [head_dim] (96 values, then zeros to 128)."""
    spec = SynthSpec(attn=AttnDims(kda_heads=3, kda_head_dim=8))
    rule = expect(ANY, make_config(spec), None)[0].shapes
    kda = next(n for n, _, _ in tensor_specs(spec) if n.endswith(".A_log"))
    assert rule.judge(kda) == ("kda", [(3,), (8,)])
    wide = SynthSpec(attn=AttnDims(kda_heads=8, kda_head_dim=4))
    assert expect(ANY, make_config(wide), None)[0].shapes.judge(kda) == ("kda", [(8,)])


def test_a_dimension_the_config_does_not_give_is_not_judged():
    """docs/inventory.md: no shape is guessed; presence and dtype are still checked."""
    spec = SynthSpec()
    config = make_config(spec)
    del config["text_config"]["linear_attn_config"]["head_dim"]
    config["text_config"]["q_lora_rank"] = "1536"
    tensors = [(n, d, (*s, 1)) for n, d, s in tensor_specs(spec)]
    problems = check_shapes(expect(ANY, config, None)[0], _infos(tensors))
    judged = {p.tensor for p in problems}
    assert judged and not any(".q_a_proj." in n or ".q_b_proj." in n for n in judged)
    assert not any(n.endswith((".q_conv1d.weight", ".A_log", ".o_norm.weight")) for n in judged)
    assert any(n.endswith(".kv_b_proj.weight") for n in judged)


def test_a_huge_config_builds_nothing():
    config = make_config(SynthSpec())
    config["text_config"]["num_hidden_layers"] = 10**12
    config["vision_config"]["vt_num_hidden_layers"] = 10**12
    rule = shape_rule(config, None)
    assert rule.judge("vision_tower.encoder.blocks.999999999999.norm0.weight") is not None
    assert rule.judge("language_model.model.layers.999999999.input_layernorm.weight") is not None


def test_canonical_names_are_sglangs():
    assert (
        canonical_name("language_model.layers.3.block_sparse_moe.gate.weight")
        == "language_model.model.layers.3.mlp.gate.weight"
    )


def test_convert_validation_refuses_under_both_manifests():
    spec = SynthSpec()
    tensors = tensor_specs(spec)
    i = next(i for i, t in enumerate(tensors) if t[0].endswith(".q_a_proj.weight"))
    name, dtype, (rows, cols) = tensors[i]
    tensors[i] = (name, dtype, (rows // 2, cols))  # the example: half its rows
    for manifest in (ANY, KIMI_K3):
        source = header_only_source(tensors, make_config(spec), 2)
        problems = validate_source(source, manifest)[1]
        assert [(p.code, p.tensor) for p in problems] == [(Code.INVENTORY_SHAPE, name)]


@SETTINGS
@given(specs(), st.data())
def test_a_missing_tensor_is_named_in_the_sources_spelling(spec, data):
    """Real MoE layers are spelled `block_sparse_moe`: a missing router is named so."""
    moe = {f".layers.{i}." for i in spec.moe_layers()}

    def real(name: str) -> str:
        return name.replace(".mlp.", ".block_sparse_moe.") if any(m in name for m in moe) else name

    tensors = [(real(n), d, s) for n, d, s in tensor_specs(spec)]
    layer = data.draw(st.sampled_from(spec.moe_layers()))
    gone = f"language_model.model.layers.{layer}.block_sparse_moe.gate.weight"
    kept = [t for t in tensors if t[0] != gone]
    expected = expect(KIMI_K3, make_config(spec), None)[0]
    problems = check_inventory(expected, _infos(kept))
    assert [(p.code, p.tensor) for p in problems] == [
        (Code.INVENTORY_MISSING, "language_model.model.layers.{L}.block_sparse_moe.gate.weight")
    ]


def test_the_published_dims_give_the_published_shapes():
    """The published checkpoint's MLA (96 heads), dense layer and A_log shapes (issue
    evidence: sgl-project/sglang-jax PR #1559, the published config) follow from its config."""
    spec = SynthSpec(layers=4, hidden=7168, k=3584, n=3072, experts=2)
    config = make_config(spec)
    config["text_config"].update(
        num_attention_heads=96,
        q_lora_rank=1536,
        kv_lora_rank=512,
        qk_nope_head_dim=128,
        qk_rope_head_dim=64,
        v_head_dim=128,
        intermediate_size=33792,
    )
    config["text_config"]["linear_attn_config"].update(num_heads=96, head_dim=128)
    rule = expect(ANY, config, None)[0].shapes
    mla, kda = spec.mla_layers()[0], 0
    p = f"language_model.model.layers.{mla}.self_attn."
    assert rule.judge(p + "q_b_proj.weight")[1] == [(18432, 1536)]
    assert rule.judge(p + "kv_b_proj.weight")[1] == [(24576, 512)]
    assert rule.judge(p + "g_proj.weight")[1] == [(12288, 7168)]
    assert rule.judge(p + "o_proj.weight")[1] == [(7168, 12288)]
    a_log = f"language_model.layers.{kda}.self_attn.A_log"
    assert (128,) in rule.judge(a_log)[1]
    dense = "language_model.model.layers.0.mlp.gate_proj.weight"
    assert rule.judge(dense)[1] == [(33792, 7168)]
