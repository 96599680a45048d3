"""Splitting fused w31 tensors into zero-copy w3/w1 views (no SGLang needed)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip(
    "torch", reason="the adapter works on torch tensors (make test installs the CPU build)"
)
from kimi_w31.adapter.split import SplitError, SplitStats, split_w31_items  # noqa: E402

P = "model.layers.3.mlp.experts.7."


def _w31(rows: int = 8, cols: int = 4) -> torch.Tensor:
    return torch.arange(rows * cols, dtype=torch.int32).to(torch.uint8).reshape(rows, cols)


def test_w31_becomes_up_then_gate_views():
    t = _w31()
    out = list(split_w31_items([(P + "w31.weight_packed", t)]))
    assert [name for name, _ in out] == [P + "w3.weight_packed", P + "w1.weight_packed"]
    up, gate = out[0][1], out[1][1]
    assert torch.equal(up, t[:4]) and torch.equal(gate, t[4:])
    assert up.data_ptr() == t.data_ptr()  # a view: no copy of the mmap'd tensor
    assert gate.data_ptr() == t.data_ptr() + 4 * t.stride(0)


def test_renamed_weight_suffix_and_scales_split_too():
    names = [
        n
        for n, _ in split_w31_items([(P + "w31.weight", _w31()), (P + "w31.weight_scale", _w31())])
    ]
    assert names == [P + "w3.weight", P + "w1.weight", P + "w3.weight_scale", P + "w1.weight_scale"]


def test_4d_scales_are_squeezed_first():
    t = _w31()
    out = list(split_w31_items([(P + "w31.weight_scale", t[:, None, :, None])]))
    assert out[0][1].shape == (4, 4) and torch.equal(out[1][1], t[4:])


def test_extra_tuple_elements_are_kept():
    out = list(split_w31_items([(P + "w31.weight_packed", _w31(), {"k": 1})]))
    assert all(item[2] == {"k": 1} for item in out)


def test_other_names_pass_through_untouched():
    items = [("model.layers.0.self_attn.q_proj.weight", _w31()), (P + "w2.weight_packed", _w31())]
    out = list(split_w31_items(items))
    assert [n for n, _ in out] == [n for n, _ in items]
    assert all(a[1] is b[1] for a, b in zip(out, items, strict=True))


@pytest.mark.parametrize("tail", ["w31.weight_shape", "w31.weight_packed\n"])
def test_a_fused_name_outside_the_grammar_is_refused(tail):
    with pytest.raises(SplitError, match=r"experts\.7\.w31") as err:
        list(split_w31_items([(P + tail, torch.tensor([8, 8]))]))
    assert err.value.codes == ("w31-unsplittable",)


@pytest.mark.parametrize(
    "name",
    [
        "model.layers.3.mlp.experts.07.w31.weight_packed",
        "model.layers.3.mlp.experts.\u0667.w31.weight_packed",
    ],
)
def test_look_alike_expert_ids_are_refused(name):
    with pytest.raises(SplitError):
        list(split_w31_items([(name, _w31())]))


def test_names_outside_the_experts_component_pass_untouched():
    items = [
        ("model.layers.3.mlp.shared_experts.0.w31.weight_packed", _w31()),
        ("model.layers.3.mlp.gate.weight", _w31()),
    ]
    assert [n for n, _ in split_w31_items(items)] == [n for n, _ in items]


def test_stats_record_fused_and_unfused_layers():
    stats = SplitStats()
    other = "model.layers.4.mlp.experts.0.w1.weight_packed"
    list(split_w31_items([(P + "w31.weight_packed", _w31()), (other, _w31())], stats))
    assert stats.w31_layers == {"model.layers.3.mlp.experts."}
    assert stats.w13_layers == {"model.layers.4.mlp.experts."}
    assert stats.w31_tensors == 1


@pytest.mark.parametrize("shape", [(7, 4), (0, 4), (8,), (2, 4, 4)])
def test_malformed_w31_fails_with_name_and_shape(shape):
    with pytest.raises(SplitError, match=r"experts\.7\.w31") as err:
        list(split_w31_items([(P + "w31.weight_packed", torch.zeros(shape, dtype=torch.uint8))]))
    assert str(tuple(shape)) in str(err.value)
