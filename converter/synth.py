"""Synthetic Kimi-K3-format checkpoints, for tests, the demo and benchmarks.

The layout mirrors the real model: a nested `text_config`, a compressed-tensors MXFP4
`quantization_config`, routed experts under `language_model.model.layers.L.mlp.experts.E.`
as packed FP4 + E8M0 scales, non-expert tensors of several dtypes, several shards with some
w1/w3 partners deliberately split across shards, and tokenizer-like extra files. Scale
exponents are chosen so that a unit-variance input gives gate pre-activations of a few units
(the range where SiTU's tanh saturation matters); a few all-zero groups use E8M0 byte 0.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .plan import shard_name
from .safetensors_format import HeaderEntry, build_header, tensor_nbytes

REAL_K, REAL_N = 3584, 3072
PREFIX = "language_model.model.layers"


@dataclass(frozen=True)
class SynthSpec:
    layers: int = 3
    experts: int = 8
    hidden: int = 256  # model hidden size (attention, embeddings)
    k: int = 128  # routed_expert_hidden_size
    n: int = 64  # moe_intermediate_size
    top_k: int = 2
    shards: int = 3
    vocab: int = 512
    seed: int = 0
    situ_beta: float = 4.0
    situ_linear_beta: float = 25.0
    routed_scaling_factor: float = 2.5


def quantization_config() -> dict:
    """What compressed-tensors writes for an MXFP4 weight-only scheme (abridged)."""
    return {
        "quant_method": "compressed-tensors",
        "format": "mxfp4-pack-quantized",
        "quantization_status": "compressed",
        "config_groups": {
            "group_0": {
                "format": "mxfp4-pack-quantized",
                "targets": ["Linear"],
                "weights": {
                    "num_bits": 4, "type": "float", "strategy": "group", "group_size": 32,
                    "symmetric": True, "dynamic": False, "scale_dtype": "torch.uint8",
                },
                "input_activations": None,
                "output_activations": None,
            }
        },
        "ignore": ["re:.*self_attn.*", "re:.*mlp.gate$", "re:.*shared_experts.*",
                   "language_model.lm_head"],
        "kv_cache_scheme": None,
        "sparsity_config": {},
        "transform_config": {},
        "version": "0.20.0",
    }  # fmt: skip


def make_config(spec: SynthSpec) -> dict:
    text = {
        "model_type": "kimi_k3",
        "architectures": ["KimiK3LinearForCausalLM"],
        "hidden_size": spec.hidden,
        "routed_expert_hidden_size": spec.k,
        "moe_intermediate_size": spec.n,
        "intermediate_size": spec.hidden * 2,
        "num_experts": spec.experts,
        "num_experts_per_token": spec.top_k,
        "num_shared_experts": 1,
        "num_hidden_layers": spec.layers,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "head_dim": spec.hidden // 4,
        "vocab_size": spec.vocab,
        "hidden_act": "situ",
        "activation_situ_beta": spec.situ_beta,
        "activation_situ_linear_beta": spec.situ_linear_beta,
        "routed_scaling_factor": spec.routed_scaling_factor,
        "rms_norm_eps": 1e-5,
        "torch_dtype": "bfloat16",
    }
    return {
        "architectures": ["KimiK3ForConditionalGeneration"],
        "model_type": "kimi_k3_vl",
        "text_config": text,
        "quantization_config": quantization_config(),
        "torch_dtype": "bfloat16",
        "transformers_version": "4.57.0",
    }


def _scale_bytes(rng: np.random.Generator, rows: int, k: int) -> np.ndarray:
    """E8M0 exponents around 2^-c so that sum_k w*x has a std of ~6 for unit x."""
    center = 127 - round(math.log2(math.sqrt(k) * 3.2 / 6.0))
    scales = rng.integers(center - 1, center + 2, size=(rows, k // 32), dtype=np.uint8)
    scales.flat[:: max(1, scales.size // 3)] = 0  # a few all-zero groups: byte 0 is valid
    return scales


def _fp4_bytes(rng: np.random.Generator, rows: int, k: int, scales: np.ndarray) -> np.ndarray:
    packed = rng.integers(0, 256, size=(rows, k // 2), dtype=np.uint8)
    zero_groups = np.repeat(scales == 0, 16, axis=1)  # 16 bytes = one group of 32 values
    packed[zero_groups] = 0
    return packed


def _expert_tensors(rng, prefix: str, spec: SynthSpec):
    n, k = spec.n, spec.k
    out = []
    for proj, rows, cols in (("w1", n, k), ("w2", k, n), ("w3", n, k)):
        scale = _scale_bytes(rng, rows, cols)
        out.append(
            (
                f"{prefix}.{proj}.weight_packed",
                "U8",
                (rows, cols // 2),
                _fp4_bytes(rng, rows, cols, scale),
            )
        )
        out.append((f"{prefix}.{proj}.weight_scale", "U8", (rows, cols // 32), scale))
    return out  # fmt: skip


def _dense(rng, name: str, dtype: str, shape: tuple[int, ...]):
    nbytes = tensor_nbytes(dtype, shape)
    if dtype == "F32":
        data = (rng.standard_normal(math.prod(shape)) * 0.02).astype(np.float32)
    else:  # bf16/f16: random small-magnitude bit patterns are fine for byte-level tests
        data = (rng.standard_normal(math.prod(shape)) * 0.02).astype(np.float32)
        data = (
            (data.view(np.uint32) >> 16).astype(np.uint16)
            if dtype == "BF16"
            else data.astype(np.float16)
        )
    raw = np.frombuffer(data.tobytes(), dtype=np.uint8)
    assert raw.size == nbytes
    return (name, dtype, shape, raw)


def _tensors(spec: SynthSpec):
    rng = np.random.default_rng(spec.seed)
    h = spec.hidden
    yield _dense(rng, "language_model.model.embed_tokens.weight", "BF16", (spec.vocab, h))
    for layer in range(spec.layers):
        p = f"{PREFIX}.{layer}"
        for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
            yield _dense(rng, f"{p}.self_attn.{proj}.weight", "BF16", (h, h))
        yield _dense(rng, f"{p}.input_layernorm.weight", "BF16", (h,))
        yield _dense(rng, f"{p}.post_attention_layernorm.weight", "BF16", (h,))
        yield _dense(rng, f"{p}.mlp.gate.weight", "F32", (spec.experts, h))
        yield _dense(rng, f"{p}.mlp.gate.e_score_correction_bias", "F32", (spec.experts,))
        # Shared experts use w1/w3 names too, but are not routed experts: copied as-is.
        for proj, shape in (("w1", (spec.n, h)), ("w3", (spec.n, h)), ("w2", (h, spec.n))):
            yield _dense(rng, f"{p}.mlp.shared_experts.{proj}.weight", "BF16", shape)
        for e in range(spec.experts):
            yield from _expert_tensors(rng, f"{p}.mlp.experts.{e}", spec)
    yield _dense(rng, "language_model.model.norm.weight", "BF16", (h,))
    yield _dense(rng, "language_model.lm_head.weight", "BF16", (spec.vocab, h))


def write_safetensors(path: Path, tensors: list) -> None:
    entries = [HeaderEntry(n, d, s, a.nbytes) for n, d, s, a in tensors]
    with open(path, "wb") as fh:
        fh.write(build_header(entries))
        for *_, arr in tensors:
            fh.write(memoryview(np.ascontiguousarray(arr)).cast("B"))


EXTRA_FILES = {
    "tokenizer_config.json": json.dumps({"model_max_length": 8192, "tokenizer_class": "Kimi"}),
    "tokenizer.json": json.dumps({"version": "1.0", "model": {"type": "BPE", "vocab": {}}}),
    "chat_template.jinja": "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}{% endfor %}\n",
    "generation_config.json": json.dumps({"max_new_tokens": 512, "temperature": 0.6}),
    "modeling_kimi_k3.py": "# Custom modeling code shipped with the checkpoint.\n",
    "README.md": "# Synthetic Kimi-K3-format checkpoint\n\nRandom weights, real layout.\n",
}


def synth_checkpoint(out: Path, spec: SynthSpec) -> dict:
    """Write a checkpoint; returns a small summary. Streams shard by shard."""
    out.mkdir(parents=True, exist_ok=True)
    all_tensors = list(_tensors(spec))
    # Move one expert's w3 to the last shard so partners are certainly split across shards.
    moved = [t for t in all_tensors if ".experts.0.w3." in t[0] and t[0].startswith(f"{PREFIX}.0.")]
    rest = [t for t in all_tensors if t not in moved]
    total = sum(t[3].nbytes for t in rest)
    per_shard = math.ceil(total / spec.shards)
    groups: list[list] = [[]]
    size = 0
    for t in rest:
        if size >= per_shard and len(groups) < spec.shards:
            groups.append([])
            size = 0
        groups[-1].append(t)
        size += t[3].nbytes
    groups[-1].extend(moved)
    weight_map = {}
    for i, group in enumerate(groups, start=1):
        name = shard_name(i, len(groups)) if len(groups) > 1 else "model-00001-of-00001.safetensors"
        write_safetensors(out / name, group)
        weight_map.update({t[0]: name for t in group})
    index = {"metadata": {"total_size": sum(t[3].nbytes for t in all_tensors)},
             "weight_map": weight_map}  # fmt: skip
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    (out / "config.json").write_text(json.dumps(make_config(spec), indent=2) + "\n")
    for name, text in EXTRA_FILES.items():
        (out / name).write_text(text)
    return {
        "tensors": len(all_tensors),
        "shards": len(groups),
        "bytes": index["metadata"]["total_size"],
    }
