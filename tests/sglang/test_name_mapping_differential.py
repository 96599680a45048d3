"""Class 8's rule held to SGLang: two checkpoint names reach one model parameter in SGLang's
Kimi-K3 loader exactly when the contract's restatement (`contract.served_keys`) says so.

Every name of a grammar of spellings (the VL wrapper's prefixes and `block_sparse_moe`
alias, `language_model.` anywhere, `weight_packed`/`weight`, routed experts fused and not,
vision names) is loaded alone through SGLang 0.5.23's real `load_weights` (the VL wrapper's,
then the text model's, with the adapter's w31 split between them as the plugin puts it);
each parameter write it makes is recorded. Over every pair of names, "they write the same
(parameter, shard, expert)" must equal "their served keys meet".
"""

from __future__ import annotations

import inspect
import itertools
from types import SimpleNamespace

import pytest
import torch
from kimi_w31.adapter.split import split_w31_items
from kimi_w31.converter import contract

pytestmark = pytest.mark.sglang

PREFIXES = (
    "language_model.model.layers.",
    "language_model.layers.",
    "model.layers.",
    "language_model.language_model.model.layers.",
)
MODULES = ("mlp", "block_sparse_moe")
EXPERT_LEAVES = tuple(
    f"experts.{e}.{proj}.{suffix}"
    for e in (0, 1)
    for proj in ("w1", "w2", "w3", "w31")
    for suffix in ("weight_packed", "weight", "weight_scale")
)
OTHER_LEAVES = ("down_proj.weight", "down_proj.weight_packed", "shared_experts.down_proj.weight")
VISION = (
    "vision_tower.blocks.0.weight",
    "language_model.vision_tower.blocks.0.weight",
    "mm_projector.proj.weight",
    "mm_projector.proj.weight_packed",
)
LAYERS = 2


def names() -> list[str]:
    out = [
        f"{prefix}{layer}.{module}.{leaf}"
        for prefix in PREFIXES
        for layer in range(LAYERS)
        for module in MODULES
        for leaf in (*EXPERT_LEAVES, *OTHER_LEAVES)
    ]
    out += [f"{p}{layer}.input_layernorm.weight" for p in PREFIXES for layer in range(LAYERS)]
    return out + list(VISION)


class _Param:
    def __init__(self, name: str, writes: list) -> None:
        self.name = name
        self.writes = writes

    def weight_loader(self, param, loaded_weight, *args, **kwargs):
        # The expert path passes (name, expert_id=, shard_id=); a stacked one the shard.
        expert_path = "expert_id" in kwargs
        shard = kwargs.get("shard_id") if expert_path else (args[0] if args else None)
        self.writes.append((self.name, shard, kwargs.get("expert_id")))


def _sglang_targets(all_names: list[str]) -> dict[str, frozenset]:
    """name -> the (parameter, shard, expert) writes SGLang's loader makes for it alone."""
    from sglang.srt.models.kimi_k3 import (
        KimiK3ForConditionalGeneration,
        KimiK3LinearForCausalLM,
    )

    outer_load = inspect.unwrap(KimiK3ForConditionalGeneration.load_weights)
    inner_load = inspect.unwrap(KimiK3LinearForCausalLM.load_weights)
    writes: list = []
    # Every parameter the restatement predicts, and SGLang's own fused expert buffers: a
    # name SGLang looks up under another name finds nothing, and the test says so.
    keys = {k for n in all_names for k in contract.served_keys(n)}
    experts = {
        f"model.layers.{layer}.mlp.experts.{buf}"
        for layer in range(LAYERS)
        for buf in ("w13_weight", "w2_weight", "w13_weight_scale", "w2_weight_scale")
    }
    params = {k: _Param(k, writes) for k in keys | experts}
    config = SimpleNamespace(
        linear_attn_config={},
        is_moe=True,
        num_experts=2,
        num_hidden_layers=LAYERS,
        is_kda_layer=lambda i: False,
        is_linear_attn=False,
        language_only=False,
    )
    inner = SimpleNamespace(
        config=config,
        model=SimpleNamespace(start_layer=0, end_layer=LAYERS),
        named_parameters=lambda: list(params.items()),
        post_load_weights=lambda: None,
    )
    inner.load_weights = lambda weights: inner_load(inner, split_w31_items(weights))
    outer = SimpleNamespace(
        hf_to_sglang_mapper=KimiK3ForConditionalGeneration.hf_to_sglang_mapper,
        config=config,
        language_model=inner,
        named_parameters=lambda remove_duplicate=False: list(params.items()),
    )
    targets = {}
    for name in all_names:
        writes.clear()
        outer_load(outer, iter([(name, torch.zeros(2, 2, dtype=torch.uint8))]))
        targets[name] = frozenset(writes)
    return targets


def test_served_keys_meet_exactly_when_sglang_writes_one_parameter(plugins):
    all_names = names()
    targets = _sglang_targets(all_names)
    unreached = [n for n, t in targets.items() if not t]
    assert unreached == []  # else the comparison below would be vacuous for them
    keys = {n: set(contract.served_keys(n)) for n in all_names}
    disagree = [
        (a, b)
        for a, b in itertools.combinations(all_names, 2)
        if bool(targets[a] & targets[b]) != bool(keys[a] & keys[b])
    ]
    assert disagree == [], disagree[:5]
    # Negative control: the grammar has folds in it at all.
    folded = sum(bool(keys[a] & keys[b]) for a, b in itertools.combinations(all_names, 2))
    assert folded > len(all_names)


def test_name_collisions_names_each_folded_pair_once():
    pairs = contract.name_collisions(names())
    seconds = [second for _, second, _ in pairs]
    assert len(seconds) == len(set(seconds))
    for first, second, key in pairs:
        assert key in contract.served_keys(first) and key in contract.served_keys(second)
