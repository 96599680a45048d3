"""Synthetic Kimi-K3-format checkpoints, for tests, the demo and benchmarks.

The inventory is the one SGLang 0.5.23's Kimi-K3 model class builds and loads
(`models/kimi_k3.py`, `models/kimi_k3_vl.py`, `configs/kimi_k3.py`): KDA and MLA attention
layers (with the K3 output gate and attention-residual projections), a dense-MLP prefix,
MoE layers with router and correction bias, shared experts, the latent projections and
norm, routed experts as packed FP4 + E8M0 scales, norms, embeddings, lm_head, and the
vision tower with its projector. docs/inventory.md lists every tensor kind and what the
converter does with it. A nested `text_config` and a compressed-tensors MXFP4
`quantization_config` that quantizes the routed experts only; several shards with some
w1/w3 partners deliberately split across shards; tokenizer-like extra files. Scale
exponents are chosen so that a unit-variance input gives gate pre-activations of a few
units (the range where SiTU's tanh saturation matters); a few all-zero groups use E8M0
byte 0.
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
REAL_HIDDEN = 7168
PREFIX = "language_model.model.layers"
TEXT = "language_model.model"


@dataclass(frozen=True)
class AttnDims:
    """Attention and dense-MLP dimensions (config fields of the same names)."""

    heads: int = 4  # num_attention_heads (MLA)
    q_lora_rank: int = 64
    kv_lora_rank: int = 64
    qk_nope_head_dim: int = 32
    qk_rope_head_dim: int = 16
    v_head_dim: int = 32
    kda_heads: int = 4  # linear_attn_config.num_heads
    kda_head_dim: int = 32  # linear_attn_config.head_dim
    conv_size: int = 4  # linear_attn_config.short_conv_kernel_size
    intermediate: int = 512  # intermediate_size (the dense MLP)
    shared_experts: int = 1  # num_shared_experts
    attn_res_block: int = 2  # attn_res_block_size


# The official model's dims where SGLang's code states them (hidden 7168, latent 3584 =
# k3_ar_fusion.NORM_DIM, 96 KDA heads of 128, shared experts 2 x N: "~264 MB/layer" of bf16);
# the MLA dims, the dense intermediate size and the residual block size are assumed
# (Kimi-K2's MLA, DeepSeek-V3's dense MLP).
REAL_ATTN = AttnDims(
    heads=64,
    q_lora_rank=1536,
    kv_lora_rank=512,
    qk_nope_head_dim=128,
    qk_rope_head_dim=64,
    v_head_dim=128,
    kda_heads=96,
    kda_head_dim=128,
    intermediate=18432,
    shared_experts=2,
    attn_res_block=8,
)


@dataclass(frozen=True)
class VisionDims:
    """The vision tower's config fields (KimiK3VisionConfig); one encoder block."""

    hidden: int = 64  # vt_hidden_size
    heads: int = 2  # vt_num_attention_heads
    qkv: int = 64  # qkv_hidden_size
    intermediate: int = 128  # vt_intermediate_size
    layers: int = 1  # vt_num_hidden_layers (the real tower has 27)
    patch: int = 14
    pos_emb: int = 4  # init_pos_emb_height and _width


# KimiK3VisionConfig's defaults, with one encoder block instead of 27.
REAL_VISION = VisionDims(hidden=1024, heads=12, qkv=1536, intermediate=4096, pos_emb=64)


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
    attn: AttnDims = AttnDims()
    vision: VisionDims = VisionDims()

    def moe_layers(self) -> list[int]:
        """The contract's MoE-layer rule applied to this spec."""
        return [i for i in range(self.layers) if i >= self.dense_layers and i % self.moe_every == 0]

    def mla_layers(self) -> list[int]:
        """Full-attention (MLA) layers: every fourth and the last, as Kimi's 3:1 KDA:MLA
        hybrid places them; every other layer is a KDA layer."""
        return [i for i in range(self.layers) if (i + 1) % 4 == 0 or i == self.layers - 1]


def cli_spec(
    *,
    layers: int,
    dense_layers: int | None,
    moe_every: int,
    experts: int,
    top_k: int,
    shards: int,
    real_dims: bool,
    k: int | None,
    n: int | None,
    seed: int,
) -> SynthSpec:
    """The spec `kimi-convert synth` writes for its options (None: the option's default).

    Default dims suit the SM90/SM120 MXFP4 MoE at one GPU (K a multiple of 256, N of 128);
    the hidden size is twice K, as in the real model (7168 = 2 x 3584)."""
    kk = k or (REAL_K if real_dims else 256)
    nn = n or (REAL_N if real_dims else 128)
    return SynthSpec(
        layers=layers,
        dense_layers=min(1, layers - 1) if dense_layers is None else dense_layers,
        moe_every=moe_every,
        experts=experts,
        k=kk,
        n=nn,
        top_k=min(top_k, experts),
        shards=shards,
        seed=seed,
        hidden=REAL_HIDDEN if real_dims else 2 * kk,
        **({"attn": REAL_ATTN, "vision": REAL_VISION} if real_dims else {}),
    )


def quantization_config() -> dict:
    """What compressed-tensors writes for an MXFP4 weight-only scheme on the routed experts.

    Only the routed experts are quantized: every other linear kind the model has is in
    `ignore`. The entries are regexes so that they match SGLang's module names
    (`model.layers.0.mlp.gate_up_proj`, fused from the checkpoint's `gate_proj`/`up_proj`)
    as well as the checkpoint's.
    """
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
            "re:.*self_attn.*",  # KDA and MLA projections
            r"re:.*mlp\.(gate_proj|up_proj|down_proj|gate_up_proj)$",  # dense MLPs
            r"re:.*mlp\.gate$",  # the router
            "re:.*shared_experts.*",
            r"re:.*routed_expert_(down|up)_proj$",  # latent MoE projections
            r"re:.*_res_proj$",  # attention-residual projections
            "re:.*lm_head$",
            "re:.*(vision_tower|mm_projector).*",
        ],
        "kv_cache_scheme": None,
        "sparsity_config": {},
        "transform_config": {},
        "version": "0.20.0",
    }


def make_config(spec: SynthSpec) -> dict:
    a, v = spec.attn, spec.vision
    mla = spec.mla_layers()
    text = {
        "model_type": "kimi_k3",
        "architectures": ["KimiK3LinearForCausalLM"],
        "hidden_size": spec.hidden,
        "routed_expert_hidden_size": spec.k,
        "latent_moe_use_norm": True,
        "moe_intermediate_size": spec.n,
        "intermediate_size": a.intermediate,
        "num_experts": spec.experts,
        "num_experts_per_token": spec.top_k,
        "num_shared_experts": a.shared_experts,
        "num_hidden_layers": spec.layers,
        "first_k_dense_replace": spec.dense_layers,
        "moe_layer_freq": spec.moe_every,
        "num_nextn_predict_layers": 0,
        "num_attention_heads": a.heads,
        "num_key_value_heads": a.heads,
        "vocab_size": spec.vocab,
        "hidden_act": "situ",
        "activation_situ_beta": spec.situ_beta,
        "activation_situ_linear_beta": spec.situ_linear_beta,
        "routed_scaling_factor": spec.routed_scaling_factor,
        "rms_norm_eps": 1e-5,
        "torch_dtype": "bfloat16",
        # MLA (full attention) layers
        "q_lora_rank": a.q_lora_rank,
        "kv_lora_rank": a.kv_lora_rank,
        "qk_nope_head_dim": a.qk_nope_head_dim,
        "qk_rope_head_dim": a.qk_rope_head_dim,
        "v_head_dim": a.v_head_dim,
        "mla_use_nope": True,
        "mla_use_output_gate": True,
        "attn_res_block_size": a.attn_res_block,
        # KDA (linear attention) layers; layer numbers are 1-based here, as SGLang reads them
        "linear_attn_config": {
            "kda_layers": [i + 1 for i in range(spec.layers) if i not in mla],
            "full_attn_layers": [i + 1 for i in mla],
            "num_heads": a.kda_heads,
            "head_dim": a.kda_head_dim,
            "short_conv_kernel_size": a.conv_size,
            "use_full_rank_gate": True,
            "gate_lower_bound": -5.0,
        },
    }
    vision = {
        "model_type": "kimi_k3_vision",
        "patch_size": v.patch,
        "init_pos_emb_height": v.pos_emb,
        "init_pos_emb_width": v.pos_emb,
        "vt_num_attention_heads": v.heads,
        "vt_num_hidden_layers": v.layers,
        "vt_hidden_size": v.hidden,
        "vt_intermediate_size": v.intermediate,
        "qkv_hidden_size": v.qkv,
        "merge_kernel_size": [2, 2],
        "text_hidden_size": spec.hidden,
    }
    return {
        "architectures": ["KimiK3ForConditionalGeneration"],
        # The model type SGLang registers for Kimi-K3 (its KimiK3Config).
        "model_type": "kimi_k3",
        "text_config": text,
        "vision_config": vision,
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


def _kda_attention(spec: SynthSpec, p: str) -> list[tuple[str, str, tuple[int, ...]]]:
    """KimiK3DeltaAttention with the full-rank gate: q/k/v/g land in fused_qkvg_proj, the
    conv weights in qkv_conv1d; the rest load by name."""
    h, a = spec.hidden, spec.attn
    proj = a.kda_heads * a.kda_head_dim
    out = [(f"{p}.{x}_proj.weight", "BF16", (proj, h)) for x in ("q", "k", "v", "g")]
    out += [(f"{p}.{x}_conv1d.weight", "BF16", (proj, 1, a.conv_size)) for x in ("q", "k", "v")]
    out += [
        (f"{p}.b_proj.weight", "BF16", (a.kda_heads, h)),
        (f"{p}.f_a_proj.weight", "BF16", (a.kda_head_dim, h)),
        (f"{p}.f_b_proj.weight", "BF16", (proj, a.kda_head_dim)),
        (f"{p}.A_log", "F32", (a.kda_heads,)),
        (f"{p}.dt_bias", "F32", (proj,)),
        (f"{p}.o_norm.weight", "BF16", (a.kda_head_dim,)),
        (f"{p}.o_proj.weight", "BF16", (h, proj)),
    ]
    return out


def _mla_attention(spec: SynthSpec, p: str) -> list[tuple[str, str, tuple[int, ...]]]:
    """KimiK3MLAAttention (DeepSeek MLA with q_lora_rank, plus the output gate): q_a_proj and
    kv_a_proj_with_mqa land in fused_qkv_a_proj_with_mqa."""
    h, a = spec.hidden, spec.attn
    qk = a.qk_nope_head_dim + a.qk_rope_head_dim
    return [
        (f"{p}.q_a_proj.weight", "BF16", (a.q_lora_rank, h)),
        (f"{p}.q_a_layernorm.weight", "BF16", (a.q_lora_rank,)),
        (f"{p}.q_b_proj.weight", "BF16", (a.heads * qk, a.q_lora_rank)),
        (f"{p}.kv_a_proj_with_mqa.weight", "BF16", (a.kv_lora_rank + a.qk_rope_head_dim, h)),
        (f"{p}.kv_a_layernorm.weight", "BF16", (a.kv_lora_rank,)),
        (
            f"{p}.kv_b_proj.weight",
            "BF16",
            (a.heads * (a.qk_nope_head_dim + a.v_head_dim), a.kv_lora_rank),
        ),
        (f"{p}.g_proj.weight", "BF16", (a.heads * a.v_head_dim, h)),
        (f"{p}.o_proj.weight", "BF16", (h, a.heads * a.v_head_dim)),
    ]


def _mlp(p: str, hidden: int, inter: int) -> list[tuple[str, str, tuple[int, ...]]]:
    """KimiK3MLP: gate_proj/up_proj land in gate_up_proj."""
    return [
        (f"{p}.gate_proj.weight", "BF16", (inter, hidden)),
        (f"{p}.up_proj.weight", "BF16", (inter, hidden)),
        (f"{p}.down_proj.weight", "BF16", (hidden, inter)),
    ]


def _vision(spec: SynthSpec) -> list[tuple[str, str, tuple[int, ...]]]:
    """KimiK3VisionTower and KimiK3MultiModalProjector with the config's defaults: RMS
    norms, no biases."""
    v = spec.vision
    out = [
        ("vision_tower.patch_embed.proj.weight", "BF16", (v.hidden, 3, v.patch, v.patch)),
        ("vision_tower.patch_embed.pos_emb.weight", "BF16", (v.pos_emb, v.pos_emb, v.hidden)),
    ]
    for i in range(v.layers):
        b = f"vision_tower.encoder.blocks.{i}"
        out += [
            (f"{b}.norm0.weight", "BF16", (v.hidden,)),
            (f"{b}.norm1.weight", "BF16", (v.hidden,)),
            (f"{b}.wqkv.weight", "BF16", (3 * v.qkv, v.hidden)),
            (f"{b}.wo.weight", "BF16", (v.hidden, v.qkv)),
            (f"{b}.mlp.fc0.weight", "BF16", (v.intermediate, v.hidden)),
            (f"{b}.mlp.fc1.weight", "BF16", (v.hidden, v.intermediate)),
        ]
    merged = v.hidden * 4  # merge_kernel_size 2 x 2
    out += [
        ("vision_tower.encoder.final_layernorm.weight", "BF16", (v.hidden,)),
        ("mm_projector.proj.0.weight", "BF16", (merged, merged)),
        ("mm_projector.proj.2.weight", "BF16", (spec.hidden, merged)),
        ("mm_projector.post_norm.weight", "BF16", (spec.hidden,)),
    ]
    return out


def tensor_specs(spec: SynthSpec) -> list[tuple[str, str, tuple[int, ...]]]:
    """(name, dtype, shape) of every tensor, in checkpoint order; no data."""
    h, n, k = spec.hidden, spec.n, spec.k
    out = [(f"{TEXT}.embed_tokens.weight", "BF16", (spec.vocab, h))]
    moe, mla = set(spec.moe_layers()), set(spec.mla_layers())
    for layer in range(spec.layers):
        p = f"{PREFIX}.{layer}"
        attn = _mla_attention if layer in mla else _kda_attention
        out += attn(spec, f"{p}.self_attn")
        out.append((f"{p}.input_layernorm.weight", "BF16", (h,)))
        out.append((f"{p}.post_attention_layernorm.weight", "BF16", (h,)))
        for res in ("self_attention", "mlp"):  # the attention-residual stream
            out.append((f"{p}.{res}_res_norm.weight", "BF16", (h,)))
            out.append((f"{p}.{res}_res_proj.weight", "BF16", (1, h)))
        if layer not in moe:  # a dense MLP, no experts
            out += _mlp(f"{p}.mlp", h, spec.attn.intermediate)
            continue
        out.append((f"{p}.mlp.gate.weight", "F32", (spec.experts, h)))
        out.append((f"{p}.mlp.gate.e_score_correction_bias", "F32", (spec.experts,)))
        if spec.attn.shared_experts:
            out += _mlp(f"{p}.mlp.shared_experts", h, n * spec.attn.shared_experts)
        out.append((f"{p}.mlp.routed_expert_down_proj.weight", "BF16", (k, h)))
        out.append((f"{p}.mlp.routed_expert_norm.weight", "BF16", (k,)))
        out.append((f"{p}.mlp.routed_expert_up_proj.weight", "BF16", (h, k)))
        for e in range(spec.experts):
            for proj, rows, cols in (("w1", n, k), ("w2", k, n), ("w3", n, k)):
                q = f"{p}.mlp.experts.{e}.{proj}"
                out.append((f"{q}.weight_packed", "U8", (rows, cols // 2)))
                out.append((f"{q}.weight_scale", "U8", (rows, cols // 32)))
    out.append((f"{TEXT}.norm.weight", "BF16", (h,)))
    out.append((f"{TEXT}.output_attn_res_norm.weight", "BF16", (h,)))
    out.append((f"{TEXT}.output_attn_res_proj.weight", "BF16", (1, h)))
    out.append(("language_model.lm_head.weight", "BF16", (spec.vocab, h)))
    return out + _vision(spec)


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
