"""Validation and planning on hostile tensor sets (headers only): a plan that is exactly
right, or problems with reason codes; never another exception. And every listed manifest
mismatch through the CLI."""

from __future__ import annotations

from pathlib import Path

import faults as fl
from hypothesis import given
from hypothesis import strategies as st
from kimi_w31.converter.contract import parse_expert_name
from kimi_w31.converter.errors import Fatal
from kimi_w31.converter.manifest import load_manifest
from kimi_w31.converter.plan import plan_conversion
from kimi_w31.converter.reasons import Code
from kimi_w31.converter.safetensors_format import (
    ShardHeader,
    TensorInfo,
    parse_header_bytes,
    tensor_nbytes,
)
from kimi_w31.converter.source import Source
from kimi_w31.converter.synth import SynthSpec, make_config
from kimi_w31.converter.validate import validate_source

FAST = fl.fuzz(150)
MANIFEST = load_manifest("kimi-k3-any")
K, N = 64, 32
PREFIX = "language_model.model.layers.{L}.mlp."
SHAPES = {
    "w1.weight_packed": (N, K // 2),
    "w1.weight_scale": (N, K // 32),
    "w3.weight_packed": (N, K // 2),
    "w3.weight_scale": (N, K // 32),
    "w2.weight_packed": (K, N // 2),
    "w2.weight_scale": (K, N // 32),
}


def valid_tensors(layers: int, experts: int) -> list[tuple[str, str, tuple[int, ...]]]:
    out = [("embed.weight", "BF16", (16, 8)), ("norm.weight", "F32", (8,))]
    for layer in range(layers):
        out.append(
            (f"language_model.model.layers.{layer}.mlp.shared_experts.w1.weight", "BF16", (4, 8))
        )
        for e in range(experts):
            for key, shape in SHAPES.items():
                out.append((f"{PREFIX.format(L=layer)}experts.{e}.{key}", "U8", shape))
    return out


@st.composite
def hostile_sources(draw) -> tuple[Source, int]:
    layers, experts = draw(st.integers(1, 2)), draw(st.integers(1, 3))
    tensors = valid_tensors(layers, experts)
    for _ in range(draw(st.integers(0, 3))):
        i = draw(st.integers(0, len(tensors) - 1))
        name, dtype, shape = tensors[i]
        kind = draw(st.sampled_from(["drop", "shape", "dtype", "rename", "add", "zero"]))
        if kind == "drop":
            tensors.pop(i)
        elif kind == "shape":
            tensors[i] = (name, dtype, tuple(draw(st.lists(st.integers(0, 70), max_size=3))))
        elif kind == "dtype":
            tensors[i] = (name, draw(st.sampled_from(["I8", "BF16", "F4", "U8"])), shape)
        elif kind == "rename":
            new = draw(
                st.sampled_from(
                    [
                        name.replace("experts.", "experts.0"),
                        name.replace(".w1.", ".w31."),
                        name.replace(".w3.", ".w2."),
                        name.replace("experts.0.", f"experts.{experts}."),
                        name.replace(".mlp.", ".mlp.x."),
                        name.replace("layers.0", "layers.7"),
                        name + "_extra",
                    ]
                )
            )
            if all(new != t[0] for t in tensors):
                tensors[i] = (new, dtype, shape)
        elif kind == "add":
            e = draw(st.integers(0, experts + 1))
            key = draw(st.sampled_from([*SHAPES, "w31.weight_packed", "w4.weight_packed"]))
            new = f"{PREFIX.format(L=0)}experts.{e}.{key}"
            if all(new != t[0] for t in tensors):
                tensors.append((new, "U8", SHAPES.get(key, (N, K // 2))))
        else:  # a zero-element tensor
            tensors[i] = (name, dtype, (0, *shape[1:]))
    files = draw(st.integers(1, 3))
    order = draw(st.permutations(range(len(tensors))))
    per_file: dict[str, list] = {}
    for n, i in enumerate(order):
        per_file.setdefault(f"s{n % files}.safetensors", []).append(tensors[i])
    headers, weight_map = {}, {}
    for file, items in per_file.items():
        data_start, cursor, infos = 64, 64, {}
        for name, dtype, shape in items:
            size = tensor_nbytes(dtype, shape)
            infos[name] = TensorInfo(name, dtype, shape, cursor, cursor + size)
            cursor += size
            weight_map[name] = file
        headers[file] = ShardHeader(file, cursor, data_start, infos, {}, "0" * 64)
    config = make_config(SynthSpec(layers=layers, dense_layers=0, experts=experts, k=K, n=N))
    if draw(st.booleans()):
        config["text_config"][
            draw(
                st.sampled_from(
                    ["num_experts", "moe_intermediate_size", "routed_expert_hidden_size"]
                )
            )
        ] = draw(st.sampled_from([0, 1, 33, experts + 1, -1, "8", None]))
    source = Source(Path("/nonexistent"), "hyp", config, sorted(headers), headers)
    return source, draw(st.integers(1, 20_000))


@FAST
@given(case=hostile_sources())
def test_planner_is_exact_or_refuses(case) -> None:
    source, max_shard = case
    table, problems = validate_source(source, MANIFEST)
    if problems:
        assert all(isinstance(p.code, Code) for p in problems)
        return
    try:
        plan = plan_conversion(source, table, max_shard)
    except Fatal as exc:  # a header the planner will not write (e.g. F4 not filling a byte)
        assert exc.problems and all(isinstance(p.code, Code) for p in exc.problems)
        return
    src = {t.name: (f, t) for f, h in source.headers.items() for t in h.tensors.values()}
    outputs = {t.name: t for s in plan.shards for t in s.tensors}
    assert len(outputs) == sum(len(s.tensors) for s in plan.shards)  # each name once
    assert plan.weight_map().keys() == outputs.keys()
    # Every source byte range is used exactly once.
    used = sorted((p.file, p.offset, p.length) for t in outputs.values() for p in t.pieces)
    assert used == sorted((f, t.begin, t.nbytes) for f, t in src.values())
    for name, t in outputs.items():
        parsed = parse_expert_name(name)
        assert parsed is None or parsed.proj in ("w2", "w31"), name  # no w1/w3 left
        if parsed is not None and parsed.proj == "w31":
            up, gate = src[parsed.with_proj("w3")], src[parsed.with_proj("w1")]
            assert [(p.file, p.offset) for p in t.pieces] == [
                (up[0], up[1].begin),
                (gate[0], gate[1].begin),
            ]
            assert t.shape == (up[1].shape[0] + gate[1].shape[0], *up[1].shape[1:])
        else:
            f, info = src[name]
            assert (t.dtype, t.shape, t.pieces[0].file) == (info.dtype, info.shape, f)
    for shard in plan.shards:
        assert shard.data_size <= max_shard or len(shard.tensors) == 1
        parsed_header = parse_header_bytes(shard.name, shard.header[8:], shard.file_size)
        assert list(parsed_header.tensors) == [t.name for t in shard.tensors]


def test_leading_zero_expert_id_is_refused() -> None:
    """`experts.01.` would alias expert 1: refused, never silently dropped or a KeyError."""
    tensors = [(n.replace("experts.1.", "experts.01."), d, s) for n, d, s in valid_tensors(1, 2)]
    headers, cursor, infos = {}, 64, {}
    for name, dtype, shape in tensors:
        size = tensor_nbytes(dtype, shape)
        infos[name] = TensorInfo(name, dtype, shape, cursor, cursor + size)
        cursor += size
    headers["s.safetensors"] = ShardHeader("s.safetensors", cursor, 64, infos, {}, "0" * 64)
    config = make_config(SynthSpec(layers=1, dense_layers=0, experts=2, k=K, n=N))
    source = Source(Path("/nonexistent"), "x", config, ["s.safetensors"], headers)
    _, problems = validate_source(source, MANIFEST)
    assert {p.code for p in problems if "experts.01." in (p.tensor or "")} == {Code.EXPERT_NAME}


def test_every_manifest_mismatch_is_a_clean_cli_error(tmp_path: Path) -> None:
    template = fl.make_source(tmp_path / "template")  # the cases assume 8 experts
    rows = fl.plan_cases(template, tmp_path / "work")
    assert len(rows) == len(fl.PLAN_CASES) + 1 >= 19
    assert not fl.bad_rows(rows, {fl.CLEAN}), fl.bad_rows(rows, {fl.CLEAN})
