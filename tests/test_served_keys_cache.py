"""`contract.served_keys` maps a routed expert's head and tail apart, cached; the rule
itself is `_served_keys_whole`. The two must agree on every name, however odd."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st
from kimi_w31.converter import contract

SEGMENTS = [
    "language_model", "model", "layers", "layers.", "3", "0", "mlp", "block_sparse_moe",
    "experts", "experts.", ".experts.", "w1", "w2", "w3", "w31", ".w31.", "weight",
    "weight_packed", "weight_scale", "vision_tower", "mm_projector", "language_model.", "x",
    ".", "..",
]  # fmt: skip


@settings(max_examples=3000, deadline=None)
@given(st.lists(st.sampled_from(SEGMENTS), min_size=1, max_size=12).map(".".join))
def test_the_cached_mapping_is_the_rule(name):
    assert contract.served_keys(name) == contract._served_keys_whole(name)


def test_the_cached_path_is_taken_for_real_expert_names():
    """Negative control for the property above: the fast path really serves these names."""
    contract._served_head.cache_clear()
    name = "language_model.model.layers.4.block_sparse_moe.experts.9.w31.weight_packed"
    assert contract.served_keys(name) == (
        "model.layers.4.mlp.experts.9.w3.weight",
        "model.layers.4.mlp.experts.9.w1.weight",
    )
    assert contract._served_head.cache_info().misses == 1


@settings(max_examples=1500, deadline=None)
@given(
    st.lists(
        st.lists(st.sampled_from(SEGMENTS), min_size=1, max_size=10).map(".".join), max_size=12
    )
)
def test_the_quick_collision_check_is_the_rule(names):
    assert contract.name_collisions(names) == contract._collisions_in_order(set(names))


LAYER = "language_model.model.layers.{}.block_sparse_moe.experts.{}.{}.{}"


@settings(max_examples=300, deadline=None)
@given(
    st.sets(st.integers(1, 3), min_size=1),
    st.sets(st.integers(0, 5), min_size=1),
    st.lists(st.sampled_from(["w1", "w2", "w3", "w31"]), min_size=1, unique=True),
    st.lists(st.sampled_from(["weight", "weight_packed", "weight_scale"]), min_size=1),
    st.lists(st.sampled_from(SEGMENTS), max_size=4).map(".".join),
)
def test_layered_expert_names_with_an_odd_one_are_judged_as_the_rule_judges(
    layers, experts, projs, suffixes, odd
):
    """Layers sharing one set of tails (the quick check's shortcut) plus one odd name."""
    names = {
        LAYER.format(layer, e, p, s)
        for layer in layers
        for e in experts
        for p in projs
        for s in suffixes
    }
    names |= {odd, f"model.layers.1.mlp.experts.0.{odd}"}
    assert contract.name_collisions(names) == contract._collisions_in_order(names)


def test_the_quick_check_clears_a_whole_model_and_catches_a_late_twin():
    """Negative control: the quick check answers False on clean real-layout names, and a
    single colliding name (the alias spelling of one of them) turns it True."""
    names = {LAYER.format(layer, e, p, s) for layer in range(1, 6) for e in range(64)
             for p in ("w1", "w2", "w3") for s in ("weight_packed", "weight_scale")}  # fmt: skip
    assert not contract._may_collide(names)
    twin = "language_model.model.layers.5.mlp.experts.63.w3.weight_packed"
    assert contract._may_collide(names | {twin})
    assert [c[:2] for c in contract.name_collisions(names | {twin})] == [
        (LAYER.format(5, 63, "w3", "weight_packed"), twin)
    ]


@settings(max_examples=2000, deadline=None)
@given(st.lists(st.sampled_from(SEGMENTS), min_size=1, max_size=8).map(".".join))
def test_is_expert_name_is_whether_the_name_splits(name):
    assert contract.is_expert_name(name) == (contract.expert_prefix_and_tail(name) is not None)
