"""Build real SGLang 0.5.23 objects on a CPU box: published server args, gloo process
groups, FusedMoE layers as Kimi-K3 builds them, and the real Kimi-K3 weight loader.

Every test module imports this first: it installs the import stand-ins (stubs.py).
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import stubs

stubs.install()

import torch  # noqa: E402
from kimi_w31.converter.synth import quantization_config  # noqa: E402
from safetensors.torch import save_file  # noqa: E402

# --- synthetic checkpoints (DESIGN.md layout) ---------------------------------------------

SITU_BETA, SITU_LINEAR_BETA = 4.0, 25.0
EXPERT_PREFIX = "language_model.model.layers.{L}.mlp.experts.{E}."

# What compressed-tensors writes for Kimi-K3's experts (the published form synth writes);
# only the ignore list is narrowed to the layers these small test modules have.
COMPRESSED_TENSORS_MXFP4 = {**quantization_config(), "ignore": ["language_model.lm_head"]}

LAYOUT_BLOCK = {
    "format_version": 1,
    "fc1_layout": "w31",
    "fc1_order": ["up", "gate"],
    "activation": "situ",
    "situ_beta": SITU_BETA,
    "situ_linear_beta": SITU_LINEAR_BETA,
    "weight_format": "mxfp4",
    "group_size": 32,
}


def kimi_convert(*args: str) -> None:
    """Run `kimi-convert ARGS` in a subprocess of this environment; it must succeed."""
    proc = subprocess.run(
        [sys.executable, "-m", "kimi_w31", *args], capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]


def source_config(
    *, experts: int, hidden: int, inter: int, layers: int, top_k: int = 2, rsf: float = 2.5
) -> dict:
    """A Kimi-K3-format config.json that SGLang's real KimiK3Config/ModelConfig accept, with
    the quantization_config where the published one is: inside text_config only."""
    return {
        "architectures": ["KimiK3ForConditionalGeneration"],
        "model_type": "kimi_k3",
        "text_config": {
            "model_type": "kimi_linear",
            "hidden_size": hidden,
            "routed_expert_hidden_size": hidden,
            "moe_intermediate_size": inter,
            "num_experts": experts,
            "num_experts_per_token": top_k,
            "num_hidden_layers": layers,
            "num_attention_heads": 4,
            "hidden_act": "situ",
            "activation_situ_beta": SITU_BETA,
            "activation_situ_linear_beta": SITU_LINEAR_BETA,
            "routed_scaling_factor": rsf,
            "vocab_size": 1024,
            "kv_lora_rank": 64,
            "q_lora_rank": None,
            "qk_nope_head_dim": 32,
            "qk_rope_head_dim": 16,
            "v_head_dim": 32,
            "linear_attn_config": {
                "use_full_rank_gate": True,
                "kda_layers": [],
                "full_attn_layers": list(range(1, layers + 1)),
            },
            "quantization_config": json.loads(json.dumps(COMPRESSED_TENSORS_MXFP4)),
        },
    }


def converted_config(src: dict) -> dict:
    """DESIGN.md item 4: add the block, wrap every quantization_config."""
    out = json.loads(json.dumps(src))
    out["kimi_w31"] = dict(LAYOUT_BLOCK)
    for holder in (out, out.get("text_config", {})):
        if "quantization_config" in holder:
            holder["quantization_config"] = {
                "quant_method": "kimi_w31",
                "base": holder["quantization_config"],
            }
    return out


def random_expert(gen: torch.Generator, hidden: int, inter: int) -> dict[str, torch.Tensor]:
    """One expert's six MXFP4 tensors, scales kept near 2^0 so values stay moderate."""

    def packed(rows: int, cols: int) -> torch.Tensor:
        return torch.randint(0, 256, (rows, cols // 2), generator=gen, dtype=torch.uint8)

    def scale(rows: int, cols: int) -> torch.Tensor:
        return torch.randint(122, 128, (rows, cols // 32), generator=gen, dtype=torch.uint8)

    return {
        "w1.weight_packed": packed(inter, hidden),
        "w1.weight_scale": scale(inter, hidden),
        "w3.weight_packed": packed(inter, hidden),
        "w3.weight_scale": scale(inter, hidden),
        "w2.weight_packed": packed(hidden, inter),
        "w2.weight_scale": scale(hidden, inter),
    }


def source_tensors(
    *, experts: int, hidden: int, inter: int, layers: int, seed: int = 0
) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    out: dict[str, torch.Tensor] = {}
    for layer in range(layers):
        for e in range(experts):
            prefix = EXPERT_PREFIX.format(L=layer, E=e)
            for key, t in random_expert(gen, hidden, inter).items():
                out[prefix + key] = t
    return out


def fuse(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """DESIGN.md items 1-2: w31 = concat([w3, w1], 0); no w1/w3 left."""
    out: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        if ".w1." in name:
            continue
        if ".w3." in name:
            gate = tensors[name.replace(".w3.", ".w1.")]
            out[name.replace(".w3.", ".w31.")] = torch.cat([t, gate], 0).contiguous()
        else:
            out[name] = t
    return out


def write_checkpoint(path: Path, config: dict, tensors: dict[str, torch.Tensor]) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config, indent=1))
    save_file(tensors, str(path / "model.safetensors"))
    return path


# --- SGLang process state -------------------------------------------------------------------

_ARCH_FACTS = {
    "sm90": {"is_sm90": True},
    "sm100": {"is_sm100": True},
    "sm120": {"is_sm120": True},
}


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextlib.contextmanager
def sglang_process(
    model_path: str | os.PathLike,
    *,
    arch: str = "sm120",
    moe_runner_backend: str = "flashinfer_mxfp4",
    world_rank: int = 0,
    world_size: int = 1,
    **server_args: Any,
) -> Iterator[None]:
    """Publish server args for `model_path`, create gloo groups, pretend to be `arch`.

    With `world_size` > 1 this process is rank `world_rank` of a gloo world whose other
    ranks run the same call in their own processes (MASTER_ADDR/MASTER_PORT set by the
    caller)."""
    from sglang.srt.distributed import parallel_state
    from sglang.srt.distributed.parallel_state import (
        destroy_model_parallel,
        init_distributed_environment,
        initialize_model_parallel,
    )
    from sglang.srt.layers.moe.utils import initialize_moe_config
    from sglang.srt.layers.quantization import mxfp4
    from sglang.srt.runtime_context import (
        SpawnRanks,
        get_parallel,
        override_platform,
        publish,
        reset_context,
    )
    from sglang.srt.server_args import ServerArgs

    args = {"tp_size": 1, "ep_size": 1, "pp_size": 1, "device": "cpu"}
    args.update(server_args)
    reset_context()
    publish(
        ServerArgs(
            model_path=str(model_path),
            moe_runner_backend=moe_runner_backend,
            disable_radix_cache=True,
            **args,
        ),
        role="test",
        ranks=SpawnRanks(world_rank=world_rank),
    )
    if parallel_state._WORLD is None:
        if world_size == 1:
            # One gloo group per process, on a port free now (parallel test processes).
            os.environ["MASTER_ADDR"] = "127.0.0.1"
            os.environ["MASTER_PORT"] = str(_free_port())
        init_distributed_environment(
            world_size=world_size, rank=world_rank, local_rank=world_rank, backend="gloo"
        )
    else:
        get_parallel().override_permanently(world_group=parallel_state._WORLD)
    initialize_model_parallel(backend="gloo")
    initialize_moe_config()
    saved_sm90 = mxfp4._FI_HAS_SM90_CUTLASS_MXFP4
    mxfp4._FI_HAS_SM90_CUTLASS_MXFP4 = True  # the FlashInfer helper import is CUDA-gated
    try:
        with override_platform(**_ARCH_FACTS.get(arch, {})):
            yield
    finally:
        mxfp4._FI_HAS_SM90_CUTLASS_MXFP4 = saved_sm90
        destroy_model_parallel()
        reset_context()


def build_moe(
    *,
    experts: int,
    hidden: int,
    inter: int,
    layer_id: int = 0,
    top_k: int = 2,
    rsf: float = 2.5,
    activation: str = "situ",
):
    """A FusedMoE with the arguments KimiK3MoE passes (kimi_k3.py:503-521)."""
    from sglang.srt.layers.moe.fused_moe_triton import FusedMoE
    from sglang.srt.layers.quantization.mxfp4 import Mxfp4Config

    return FusedMoE(
        num_experts=experts,
        top_k=top_k,
        hidden_size=hidden,
        intermediate_size=inter,
        layer_id=layer_id,
        quant_config=Mxfp4Config(is_checkpoint_mxfp4_serialized=True),
        activation=activation,
        gemm1_alpha=SITU_BETA,
        gemm1_clamp_limit=SITU_LINEAR_BETA,
        gate_up_interleaved=False,
        routed_scaling_factor=rsf,
        prefix=f"model.layers.{layer_id}.mlp.experts",
    )


class _Layer(torch.nn.Module):
    def __init__(self, moe: torch.nn.Module) -> None:
        super().__init__()
        self.mlp = torch.nn.Module()
        self.mlp.experts = moe


class FakeK3Text(torch.nn.Module):
    """Just enough of KimiK3LinearForCausalLM for its real `load_weights` to run."""

    def __init__(self, text_config: Any, moes: list[torch.nn.Module]) -> None:
        super().__init__()
        self.config = text_config
        self.model = torch.nn.Module()
        self.model.layers = torch.nn.ModuleList([_Layer(m) for m in moes])
        self.model.start_layer = 0
        self.model.end_layer = len(moes)

    def post_load_weights(self, *args: Any, **kwargs: Any) -> None:
        return None


def load_with_real_loader(model: FakeK3Text, tensors: dict[str, torch.Tensor]) -> None:
    """Checkpoint names -> the VL wrapper's mapper -> KimiK3LinearForCausalLM.load_weights."""
    from sglang.srt.models.kimi_k3 import (
        KimiK3ForConditionalGeneration,
        KimiK3LinearForCausalLM,
    )

    mapped = KimiK3ForConditionalGeneration.hf_to_sglang_mapper.apply(iter(tensors.items()))
    items = ((n.replace("language_model.", "", 1), t) for n, t in mapped)
    KimiK3LinearForCausalLM.load_weights(model, items)


def process_hf_config():
    from sglang.srt.runtime_context import process_model_config

    return process_model_config().hf_config


class _CpuStream:
    """Stands in for torch.cuda.Stream: Kimi-K3's model creates side streams at
    construction (KimiK3LinearModel.alt_streams) and uses them only in a CUDA forward."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        return None


@contextlib.contextmanager
def cpu_cuda_streams() -> Iterator[None]:
    saved = torch.cuda.Stream
    torch.cuda.Stream = _CpuStream  # type: ignore[assignment,misc]
    try:
        yield
    finally:
        torch.cuda.Stream = saved  # type: ignore[misc]
