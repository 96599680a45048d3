"""The planner's fast paths (taken for the 500k tensors of the real model) must say exactly
what the careful paths say: same result when they answer, a fallback when they cannot.
"""

from __future__ import annotations

import json
import struct

import faults as fl
import pytest
import safetensors.numpy
from hypothesis import given
from hypothesis import strategies as st
from kimi_w31.converter.contract import INDEX_NAME, moe_layer_ids
from kimi_w31.converter.errors import Fatal
from kimi_w31.converter.manifest import expect, load_manifest, resolve_dims
from kimi_w31.converter.reasons import Code
from kimi_w31.converter.safetensors_format import (
    DTYPE_BITS,
    HeaderEntry,
    ShardHeader,
    TensorInfo,
    _parse_common_header,
    _parse_strict,
    build_header,
    parse_header_bytes,
    tensor_nbytes,
)
from kimi_w31.converter.source import (
    check_index_against_headers,
    check_weight_map,
    read_source,
)
from kimi_w31.converter.source.local import LocalOrigin
from kimi_w31.converter.synth import SynthSpec, make_config, tensor_specs
from kimi_w31.converter.validate import check_expert_tensors

FAST = fl.fuzz(200)

scalars = st.one_of(
    st.none(), st.booleans(), st.integers(-3, 70), st.floats(-2, 70), st.text("ab", max_size=2)
)
values = st.one_of(
    scalars,
    st.lists(st.one_of(st.integers(0, 9), scalars), max_size=3),
    st.sampled_from(sorted(DTYPE_BITS)),
)
entry_keys = st.sampled_from(["dtype", "shape", "data_offsets", "x"])


def _valid_entry(t: tuple[str, list[int], int]) -> list[tuple[str, object]]:
    dtype, shape, begin = t
    return [
        ("dtype", dtype),
        ("shape", shape),
        ("data_offsets", [begin, begin + tensor_nbytes(dtype, shape)]),
    ]


# Entries as lists of (key, value) pairs so key order and duplicates can be drawn too.
entries = st.one_of(
    st.tuples(
        st.sampled_from(sorted(DTYPE_BITS)),
        st.lists(st.integers(0, 6), max_size=3),
        st.integers(0, 3),
    ).map(_valid_entry),
    st.lists(st.tuples(entry_keys, values), max_size=4),
    scalars,
)


def _object(pairs) -> str:
    """JSON text of an object given as pairs, keeping order and duplicate keys."""
    if not isinstance(pairs, list):
        return json.dumps(pairs)
    return (
        "{"
        + ",".join(
            f"{json.dumps(k)}:{_object(v) if _is_pairs(v) else json.dumps(v)}" for k, v in pairs
        )
        + "}"
    )


def _is_pairs(v) -> bool:
    return isinstance(v, list) and all(isinstance(p, tuple) and len(p) == 2 for p in v) and v != []


@FAST
@given(
    doc=st.lists(st.tuples(st.sampled_from(["a", "b", "c", "__metadata__"]), entries), max_size=4),
    data_start=st.integers(8, 64),
)
def test_fast_header_parse_agrees_with_the_strict_one(doc, data_start: int) -> None:
    text = _object(doc)
    fast = _parse_common_header(text, data_start)
    if fast is None:
        return  # the strict path decides; its own tests cover what it says
    # Whatever the fast path accepts, the strict path accepts identically (same order too).
    tensors, metadata = _parse_strict("f", text, data_start)
    assert list(fast[0].items()) == list(tensors.items())
    assert fast[1] == metadata


@pytest.mark.parametrize(
    "text",
    [
        '{"a":{"shape":[1],"dtype":"U8","data_offsets":[0,1]}}',  # keys in another order
        '{"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1]},'
        '"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1]}}',  # the same tensor twice
        '{"__metadata__":{},"__metadata__":{}}',  # metadata twice
        '{"a":{"dtype":"U8","dtype":"U8","shape":[1],"data_offsets":[0,1]}}',  # key twice
        '{"a":{"dtype":"U8","shape":[true],"data_offsets":[0,1]}}',  # bool as a dimension
        '{"a":{"dtype":"U8","shape":[true,1],"data_offsets":[0,1]}}',  # the same, in 2-D
        '{"a":{"dtype":"U8","shape":[1,-1],"data_offsets":[0,0]}}',  # negative dimension
        '{"a":{"dtype":"U8","shape":[1],"data_offsets":[0.0,1]}}',  # float offset
    ],
)
def test_fast_header_parse_leaves_the_unusual_to_the_strict_path(text: str) -> None:
    assert _parse_common_header(text, 8) is None
    raw = text.encode()
    try:  # and the public parser still decides: key order is legal, the rest is not
        header = parse_header_bytes("f", raw, 8 + len(raw) + 1)
    except Fatal as exc:
        assert exc.problems[0].file == "f"
    else:
        assert text.startswith('{"a":{"shape"') and header.tensors["a"].shape == (1,)


def test_headers_real_writers_emit_take_the_fast_path(tmp_path) -> None:
    import numpy as np

    entries = [HeaderEntry(f"m.layers.{i}.w", "U8", (4, 2), 8) for i in range(5)]
    ours = build_header(entries)[8:].decode()
    lib = tmp_path / "lib.safetensors"
    safetensors.numpy.save_file(
        {"b": np.zeros((3, 2), np.float32), "a": np.ones(4, np.uint8)},
        lib,
        metadata={"format": "np"},
    )
    blob = lib.read_bytes()
    (n,) = struct.unpack("<Q", blob[:8])
    for text in (ours, blob[8 : 8 + n].decode()):
        assert _parse_common_header(text, 8) is not None


def _headers(files: dict[str, list[str]]) -> dict[str, ShardHeader]:
    out = {}
    for f, names in files.items():
        infos = {n: TensorInfo(n, "U8", (1,), 8 + i, 9 + i) for i, n in enumerate(names)}
        out[f] = ShardHeader(f, 8 + len(names), 8, infos, {}, "")
    return out


@pytest.mark.parametrize(
    "weight_map, why",
    [
        ({"a": "x", "b": "y", "c": "y"}, "tensor is in a different shard"),  # b, c swapped
        ({"a": "x", "b": "x", "z": "y"}, "does not hold"),  # c missing, z extra: same count
        ({"a": "x", "b": "x"}, "missing from"),  # c missing
    ],
)
def test_index_cross_check_fast_proof_never_hides_a_mismatch(weight_map: dict, why: str) -> None:
    headers = _headers({"x": ["a", "b"], "y": ["c"]})
    assert check_index_against_headers({"a": "x", "b": "x", "c": "y"}, headers, INDEX_NAME) == []
    problems = check_index_against_headers(weight_map, headers, INDEX_NAME)
    assert problems and any(why in p.what for p in problems)


def test_weight_map_check_words_values_that_are_not_names(tmp_path) -> None:
    problems = check_weight_map(tmp_path, {"a": ["x.safetensors"], "b": "ok.safetensors"}, "i")
    assert [p.tensor for p in problems] == ["a"] and "not a file name" in problems[0].what


def test_source_weight_map_answers_from_headers_like_the_index(small_source) -> None:
    index = json.loads((small_source / INDEX_NAME).read_text())["weight_map"]
    source = read_source(small_source, str(small_source), LocalOrigin())
    assert dict(source.weight_map) == index and len(source.weight_map) == len(index)
    name = next(iter(index))
    assert source.weight_map[name] == index[name]
    with pytest.raises(KeyError):
        source.weight_map["no.such.tensor"]


@pytest.mark.parametrize("drop", [None, "experts.3.w2.weight_scale", "experts.5."])
def test_expert_check_counts_whole_layers_and_details_broken_ones(drop: str | None) -> None:
    spec = SynthSpec(layers=3, experts=6)  # layer 0 dense; layers 1 and 2 MoE
    manifest = load_manifest("kimi-k3-any")
    dims, problems = resolve_dims(manifest, make_config(spec))
    assert problems == []
    infos = [
        ("s", TensorInfo(n, d, s, 0, 0))
        for n, d, s in tensor_specs(spec)
        if drop is None or not (n.endswith(drop) or drop in n and ".layers.2." in n)
    ]
    expected, _ = expect(manifest, make_config(spec), None)
    assert expected.dims == dims and expected.layers.moe == moe_layer_ids(make_config(spec))[0]
    table, problems = check_expert_tensors(expected, infos)
    layers = table.experts
    assert sorted(layers.values()) == ([5, 6] if drop == "experts.5." else [6, 6])
    if drop is None:
        assert problems == []
    elif drop == "experts.5.":
        assert [(p.code, p.found) for p in problems] == [(Code.LAYER_INCOMPLETE, "missing 5")]
    else:  # w2.weight_scale of expert 3 gone in both layers: its partners exist
        assert len(problems) == 2
        assert all(p.tensor.endswith("experts.3.w2.weight_scale") for p in problems)
