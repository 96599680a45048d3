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
import zlib
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import numpy as np

from .plan import shard_name
from .safetensors_format import HeaderEntry, build_header, tensor_nbytes

REAL_K, REAL_N = 3584, 3072
PREFIX = "language_model.model.layers"


@dataclass(frozen=True)
class SynthSpec:
    layers: int = 3  # num_hidden_layers
    dense_layers: int = 1  # first_k_dense_replace: a dense prefix, as the real model has
    moe_every: int = 1  # moe_layer_freq
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

    def moe_layers(self) -> list[int]:
        """The contract's MoE-layer rule applied to this spec."""
        return [i for i in range(self.layers) if i >= self.dense_layers and i % self.moe_every == 0]


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
                    "num_bits": 4,
                    "type": "float",
                    "strategy": "group",
                    "group_size": 32,
                    "symmetric": True,
                    "dynamic": False,
                    "scale_dtype": "torch.uint8",
                },
                "input_activations": None,
                "output_activations": None,
            }
        },
        "ignore": [
            "re:.*self_attn.*",
            "re:.*mlp.gate$",
            "re:.*shared_experts.*",
            "language_model.lm_head",
        ],
        "kv_cache_scheme": None,
        "sparsity_config": {},
        "transform_config": {},
        "version": "0.20.0",
    }


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
        "first_k_dense_replace": spec.dense_layers,
        "moe_layer_freq": spec.moe_every,
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
        # MLA attention dims: SGLang's ModelConfig derives its attention scaling from them.
        "q_lora_rank": None,
        "kv_lora_rank": 64,
        "qk_nope_head_dim": 32,
        "qk_rope_head_dim": 16,
        "v_head_dim": 32,
    }
    return {
        "architectures": ["KimiK3ForConditionalGeneration"],
        # The model type SGLang registers for Kimi-K3 (its KimiK3Config).
        "model_type": "kimi_k3",
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


def _rng(spec: SynthSpec, name: str) -> np.random.Generator:
    # One generator per tensor: data does not depend on shard layout or write order.
    return np.random.default_rng([spec.seed, zlib.crc32(name.encode())])


def _dense_bytes(spec: SynthSpec, name: str, dtype: str, shape: tuple[int, ...]) -> np.ndarray:
    data = (_rng(spec, name).standard_normal(math.prod(shape)) * 0.02).astype(np.float32)
    if dtype == "BF16":
        data = (data.view(np.uint32) >> 16).astype(np.uint16)
    elif dtype == "F16":
        data = data.astype(np.float16)
    return np.frombuffer(data.tobytes(), dtype=np.uint8)


def tensor_bytes(spec: SynthSpec, name: str, dtype: str, shape: tuple[int, ...]) -> np.ndarray:
    """The deterministic content of one synthetic tensor, generated on demand."""
    if name.endswith(".weight_scale"):
        return _scale_bytes(_rng(spec, name), shape[0], shape[1] * 32)
    if name.endswith(".weight_packed"):
        scale_name = name[: -len("weight_packed")] + "weight_scale"
        scales = _scale_bytes(_rng(spec, scale_name), shape[0], shape[1] * 2)
        return _fp4_bytes(_rng(spec, name), shape[0], shape[1] * 2, scales)
    return _dense_bytes(spec, name, dtype, shape)


def tensor_specs(spec: SynthSpec) -> list[tuple[str, str, tuple[int, ...]]]:
    """(name, dtype, shape) of every tensor, in checkpoint order; no data."""
    h, n, k = spec.hidden, spec.n, spec.k
    out = [("language_model.model.embed_tokens.weight", "BF16", (spec.vocab, h))]
    moe = set(spec.moe_layers())
    for layer in range(spec.layers):
        p = f"{PREFIX}.{layer}"
        for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
            out.append((f"{p}.self_attn.{proj}.weight", "BF16", (h, h)))
        out.append((f"{p}.input_layernorm.weight", "BF16", (h,)))
        out.append((f"{p}.post_attention_layernorm.weight", "BF16", (h,)))
        if layer not in moe:  # a dense MLP (gate_proj/up_proj/down_proj), no experts
            inter = spec.hidden * 2
            for proj, shape in (
                ("gate_proj", (inter, h)),
                ("up_proj", (inter, h)),
                ("down_proj", (h, inter)),
            ):
                out.append((f"{p}.mlp.{proj}.weight", "BF16", shape))
            continue
        out.append((f"{p}.mlp.gate.weight", "F32", (spec.experts, h)))
        out.append((f"{p}.mlp.gate.e_score_correction_bias", "F32", (spec.experts,)))
        # Shared experts use w1/w3 names too, but are not routed experts: copied as-is.
        for proj, shape in (("w1", (n, h)), ("w3", (n, h)), ("w2", (h, n))):
            out.append((f"{p}.mlp.shared_experts.{proj}.weight", "BF16", shape))
        for e in range(spec.experts):
            for proj, rows, cols in (("w1", n, k), ("w2", k, n), ("w3", n, k)):
                q = f"{p}.mlp.experts.{e}.{proj}"
                out.append((f"{q}.weight_packed", "U8", (rows, cols // 2)))
                out.append((f"{q}.weight_scale", "U8", (rows, cols // 32)))
    out.append(("language_model.model.norm.weight", "BF16", (h,)))
    out.append(("language_model.lm_head.weight", "BF16", (spec.vocab, h)))
    return out


def write_safetensors(path: Path, tensors: list) -> None:
    """Write (name, dtype, shape, uint8 array or a zero-arg callable returning one)."""
    entries = [HeaderEntry(n, d, s, tensor_nbytes(d, s)) for n, d, s, _ in tensors]
    with open(path, "wb") as fh:
        fh.write(build_header(entries))
        for *_, data in tensors:
            arr = data() if callable(data) else data
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
    """Write a checkpoint; returns a small summary. Generates data shard by shard."""
    out.mkdir(parents=True, exist_ok=True)
    specs = tensor_specs(spec)
    # Move one expert's w3 to the last shard so partners are certainly split across shards.
    first = spec.moe_layers()[0]
    moved = [t for t in specs if t[0].startswith(f"{PREFIX}.{first}.mlp.experts.0.w3.")]
    rest = [t for t in specs if t not in moved]
    sizes = {t[0]: tensor_nbytes(t[1], t[2]) for t in specs}
    per_shard = math.ceil(sum(sizes[t[0]] for t in rest) / spec.shards)
    groups: list[list] = [[]]
    size = 0
    for t in rest:
        if size >= per_shard and len(groups) < spec.shards:
            groups.append([])
            size = 0
        groups[-1].append(t)
        size += sizes[t[0]]
    groups[-1].extend(moved)
    weight_map = {}
    for i, group in enumerate(groups, start=1):
        name = shard_name(i, len(groups)) if len(groups) > 1 else "model-00001-of-00001.safetensors"
        lazy = [(n, d, s, partial(tensor_bytes, spec, n, d, s)) for n, d, s in group]
        write_safetensors(out / name, lazy)
        weight_map.update({t[0]: name for t in group})
    total = sum(sizes.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    (out / "config.json").write_text(json.dumps(make_config(spec), indent=2) + "\n")
    for name, text in EXTRA_FILES.items():
        (out / name).write_text(text)
    return {"tensors": len(specs), "shards": len(groups), "bytes": total}
