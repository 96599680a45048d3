"""The pinned `kimi-k3` manifest's non-expert inventory (converter/manifest.py
`check_inventory`): what SGLang 0.5.23's Kimi-K3 model class loads besides the routed
experts, per layer kind (KDA/MLA attention, dense MLP/MoE), restated as data.

synth writes its inventory from its own code; the manifest restates it as data; the two must
agree on every generated config (and tests/sglang/test_whole_model.py holds synth to SGLang's
model itself: every synth tensor reaches a parameter, every parameter is loaded).
"""

from __future__ import annotations

import dataclasses
import json
from importlib import resources

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kimi_w31.converter import contract
from kimi_w31.converter.errors import Fatal
from kimi_w31.converter.manifest import expect, expected_inventory, load_manifest, parse_manifest
from kimi_w31.converter.reasons import Code
from kimi_w31.converter.safetensors_format import TensorInfo
from kimi_w31.converter.synth import AttnDims, SynthSpec, make_config, tensor_specs
from kimi_w31.converter.validate import check_inventory, validate_source
from sources import header_only_source, synth_source

MANIFEST = load_manifest("kimi-k3")
SETTINGS = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _inventory_problems(manifest, config, tensors):
    """`check_inventory` under the expectation the manifest resolves from the config."""
    return check_inventory(expect(manifest, config, None)[0], tensors)


@st.composite
def specs(draw) -> SynthSpec:
    layers = draw(st.integers(1, 10))
    dense = draw(st.integers(0, layers - 1))
    every = draw(st.integers(1, 3))
    spec = SynthSpec(
        layers=layers,
        dense_layers=dense,
        moe_every=every,
        experts=2,
        attn=AttnDims(shared_experts=draw(st.integers(0, 2))),
    )
    if not spec.moe_layers():
        spec = dataclasses.replace(spec, moe_every=1)
    return spec


def _canonical(name: str) -> str:
    """The manifest's spelling of a name (synth writes the published `block_sparse_moe`)."""
    for spelled, canonical in MANIFEST.inventory.aliases:
        name = name.replace(spelled, canonical)
    return name


def _infos(tensors) -> list[tuple[str, TensorInfo]]:
    return [("s0.safetensors", TensorInfo(n, d, tuple(s), 0, 0)) for n, d, s in tensors]


@SETTINGS
@given(specs())
def test_synth_writes_exactly_the_inventory_the_manifest_requires(spec):
    config = make_config(spec)
    tensors = tensor_specs(spec)
    non_expert = {_canonical(n) for n, _, _ in tensors if ".experts." not in n}
    assert non_expert == set(expected_inventory(MANIFEST.inventory, config))
    assert _inventory_problems(MANIFEST, config, _infos(tensors)) == []


@SETTINGS
@given(specs(), st.data())
def test_each_missing_kind_is_named_with_its_layers(spec, data):
    """Dropping every tensor of one name pattern gives one problem naming that pattern."""
    config = make_config(spec)
    tensors = tensor_specs(spec)
    names = sorted(n for n, _, _ in tensors if ".experts." not in n)
    victim = data.draw(st.sampled_from(names))
    layer = victim.split(".layers.")[1].split(".")[0] if ".layers." in victim else None
    pattern = victim.replace(f".layers.{layer}.", ".layers.{L}.") if layer else victim
    dropped = [t for t in tensors if not _same_pattern(t[0], pattern)]
    # named as the source spells that layer (`block_sparse_moe` in the published layout)
    if ".blocks." in pattern:
        block = pattern.split(".blocks.")[1].split(".")[0]
        pattern = pattern.replace(f".blocks.{block}.", ".blocks.{B}.")
        dropped = [t for t in tensors if not _same_pattern(t[0], pattern)]
    problems = _inventory_problems(MANIFEST, config, _infos(dropped))
    assert [(p.code, p.tensor) for p in problems] == [(Code.INVENTORY_MISSING, pattern)]


def _same_pattern(name: str, pattern: str) -> bool:
    head, mark, tail = pattern.partition("{L}" if "{L}" in pattern else "{B}")
    if not mark:
        return name == pattern
    if not (name.startswith(head) and name.endswith(tail)):
        return False
    return name[len(head) : len(name) - len(tail)].isdigit()


@SETTINGS
@given(specs(), st.data())
def test_a_quantized_non_expert_tensor_is_refused(spec, data):
    tensors = tensor_specs(spec)
    i = data.draw(st.sampled_from([i for i, t in enumerate(tensors) if ".experts." not in t[0]]))
    name, _, shape = tensors[i]
    tensors[i] = (name, "U8", shape)
    problems = _inventory_problems(MANIFEST, make_config(spec), _infos(tensors))
    assert [(p.code, p.tensor, p.found) for p in problems] == [(Code.INVENTORY_DTYPE, name, "U8")]


def test_the_other_spelling_sglang_maps_alike_is_accepted():
    """`language_model.layers.` and `block_sparse_moe` are what KimiK3ForConditionalGeneration's
    hf_to_sglang_mapper maps to `language_model.model.layers.` and `mlp`: the published
    spelling (synth's default), the coverage layout's `mlp.` and the short prefix all pass."""
    for published in (True, False):
        spec = SynthSpec(published=published)
        tensors = tensor_specs(spec)
        assert any(".block_sparse_moe." in n for n, _, _ in tensors) == published
        short = [(n.replace(".model.layers.", ".layers."), d, s) for n, d, s in tensors]
        for variant in (tensors, short):
            assert _inventory_problems(MANIFEST, make_config(spec), _infos(variant)) == []


def test_validation_reports_the_inventory_with_the_expert_checks():
    """Through validate_source, with the kimi-k3 rules but the pins lifted (small dims)."""
    raw = json.loads((resources.files("kimi_w31.manifests") / "kimi-k3.json").read_bytes())
    raw["pinned"] = {}
    manifest = parse_manifest(json.dumps(raw).encode(), "kimi-k3-unpinned")
    spec = SynthSpec()
    source, tensors = synth_source(spec)
    assert validate_source(source, manifest)[1] == []
    kept = [t for t in tensors if not t[0].endswith(".self_attn.kv_b_proj.weight")]
    _, problems = validate_source(header_only_source(kept, make_config(spec), 2), manifest)
    assert [(p.code, p.tensor) for p in problems] == [
        (Code.INVENTORY_MISSING, "language_model.model.layers.{L}.self_attn.kv_b_proj.weight")
    ]


def test_a_manifest_without_an_inventory_checks_none():
    spec = SynthSpec()
    assert _inventory_problems(load_manifest("kimi-k3-any"), make_config(spec), _infos([])) == []


@SETTINGS
@given(specs())
def test_no_non_expert_name_trips_the_expert_grammar(spec):
    """Shared experts, the router, the latent projections... are not routed experts: the
    contract's grammar takes exactly the routed-expert tensors, under either spelling."""
    for name, _, _ in tensor_specs(spec):
        for spelled in (name, name.replace(".mlp.", ".block_sparse_moe.")):
            routed = ".experts." in spelled and ".shared_experts." not in spelled
            assert (contract.expert_prefix_and_tail(spelled) is not None) == routed, spelled
            assert (contract.parse_expert_name(spelled) is not None) == routed, spelled


def test_a_malformed_inventory_is_a_malformed_manifest():
    raw = json.loads((resources.files("kimi_w31.manifests") / "kimi-k3.json").read_bytes())
    raw["inventory"]["groups"].append({"place": "nowhere", "names": ["x.weight"]})
    with pytest.raises(Fatal) as err:
        parse_manifest(json.dumps(raw).encode(), "broken")
    assert [p.code for p in err.value.problems] == [Code.MANIFEST_INVALID]
