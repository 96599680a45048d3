"""`synth`'s layouts: the published one by default (spelling, dtypes, config, shards, other
files), the coverage one on request, MLA dims SGLang's Triton decode compiles, peaked logits."""

from __future__ import annotations

import json
import math
import struct

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kimi_w31.converter.synth import (
    COVERAGE_IGNORE,
    EXTRA_FILES,
    PUBLISHED_IGNORE,
    REAL_ATTN,
    AttnDims,
    SynthSpec,
    cli_spec,
    make_config,
    synth_checkpoint,
    tensor_bytes,
    tensor_specs,
)

SETTINGS = settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
# SGLang's Triton MLA decode kernel compiles these (kv_lora_rank, qk_rope_head_dim) pairs.
TRITON_MLA = {(512, 64), (256, 32)}


@st.composite
def specs(draw) -> SynthSpec:
    layers = draw(st.integers(1, 9))
    return SynthSpec(
        layers=layers,
        dense_layers=draw(st.integers(0, layers - 1)),
        moe_every=draw(st.integers(1, 2)),
        experts=2,
        attn=AttnDims(shared_experts=draw(st.integers(0, 2))),
        published=draw(st.booleans()),
    )


@SETTINGS
@given(specs())
def test_moe_blocks_are_spelled_as_published_and_dense_ones_mlp(spec):
    moe = set(spec.moe_layers())
    for name, _, _ in tensor_specs(spec):
        if ".layers." not in name or not any(f in name for f in (".mlp.", ".block_sparse_moe.")):
            continue
        layer = int(name.split(".layers.")[1].split(".")[0])
        published_moe = spec.published and layer in moe
        assert (".block_sparse_moe." in name) == published_moe, name


@SETTINGS
@given(specs())
def test_dtypes_as_published(spec):
    """Conv, A_log, dt_bias, o_norm and the router bias F32, the router BF16, experts U8."""
    f32 = ("_conv1d.weight", ".A_log", ".dt_bias", ".o_norm.weight", ".e_score_correction_bias")
    for name, dtype, shape in tensor_specs(spec):
        if name.endswith(f32):
            assert dtype == "F32", name
        elif ".experts." in name and ".shared_experts." not in name:
            assert dtype == "U8", name
        else:
            assert dtype == "BF16", name
        if name.endswith(".A_log"):
            assert shape == (spec.attn.kda_head_dim,)


def test_a_log_is_the_heads_then_zeros():
    spec = SynthSpec(layers=2)
    (name, dtype, shape) = next(t for t in tensor_specs(spec) if t[0].endswith(".A_log"))
    values = np.frombuffer(tensor_bytes(spec, name, dtype, shape).tobytes(), np.float32)
    heads = spec.attn.kda_heads
    assert values.shape == (spec.attn.kda_head_dim,) and heads < values.size
    assert np.all(values[:heads] != 0) and np.all(values[heads:] == 0)


@given(published=st.booleans())
def test_the_quantization_config_sits_where_the_layout_puts_it(published):
    config = make_config(SynthSpec(published=published))
    text = config["text_config"]
    assert ("quantization_config" in text) == published
    assert ("quantization_config" in config) != published
    qc = text["quantization_config"] if published else config["quantization_config"]
    assert qc["ignore"] == (PUBLISHED_IGNORE if published else COVERAGE_IGNORE)
    assert ("model_type" in config["vision_config"]) != published
    if published:
        assert text["model_type"] == "kimi_linear"
        assert text["architectures"] == ["KimiLinearForCausalLM"]
        assert text["routed_scaling_factor"] == 1.0
        assert {"auto_map", "dtype", "tie_word_embeddings", "bos_token_id"} <= set(config)


def test_token_ids_are_in_the_vocabulary_and_the_published_ones_at_its_size():
    for vocab, ids in ((512, None), (163840, (163584, 163586, 163839, 163605))):
        config = make_config(SynthSpec(vocab=vocab))
        got = tuple(
            config[k]
            for k in ("bos_token_id", "eos_token_id", "pad_token_id", "media_placeholder_token_id")
        )
        assert all(0 <= i < vocab for i in got)
        assert ids is None or got == ids


def test_mla_dims_are_ones_the_triton_decode_kernel_compiles():
    for real in (False, True):
        spec = cli_spec(
            layers=2,
            dense_layers=None,
            moe_every=1,
            experts=2,
            top_k=2,
            shards=None,
            real_dims=real,
            k=None,
            n=None,
            seed=0,
        )
        text = make_config(spec)["text_config"]
        assert (text["kv_lora_rank"], text["qk_rope_head_dim"]) in TRITON_MLA
    assert (REAL_ATTN.heads, REAL_ATTN.intermediate, REAL_ATTN.attn_res_block) == (96, 33792, 12)


def test_the_published_files_shards_and_headers(tmp_path):
    spec = SynthSpec(layers=3, experts=2)
    info = synth_checkpoint(tmp_path, spec)
    shards = sorted(p.name for p in tmp_path.glob("*.safetensors"))
    assert info["shards"] == spec.layers + 3
    assert shards == [f"model-{i:05d}-of-{info['shards']:06d}.safetensors" for i in range(1, 7)]
    for name in EXTRA_FILES:
        assert (tmp_path / name).is_file(), name
    assert (tmp_path / "assets" / "kimi-logo.png").read_bytes().startswith(b"\x89PNG")
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())["weight_map"]
    for layer in range(spec.layers):  # one shard per layer
        files = {f for n, f in index.items() if f".layers.{layer}." in n}
        assert files == {shards[layer]}
    for shard in shards:
        raw = (tmp_path / shard).read_bytes()
        (n,) = struct.unpack("<Q", raw[:8])
        assert "__metadata__" not in json.loads(raw[8 : 8 + n])


def test_the_coverage_layout_splits_a_pair_across_shards(tmp_path):
    spec = SynthSpec(layers=3, experts=2, published=False, shards=3)
    synth_checkpoint(tmp_path, spec)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())["weight_map"]
    p = "language_model.model.layers.1.mlp.experts.0."
    assert index[p + "w1.weight_packed"] != index[p + "w3.weight_packed"]
    assert not any(".block_sparse_moe." in n for n in index)


def _mean_top1(spec: SynthSpec, rows: int = 64) -> float:
    """Top-1 probability of lm_head over unit-RMS hidden states (the final norm's output
    when its weight is 1)."""
    name = "language_model.lm_head.weight"
    raw = tensor_bytes(spec, name, "BF16", (spec.vocab, spec.hidden)).tobytes()
    head = (np.frombuffer(raw, np.uint16).astype(np.uint32) << 16).view(np.float32)
    head = head.reshape(spec.vocab, spec.hidden)
    h = np.random.default_rng(1).standard_normal((rows, spec.hidden)).astype(np.float32)
    logits = h @ head.T
    p = np.exp(logits - logits.max(1, keepdims=True))
    return float((p.max(1) / p.sum(1)).mean())


def test_peak_makes_greedy_tokens_mean_something():
    peaked = SynthSpec(layers=2, peak=8.0)
    assert _mean_top1(peaked) > 0.5
    assert _mean_top1(SynthSpec(layers=2)) < 3 / peaked.vocab  # negative control: ~uniform
    norm = "language_model.model.norm.weight"
    raw = tensor_bytes(peaked, norm, "BF16", (peaked.hidden,)).tobytes()
    assert set(np.frombuffer(raw, np.uint16).tolist()) == {0x3F80}  # bf16 1.0
    name = "language_model.lm_head.weight"
    raw = tensor_bytes(peaked, name, "BF16", (peaked.vocab, peaked.hidden)).tobytes()
    head = (np.frombuffer(raw, np.uint16).astype(np.uint32) << 16).view(np.float32)
    assert math.isclose(head.std(), peaked.peak / math.sqrt(peaked.hidden), rel_tol=0.02)
