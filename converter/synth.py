"""Synthetic Kimi-K3-format checkpoints, for tests, the demo and benchmarks.

The default layout is the published `moonshotai/Kimi-K3` checkpoint's (docs/inventory.md
cites the public source of each fact): the inventory SGLang 0.5.23's Kimi-K3 model class
builds and loads (`models/kimi_k3.py`, `models/kimi_k3_vl.py`, `configs/kimi_k3.py`), MoE
layers spelled `block_sparse_moe.` (the dense prefix keeps `mlp.`), the real dtypes (F32
short convolutions, `A_log` padded to `[head_dim]`, `o_norm` and router bias; a BF16 router),
the config as published (`quantization_config` inside `text_config` only, with the six
`re:.*` regexes of its `ignore` list) and one shard per decoder layer plus three (the
embeddings and head, the projector, the vision tower), written in the safetensors library's
own order (dtype, then name) with no `__metadata__`. The coverage layout (`published=False`)
keeps what the published one never exercises: `mlp.` everywhere, a top-level
`quantization_config` whose `ignore` list names every unquantized linear kind, and shards
packed by size with an expert's w1 and w3 split across shards.

Scale exponents are chosen so that a unit-variance input gives gate pre-activations of a few
units (the range where SiTU's tanh saturation matters); a few all-zero groups use E8M0 byte
0. `peak` makes the logits peaked (see `SynthSpec.peak`).
"""

from __future__ import annotations

import json
import math
import struct
import zlib
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import numpy as np

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
    # kv_lora_rank + qk_rope_head_dim = 256 + 32: a pair SGLang's Triton MLA decode kernel
    # compiles (it takes 512 + 64 or 256 + 32; 64 + 16 fails), so the default checkpoint
    # can be served with `--attention-backend triton`.
    kv_lora_rank: int = 256
    qk_nope_head_dim: int = 32
    qk_rope_head_dim: int = 32
    v_head_dim: int = 32
    kda_heads: int = 4  # linear_attn_config.num_heads
    kda_head_dim: int = 32  # linear_attn_config.head_dim
    conv_size: int = 4  # linear_attn_config.short_conv_kernel_size
    intermediate: int = 512  # intermediate_size (the dense MLP)
    shared_experts: int = 1  # num_shared_experts
    attn_res_block: int = 2  # attn_res_block_size


# The published config's dims (docs/inventory.md, section 6): MLA 96 heads, q_lora_rank
# 1536, kv_lora_rank 512, heads of 128 + 64 (rope slot) and 128 (v); KDA 96 heads of 128,
# short convolution 4; dense intermediate 33,792; two shared experts; residual blocks of 12.
REAL_ATTN = AttnDims(
    heads=96,
    q_lora_rank=1536,
    kv_lora_rank=512,
    qk_nope_head_dim=128,
    qk_rope_head_dim=64,
    v_head_dim=128,
    kda_heads=96,
    kda_head_dim=128,
    intermediate=33792,
    shared_experts=2,
    attn_res_block=12,
)


@dataclass(frozen=True)
class VisionDims:
    """The vision tower's config fields (KimiK3VisionConfig)."""

    hidden: int = 64  # vt_hidden_size
    heads: int = 2  # vt_num_attention_heads
    qkv: int = 64  # qkv_hidden_size
    intermediate: int = 128  # vt_intermediate_size
    layers: int = 1  # vt_num_hidden_layers
    patch: int = 14
    pos_emb: int = 4  # init_pos_emb_height and _width


# The published vision_config: 27 blocks of MoonViT-V2 (401,214,464 parameters).
REAL_VISION = VisionDims(hidden=1024, heads=12, qkv=1536, intermediate=4096, layers=27, pos_emb=64)


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
    # None: one shard per decoder layer plus three, as published; N: N shards packed by size
    # with one expert's w3 moved to the last (partners split across shards).
    shards: int | None = None
    vocab: int = 512
    seed: int = 0
    situ_beta: float = 4.0
    situ_linear_beta: float = 25.0
    routed_scaling_factor: float = 1.0  # the published value
    attn: AttnDims = AttnDims()
    vision: VisionDims = VisionDims()
    published: bool = True  # False: the coverage layout (module docstring)
    # Peaked logits: > 0 sets every RMSNorm weight to 1 (a freshly initialized model's
    # norms, so activations keep unit scale through the depth) and draws lm_head with std
    # peak / sqrt(hidden), so a logit has std ~ `peak` and the top token stands out (at 8
    # and 512 tokens, iid N(0, 64) logits have a mean top-1 probability of about 0.73):
    # greedy tokens are a function of the input, not of rounding. 0: every weight
    # N(0, 0.02^2).
    peak: float = 0.0

    def moe_layers(self) -> list[int]:
        """The contract's MoE-layer rule applied to this spec."""
        return [i for i in range(self.layers) if i >= self.dense_layers and i % self.moe_every == 0]

    def mla_layers(self) -> list[int]:
        """Full-attention (MLA) layers: every fourth and the last, as Kimi's 3:1 KDA:MLA
        hybrid places them; every other layer is a KDA layer."""
        return [i for i in range(self.layers) if (i + 1) % 4 == 0 or i == self.layers - 1]

    def ffn(self, layer: int) -> str:
        """The feed-forward block's name in layer `layer`: the published checkpoint spells
        its MoE blocks `block_sparse_moe` and its dense prefix `mlp`."""
        moe = self.published and layer >= self.dense_layers and layer in self.moe_layers()
        return "block_sparse_moe" if moe else "mlp"


def cli_spec(
    *,
    layers: int,
    dense_layers: int | None,
    moe_every: int,
    experts: int,
    top_k: int,
    shards: int | None,
    real_dims: bool,
    k: int | None,
    n: int | None,
    seed: int,
    coverage: bool = False,
    peak: float = 0.0,
    routed_scaling_factor: float = 1.0,
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
        shards=shards if shards is not None or not coverage else 3,
        seed=seed,
        hidden=REAL_HIDDEN if real_dims else 2 * kk,
        published=not coverage,
        peak=peak,
        routed_scaling_factor=routed_scaling_factor,
        **({"attn": REAL_ATTN, "vision": REAL_VISION} if real_dims else {}),
    )


def _mxfp4_scheme() -> dict:
    return {
        "format": "mxfp4-pack-quantized",
        "targets": ["Linear"],
        "weights": {
            "num_bits": 4,
            "type": "float",
            "strategy": "group",
            "group_size": 32,
            "symmetric": True,
            "dynamic": False,
            "observer": "minmax",
            "scale_dtype": "torch.uint8",
        },
        "input_activations": None,
        "output_activations": None,
    }


# The published `text_config.quantization_config.ignore`: six regexes. They do not name the
# router, the latent projections or the `*_res_proj`s; SGLang builds those without a quant
# config, which is why they stay unquantized (tests/sglang/test_quant_config.py holds it).
PUBLISHED_IGNORE = [
    "re:.*self_attn.*",
    "re:.*shared_experts.*",
    r"re:.*mlp\.(gate|up|gate_up|down)_proj.*",
    "re:.*lm_head.*",
    "re:.*vision_tower.*",
    "re:.*mm_projector.*",
]

# The coverage layout's list names every unquantized linear kind the model has.
COVERAGE_IGNORE = [
    "re:.*self_attn.*",  # KDA and MLA projections
    r"re:.*mlp\.(gate_proj|up_proj|down_proj|gate_up_proj)$",  # dense MLPs
    r"re:.*mlp\.gate$",  # the router
    "re:.*shared_experts.*",
    r"re:.*routed_expert_(down|up)_proj$",  # latent MoE projections
    r"re:.*_res_proj$",  # attention-residual projections
    "re:.*lm_head$",
    "re:.*(vision_tower|mm_projector).*",
]


def quantization_config(published: bool = True) -> dict:
    """compressed-tensors' MXFP4 weight-only scheme on the routed experts, as the published
    config states it (key order assumed); the coverage layout's form adds the fields
    compressed-tensors 0.20.0 writes itself."""
    qc = {
        "format": "mxfp4-pack-quantized",
        "quant_method": "compressed-tensors",
        "quantization_status": "compressed",
        "config_groups": {"group_0": _mxfp4_scheme()},
        "ignore": list(PUBLISHED_IGNORE if published else COVERAGE_IGNORE),
        "kv_cache_scheme": None,
    }
    if not published:
        qc.update(sparsity_config={}, transform_config={}, version="0.20.0")
    return qc


def token_ids(vocab: int) -> dict[str, int]:
    """The published special-token ids, counted from the end of the vocabulary (163,840) so
    that a small vocabulary keeps them in range: [BOS] 163584, <|end_of_msg|> 163586 (the
    generation EOS), [PAD] 163839, <|media_pad|> 163605."""
    return {
        "bos_token_id": vocab - 256,
        "eos_token_id": vocab - 254,
        "pad_token_id": vocab - 1,
        "media_placeholder_token_id": vocab - 235,
    }


def make_config(spec: SynthSpec) -> dict:
    """config.json as published (fields the public sources do not state are assumed and
    docs/inventory.md says which)."""
    a, v = spec.attn, spec.vision
    mla = spec.mla_layers()
    ids = token_ids(spec.vocab)
    text = {
        "model_type": "kimi_linear" if spec.published else "kimi_k3",
        "architectures": ["KimiLinearForCausalLM"],
        "vocab_size": spec.vocab,
        "hidden_size": spec.hidden,
        "intermediate_size": a.intermediate,
        "moe_intermediate_size": spec.n,
        "routed_expert_hidden_size": spec.k,
        "latent_moe_use_norm": True,
        "num_hidden_layers": spec.layers,
        "first_k_dense_replace": spec.dense_layers,
        "moe_layer_freq": spec.moe_every,
        "num_experts": spec.experts,
        "num_experts_per_token": spec.top_k,
        "num_shared_experts": a.shared_experts,
        "moe_router_activation_func": "sigmoid",
        "moe_renormalize": True,
        "routed_scaling_factor": spec.routed_scaling_factor,
        "use_grouped_topk": True,
        "num_expert_group": 1,
        "topk_group": 1,
        "topk_method": "noaux_tc",
        "num_attention_heads": a.heads,
        "num_key_value_heads": a.heads,
        "hidden_act": "situ",
        "activation_situ_beta": spec.situ_beta,
        "activation_situ_linear_beta": spec.situ_linear_beta,
        "rms_norm_eps": 1e-5,
        "max_position_embeddings": 1048576,
        "num_nextn_predict_layers": 0,
        "bos_token_id": ids["bos_token_id"],
        "eos_token_id": ids["eos_token_id"],
        "pad_token_id": ids["pad_token_id"],
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        # MLA (full attention) layers: NoPE, output-gated
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
            "full_attn_layers": [i + 1 for i in mla],
            "kda_layers": [i + 1 for i in range(spec.layers) if i not in mla],
            "num_heads": a.kda_heads,
            "head_dim": a.kda_head_dim,
            "short_conv_kernel_size": a.conv_size,
            "use_full_rank_gate": True,
            "gate_lower_bound": -5.0,
        },
    }
    if spec.published:
        text["quantization_config"] = quantization_config()
    vision = {
        "patch_size": v.patch,
        "init_pos_emb_height": v.pos_emb,
        "init_pos_emb_width": v.pos_emb,
        "init_pos_emb_time": 4,
        "pos_emb_type": "divided_fixed",
        "vt_num_attention_heads": v.heads,
        "vt_num_hidden_layers": v.layers,
        "vt_hidden_size": v.hidden,
        "vt_intermediate_size": v.intermediate,
        "qkv_hidden_size": v.qkv,
        "merge_kernel_size": [2, 2],
        "merge_type": "sd2_tpool",
        "mm_projector_type": "patchmergerv2",
        "mm_hidden_size": v.hidden,
        "text_hidden_size": spec.hidden,
    }
    if not spec.published:
        vision["model_type"] = "kimi_k3_vision"
    config = {
        "architectures": ["KimiK3ForConditionalGeneration"],
        "auto_map": {
            "AutoConfig": "configuration_kimi_k3.KimiK3Config",
            "AutoModel": "modeling_kimi_k3.KimiK3ForConditionalGeneration",
            "AutoModelForCausalLM": "modeling_kimi_k3.KimiK3ForConditionalGeneration",
        },
        **ids,
        "dtype": "bfloat16",
        "image_placeholder": "<|kimi_image_placeholder|>",
        # The model type SGLang registers for Kimi-K3 (its KimiK3Config).
        "model_type": "kimi_k3",
        "text_config": text,
        "tie_word_embeddings": False,
        "transformers_version": "4.56.2",
        "use_unified_vision_chunk": True,
        "vision_config": vision,
    }
    if not spec.published:
        config["quantization_config"] = quantization_config(published=False)
    return config


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


def _filled(value: float, dtype: str, shape: tuple[int, ...]) -> np.ndarray:
    data = np.full(math.prod(shape), value, dtype=np.float32)
    if dtype == "BF16":
        data = (data.view(np.uint32) >> 16).astype(np.uint16)
    return np.frombuffer(data.tobytes(), dtype=np.uint8)


def _is_rms_norm(name: str) -> bool:
    return name.endswith("norm.weight") or "norm0." in name or "norm1." in name


def tensor_bytes(spec: SynthSpec, name: str, dtype: str, shape: tuple[int, ...]) -> np.ndarray:
    """The deterministic content of one synthetic tensor, generated on demand."""
    if name.endswith(".A_log"):
        # The published A_log is [head_dim]: the real heads' entries, then zeros.
        data = np.zeros(shape, dtype=np.float32)
        heads = spec.attn.kda_heads
        data[:heads] = _rng(spec, name).standard_normal(heads) * 0.02
        return np.frombuffer(data.tobytes(), dtype=np.uint8)
    if spec.peak > 0:
        if _is_rms_norm(name):
            return _filled(1.0, dtype, shape)
        if name == "language_model.lm_head.weight":
            std = spec.peak / math.sqrt(spec.hidden)
            data = (_rng(spec, name).standard_normal(math.prod(shape)) * std).astype(np.float32)
            return np.frombuffer(
                (data.view(np.uint32) >> 16).astype(np.uint16).tobytes(), dtype=np.uint8
            )
    if name.endswith(".weight_scale"):
        return _scale_bytes(_rng(spec, name), shape[0], shape[1] * 32)
    if name.endswith(".weight_packed"):
        scale_name = name[: -len("weight_packed")] + "weight_scale"
        scales = _scale_bytes(_rng(spec, scale_name), shape[0], shape[1] * 2)
        return _fp4_bytes(_rng(spec, name), shape[0], shape[1] * 2, scales)
    return _dense_bytes(spec, name, dtype, shape)


def _kda_attention(spec: SynthSpec, p: str) -> list[tuple[str, str, tuple[int, ...]]]:
    """KimiK3DeltaAttention with the full-rank gate: q/k/v/g land in fused_qkvg_proj, the
    conv weights (F32) in qkv_conv1d; the rest load by name. `A_log` is [head_dim] (SGLang
    narrows it to the heads), `o_norm` F32, as published."""
    h, a = spec.hidden, spec.attn
    proj = a.kda_heads * a.kda_head_dim
    out = [(f"{p}.{x}_proj.weight", "BF16", (proj, h)) for x in ("q", "k", "v", "g")]
    out += [(f"{p}.{x}_conv1d.weight", "F32", (proj, 1, a.conv_size)) for x in ("q", "k", "v")]
    out += [
        (f"{p}.b_proj.weight", "BF16", (a.kda_heads, h)),
        (f"{p}.f_a_proj.weight", "BF16", (a.kda_head_dim, h)),
        (f"{p}.f_b_proj.weight", "BF16", (proj, a.kda_head_dim)),
        (f"{p}.A_log", "F32", (max(a.kda_head_dim, a.kda_heads),)),
        (f"{p}.dt_bias", "F32", (proj,)),
        (f"{p}.o_norm.weight", "F32", (a.kda_head_dim,)),
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
        f = f"{p}.{spec.ffn(layer)}"
        if layer not in moe:  # a dense MLP, no experts
            out += _mlp(f, h, spec.attn.intermediate)
            continue
        out.append((f"{f}.gate.weight", "BF16", (spec.experts, h)))
        out.append((f"{f}.gate.e_score_correction_bias", "F32", (spec.experts,)))
        if spec.attn.shared_experts:
            out += _mlp(f"{f}.shared_experts", h, n * spec.attn.shared_experts)
        out.append((f"{f}.routed_expert_down_proj.weight", "BF16", (k, h)))
        out.append((f"{f}.routed_expert_norm.weight", "BF16", (k,)))
        out.append((f"{f}.routed_expert_up_proj.weight", "BF16", (h, k)))
        for e in range(spec.experts):
            for proj, rows, cols in (("w1", n, k), ("w2", k, n), ("w3", n, k)):
                q = f"{f}.experts.{e}.{proj}"
                out.append((f"{q}.weight_packed", "U8", (rows, cols // 2)))
                out.append((f"{q}.weight_scale", "U8", (rows, cols // 32)))
    out.append((f"{TEXT}.norm.weight", "BF16", (h,)))
    out.append((f"{TEXT}.output_attn_res_norm.weight", "BF16", (h,)))
    out.append((f"{TEXT}.output_attn_res_proj.weight", "BF16", (1, h)))
    out.append(("language_model.lm_head.weight", "BF16", (spec.vocab, h)))
    return out + _vision(spec)


# The safetensors library's dtype order (its `Dtype` enum) for the dtypes synth writes: a
# file lists its tensors by dtype, larger first, then by name.
_DTYPE_RANK = {"BOOL": 0, "U8": 4, "I8": 5, "I16": 9, "U16": 10, "F16": 11, "BF16": 12, "F32": 15}


def library_order(tensors: list) -> list:
    """`tensors` (name, dtype, ...) in the order the safetensors library writes them."""
    return sorted(tensors, key=lambda t: (-_DTYPE_RANK[t[1]], t[0].encode()))


def library_header(tensors: list) -> bytes:
    """The header the safetensors library writes for (name, dtype, shape, ...) already in
    `library_order` and no metadata: length prefix, compact JSON, spaces to 8 bytes."""
    parts, offset = [], 0
    for name, dtype, shape, *_ in tensors:
        end = offset + tensor_nbytes(dtype, shape)
        dims = ",".join(map(str, shape))
        entry = f'"dtype":"{dtype}","shape":[{dims}],"data_offsets":[{offset},{end}]'
        parts.append(f"{json.dumps(name)}:{{{entry}}}")
        offset = end
    body = ("{" + ",".join(parts) + "}").encode()
    body += b" " * (-len(body) % 8)
    return struct.pack("<Q", len(body)) + body


def write_safetensors(path: Path, tensors: list) -> None:
    """Write (name, dtype, shape, uint8 array or a zero-arg callable returning one), in the
    order given, with the converter's header writer."""
    entries = [HeaderEntry(n, d, s, tensor_nbytes(d, s)) for n, d, s, _ in tensors]
    with open(path, "wb") as fh:
        fh.write(build_header(entries))
        _write_data(fh, tensors)


def _write_data(fh, tensors: list) -> None:
    for *_, data in tensors:
        arr = data() if callable(data) else data
        fh.write(memoryview(np.ascontiguousarray(arr)).cast("B"))


def write_library_safetensors(path: Path, tensors: list) -> None:
    """Write as the safetensors library does (its order, no `__metadata__`), as published."""
    ordered = library_order(tensors)
    with open(path, "wb") as fh:
        fh.write(library_header(ordered))
        _write_data(fh, ordered)


def source_shard_name(index: int, count: int) -> str:
    """The published spelling: five digits, then six in the total (`-of-000096`)."""
    return f"model-{index:05d}-of-{count:06d}.safetensors"


def published_groups(spec: SynthSpec, specs: list) -> list[list]:
    """The published placement: layer L in shard L + 1, then one shard with the embeddings,
    the final norms and lm_head, one with the projector, one with the vision tower."""
    groups: list[list] = [[] for _ in range(spec.layers + 3)]
    layer_prefix = f"{PREFIX}."
    for t in specs:
        name = t[0]
        if name.startswith(layer_prefix):
            groups[int(name[len(layer_prefix) :].split(".", 1)[0])].append(t)
        elif name.startswith("mm_projector."):
            groups[spec.layers + 1].append(t)
        elif name.startswith("vision_tower."):
            groups[spec.layers + 2].append(t)
        else:
            groups[spec.layers].append(t)
    return groups


def _packed_groups(spec: SynthSpec, specs: list, shards: int) -> list[list]:
    """The coverage placement: `shards` shards packed by size, one expert's w3 moved to the
    last so partners are certainly split across shards."""
    first = spec.moe_layers()[0]
    w3 = f"{PREFIX}.{first}.{spec.ffn(first)}.experts.0.w3."
    moved = [t for t in specs if t[0].startswith(w3)]
    rest = [t for t in specs if not t[0].startswith(w3)]
    sizes = {t[0]: tensor_nbytes(t[1], t[2]) for t in specs}
    per_shard = math.ceil(sum(sizes[t[0]] for t in rest) / shards)
    groups: list[list] = [[]]
    size = 0
    for t in rest:
        if size >= per_shard and len(groups) < shards:
            groups.append([])
            size = 0
        groups[-1].append(t)
        size += sizes[t[0]]
    groups[-1].extend(moved)
    return groups


def shard_groups(spec: SynthSpec, specs: list) -> list[list]:
    if spec.shards is None:
        return published_groups(spec, specs)
    return _packed_groups(spec, specs, spec.shards)


_PY = "# Synthetic stand-in for the file of this name the published checkpoint ships.\n"

# The published repository's other files, as small stand-ins under their real names (the
# processor files' names are assumed: docs/inventory.md, section 6).
EXTRA_FILES: dict[str, str | bytes] = {
    "tiktoken.model": "IQ== 0\nIg== 1\n",
    "tokenization_kimi.py": _PY,
    "encoding_k3.py": _PY + "# The chat format is code: there is no jinja template.\n",
    "configuration_kimi_k3.py": _PY,
    "configuration_kimi_linear.py": _PY,
    "modeling_kimi_k3.py": _PY,
    "modeling_kimi_linear.py": _PY,
    "processing_kimi_k3.py": _PY,
    "image_processing_kimi_k3.py": _PY,
    "generation_config.json": json.dumps({"max_length": 1048576, "eos_token_id": 163586}),
    "tokenizer_config.json": json.dumps(
        {
            "auto_map": {"AutoTokenizer": ["tokenization_kimi.TikTokenTokenizer", None]},
            "tokenizer_class": "TikTokenTokenizer",
            "bos_token": "[BOS]",
            "eos_token": "[EOS]",
            "pad_token": "[PAD]",
            "unk_token": "[UNK]",
            "model_max_length": 1000000000000000019884624838656,
        }
    ),
    "preprocessor_config.json": json.dumps(
        {"in_patch_limit": 65536, "patch_limit_on_one_side": 512, "image_mean": [0.5] * 3}
    ),
    "README.md": "# Synthetic Kimi-K3-format checkpoint\n\nRandom weights, real layout.\n",
    "LICENSE": "Synthetic stand-in for the published checkpoint's license file.\n",
    ".gitattributes": "*.safetensors filter=lfs diff=lfs merge=lfs -text\n",
    # A file in a subfolder, as published: the smallest valid PNG header and end.
    "assets/kimi-logo.png": bytes.fromhex("89504e470d0a1a0a0000000049454e44ae426082"),
}


def write_extra_files(out: Path) -> None:
    for name, content in EXTRA_FILES.items():
        path = out / name
        path.parent.mkdir(parents=True, exist_ok=True)
        if isinstance(content, bytes):
            path.write_bytes(content)
        else:
            path.write_text(content)


def synth_checkpoint(out: Path, spec: SynthSpec) -> dict:
    """Write a checkpoint; returns a small summary. Generates data shard by shard."""
    out.mkdir(parents=True, exist_ok=True)
    specs = tensor_specs(spec)
    groups = shard_groups(spec, specs)
    weight_map = {}
    for i, group in enumerate(groups, start=1):
        name = source_shard_name(i, len(groups))
        lazy = [(n, d, s, partial(tensor_bytes, spec, n, d, s)) for n, d, s in group]
        if spec.published:
            write_library_safetensors(out / name, lazy)
        else:
            write_safetensors(out / name, lazy)
        weight_map.update({t[0]: name for t in group})
    total = sum(tensor_nbytes(d, s) for _, d, s in specs)
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    (out / "config.json").write_text(json.dumps(make_config(spec), indent=2) + "\n")
    write_extra_files(out)
    return {"tensors": len(specs), "shards": len(groups), "bytes": total}
