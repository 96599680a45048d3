"""A MoE layer whose local experts did not all receive every part stops the load.

Through SGLang's real Kimi-K3 loader and FusedMoE placement (the plugin's load hook, as under
a plain `python -m sglang.launch_server`): each kind of tensor dropped from a converted (and
an unconverted) checkpoint, for the adapter's method and SGLang's stock marlin path, at TP1
and on a TP2 rank and an EP2 rank. Only LOCAL experts count: a rank that does not hold the
missing expert loads.
"""

from __future__ import annotations

import pytest
from conftest import LAYERS, E, K, N
from harness import EXPERT_PREFIX, FakeK3Text, build_moe, load_with_real_loader, sglang_process
from kimi_w31.converter.reasons import Code

pytestmark = pytest.mark.sglang

P = EXPERT_PREFIX
MODULE = "model.layers.{L}.mlp.experts"

# name -> (predicate over checkpoint names that drops tensors, {layer: {part: expert ids}})
CONVERTED_DROPS = {
    "one-w31-packed": (
        lambda n: n == P.format(L=1, E=2) + "w31.weight_packed",
        {1: {"w31.weight_packed": [2]}},
    ),
    "one-w31-scale": (
        lambda n: n == P.format(L=0, E=3) + "w31.weight_scale",
        {0: {"w31.weight_scale": [3]}},
    ),
    "whole-layer-w2": (
        lambda n: ".layers.1." in n and ".w2." in n,
        {1: {"w2.weight_packed": list(range(E)), "w2.weight_scale": list(range(E))}},
    ),
    "one-w2-scale": (
        lambda n: n == P.format(L=0, E=1) + "w2.weight_scale",
        {0: {"w2.weight_scale": [1]}},
    ),
}
SOURCE_DROPS = {
    "one-w1-packed": (
        lambda n: n == P.format(L=0, E=2) + "w1.weight_packed",
        {0: {"w1.weight_packed": [2]}},
    ),
    "one-w3-scale": (
        lambda n: n == P.format(L=1, E=0) + "w3.weight_scale",
        {1: {"w3.weight_scale": [0]}},
    ),
}
BACKENDS = [("sm90", "flashinfer_mxfp4"), ("sm120", "flashinfer_mxfp4"), ("sm90", "marlin")]


def _load(path, tensors, *, arch, backend, inter=N, experts=E, setup=None):
    from sglang.srt.runtime_context import process_model_config

    with sglang_process(path, arch=arch, moe_runner_backend=backend):
        moes = [
            build_moe(experts=experts, hidden=K, inter=inter, layer_id=i) for i in range(LAYERS)
        ]
        for m in moes:
            if setup:
                setup(m)
        model = FakeK3Text(process_model_config().hf_config.text_config, moes)
        load_with_real_loader(model, tensors)
        return moes


def _expect_refusal(path, tensors, want, **kw) -> None:
    from kimi_w31.adapter.sglang.hooks import W31LoadError

    with pytest.raises(W31LoadError) as err:
        _load(path, tensors, **kw)
    assert Code.LAYER_INCOMPLETE.value in err.value.codes
    assert err.value.missing == {MODULE.format(L=layer): parts for layer, parts in want.items()}


@pytest.mark.parametrize(("arch", "backend"), BACKENDS)
@pytest.mark.parametrize("drop", sorted(CONVERTED_DROPS))
def test_tp1_refuses_each_missing_kind(
    plugins, converted_dir, converted_tensors, arch, backend, drop
):
    gone, want = CONVERTED_DROPS[drop]
    holed = {k: v for k, v in converted_tensors.items() if not gone(k)}
    _expect_refusal(converted_dir, holed, want, arch=arch, backend=backend)


@pytest.mark.parametrize("drop", sorted(SOURCE_DROPS))
def test_unconverted_checkpoint_through_the_stock_path_is_refused_too(
    plugins, source_dir, source_tensors, drop
):
    gone, want = SOURCE_DROPS[drop]
    holed = {k: v for k, v in source_tensors.items() if not gone(k)}
    _expect_refusal(source_dir, holed, want, arch="sm90", backend="marlin")


@pytest.mark.parametrize("rank", [0, 1])
@pytest.mark.parametrize("drop", sorted(CONVERTED_DROPS))
def test_tp2_rank_refuses_each_missing_kind(plugins, converted_dir, converted_tensors, drop, rank):
    """Every TP rank holds a slice of every expert: each rank misses what the checkpoint does."""

    def as_tp2(m):
        m.moe_tp_size, m.moe_tp_rank = 2, rank

    gone, want = CONVERTED_DROPS[drop]
    holed = {k: v for k, v in converted_tensors.items() if not gone(k)}
    _expect_refusal(
        converted_dir, holed, want, arch="sm90", backend="flashinfer_mxfp4",
        inter=N // 2, setup=as_tp2,
    )  # fmt: skip


def _as_ep2(rank: int):
    local = E // 2

    def setup(m):
        m.moe_ep_size, m.moe_ep_rank = 2, rank
        m._num_global_routed, m._num_local_routed, m._expert_storage_rank = E, local, rank

    return setup


@pytest.mark.parametrize("backend", ["flashinfer_mxfp4", "marlin"])
@pytest.mark.parametrize("drop", sorted(CONVERTED_DROPS))
def test_ep2_rank_refuses_only_its_own_missing_experts(
    plugins, converted_dir, converted_tensors, drop, backend
):
    """EP2 with 4 experts: rank 0 holds experts 0-1, rank 1 holds 2-3. A rank refuses exactly
    the missing parts of its own experts, named by their checkpoint ids; a rank none of whose
    experts lack anything loads."""
    gone, want = CONVERTED_DROPS[drop]
    holed = {k: v for k, v in converted_tensors.items() if not gone(k)}
    local = E // 2
    for rank in (0, 1):
        mine = range(rank * local, (rank + 1) * local)
        want_rank = {
            layer: kept
            for layer, parts in want.items()
            if (kept := {p: [e for e in ids if e in mine] for p, ids in parts.items()})
            and any(kept.values())
        }
        want_rank = {
            layer: {p: ids for p, ids in parts.items() if ids} for layer, parts in want_rank.items()
        }
        kw = dict(arch="sm90", backend=backend, experts=local, setup=_as_ep2(rank))
        if want_rank:
            _expect_refusal(converted_dir, holed, want_rank, **kw)
        else:
            moes = _load(converted_dir, holed, **kw)
            assert all(m.w13_weight.shape[0] == local for m in moes)


def test_a_complete_checkpoint_loads_on_every_rank(plugins, converted_dir, converted_tensors):
    for rank in (0, 1):
        _load(
            converted_dir, converted_tensors, arch="sm90", backend="flashinfer_mxfp4",
            experts=E // 2, setup=_as_ep2(rank),
        )  # fmt: skip
    _load(converted_dir, converted_tensors, arch="sm90", backend="marlin")


def test_only_the_first_load_is_held_to_completeness(plugins, converted_dir, converted_tensors):
    """A later in-place load (a weight update that carries part of the weights) is not."""
    from sglang.srt.models.kimi_k3 import KimiK3ForConditionalGeneration, KimiK3LinearForCausalLM
    from sglang.srt.runtime_context import process_model_config

    with sglang_process(converted_dir, arch="sm90", moe_runner_backend="marlin"):
        moes = [build_moe(experts=E, hidden=K, inter=N, layer_id=i) for i in range(LAYERS)]
        model = FakeK3Text(process_model_config().hf_config.text_config, moes)
        load_with_real_loader(model, converted_tensors)
        part = {k: v for k, v in converted_tensors.items() if ".layers.0." in k and ".w2." in k}
        mapped = KimiK3ForConditionalGeneration.hf_to_sglang_mapper.apply(iter(part.items()))
        KimiK3LinearForCausalLM.load_weights(
            model, ((n.replace("language_model.", "", 1), t) for n, t in mapped)
        )
        # and the hook left SGLang's own loader in place
        assert all("_weight_loader_impl" not in m.__dict__ for m in moes)


class _Placement:
    """EPLB's expert placement as FusedMoE reads it: 6 physical slots for 4 logical experts
    (0 and 1 replicated), 3 slots per EP rank."""

    num_logical_experts = E
    MAP = [0, 1, 2, 3, 0, 1]

    def __init__(self) -> None:
        import torch

        self.physical_to_logical_map_cpu = torch.tensor([self.MAP] * LAYERS)

    def logical_to_all_physical(self, layer_id, logical_id, require_global=False):
        return [p for p, lid in enumerate(self.MAP) if lid == logical_id]


@pytest.mark.parametrize("rank", [0, 1])
def test_eplb_replicas_name_logical_experts(
    plugins, converted_dir, converted_tensors, monkeypatch, rank
):
    """With EPLB, local slots hold physical replicas: a missing logical expert is missing on
    every rank that holds one of its replicas, named by its checkpoint id."""
    from sglang.srt.eplb import expert_location
    from sglang.srt.layers.moe.fused_moe_triton import layer as fused_layer

    placement = _Placement()
    for mod in (expert_location, fused_layer):
        monkeypatch.setattr(mod, "get_global_expert_location_metadata", lambda: placement)
    slots = 3

    def setup(m):
        m.moe_ep_size, m.moe_ep_rank = 2, rank
        m._num_global_routed, m._num_local_routed, m._expert_storage_rank = 6, slots, rank

    held = {placement.MAP[p] for p in range(rank * slots, (rank + 1) * slots)}
    for logical in range(E):
        gone = P.format(L=0, E=logical) + "w2.weight_scale"
        holed = {k: v for k, v in converted_tensors.items() if k != gone}
        kw = dict(arch="sm90", backend="flashinfer_mxfp4", experts=slots, setup=setup)
        if logical in held:
            want = {0: {"w2.weight_scale": [logical]}}
            _expect_refusal(converted_dir, holed, want, **kw)
        else:
            _load(converted_dir, holed, **kw)
