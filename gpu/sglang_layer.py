"""SGLang in the loop: one Kimi-K3 MoE layer through SGLang 0.5.23's own code on GPUs.

What runs is SGLang's, except what SGLang itself leaves to the model around the layer:
the plugin is loaded through its installed entry point (`load_plugins()`), the server
args are published and the distributed and model-parallel groups initialised as a
scheduler does, the `FusedMoE` and Kimi-K3's `TopK` are built with the arguments
`KimiK3MoE` passes (read from the checkpoint's config as SGLang parsed it), the weights
go through `KimiK3LinearForCausalLM.load_weights` (hooked by the plugin) and
`process_weights_after_loading` on CUDA (FlashInfer's real SM90 interleaves), then
`TopK` (sigmoid, correction bias, the checkpoint's `routed_scaling_factor`: synth's
published 1.0 unless `--routed-scaling-factor`) and `FusedMoE.forward`.
The router logits are given (Kimi-K3's gate is a plain fp32 linear in front of this).

The reference is `converter/reference/` on the SOURCE checkpoint's w1/w3/w2 with an
independent numpy router (gpu/sglang_cases.py).

    python -m gpu.sglang_layer single --source SRC --converted CONV --out OUT
    python -m gpu.sglang_layer dist --source SRC --converted CONV --out OUT --ep 1   # 2 GPUs

`sgl_kernel` is replaced by an import stub when none can be imported (SGLang's pin, 0.4.10,
cannot load against the machine's torch); nothing on this path calls it (the stub raises if
anything does). A real one (the slim 0.4.6 gpu/race_h200.sh installs, which SGLang's Marlin
route needs) is used as it is.
"""

from __future__ import annotations

import contextlib
import importlib.abc
import importlib.machinery
import json
import os
import re
import sys
import types
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

SKEW = 0.5  # mild preference for low expert ids: a few experts get many tokens
DEVICE = "cuda"  # "cpu" only for the CPU dry run of this script (tests/sglang)


# --------------------------------------------------------------------------------------
# sgl_kernel stand-in
# --------------------------------------------------------------------------------------


class _Unavailable:
    """A name from the stub: attribute chains work (module-level constants), calls raise."""

    def __init__(self, name: str) -> None:
        self._name = name

    def __getattr__(self, name: str) -> _Unavailable:
        if name.startswith("__"):
            raise AttributeError(name)
        return _Unavailable(f"{self._name}.{name}")

    def __call__(self, *_a: Any, **_k: Any) -> Any:
        raise RuntimeError(f"{self._name} was called, but sgl_kernel is a stub here")


class _SglKernelStub(types.ModuleType):
    """Importing works and module-level attribute reads work; calling anything raises."""

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        value: Any = _Unavailable(f"{self.__name__}.{name}")
        if name[:1].isupper():  # class-like names must work as base classes and in isinstance()
            value = type(name, (), {})
        setattr(self, name, value)
        return value


class _SglKernelFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname.split(".")[0] == "sgl_kernel":
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec: Any) -> types.ModuleType:
        module = _SglKernelStub(spec.name)
        module.__path__ = []  # type: ignore[attr-defined]
        module.__version__ = "0.4.10"  # type: ignore[attr-defined]
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        return None


def install_sgl_kernel_stub() -> None:
    """Idempotent; a real, importable sgl_kernel is left alone."""
    if any(isinstance(f, _SglKernelFinder) for f in sys.meta_path):
        return
    try:
        import sgl_kernel  # noqa: F401

        return
    except Exception:
        sys.modules.pop("sgl_kernel", None)
    os.environ.setdefault("SGLANG_SKIP_SGL_KERNEL_VERSION_CHECK", "1")
    sys.meta_path.insert(0, _SglKernelFinder())


# --------------------------------------------------------------------------------------
# SGLang process state
# --------------------------------------------------------------------------------------


@contextlib.contextmanager
def sglang_rank(
    model_path: Path,
    *,
    tp: int,
    ep: int,
    rank: int,
    precision: str = "default",
    backend: str = "flashinfer_mxfp4",
) -> Iterator[None]:
    """Publish server args and create the groups, as one scheduler rank does. `backend` is
    `--moe-runner-backend` ("marlin": SGLang's own Hopper route for the unconverted
    checkpoint)."""
    import torch
    from sglang.srt.distributed import parallel_state
    from sglang.srt.distributed.parallel_state import (
        destroy_model_parallel,
        init_distributed_environment,
        initialize_model_parallel,
        set_custom_all_reduce,
    )
    from sglang.srt.layers.moe.utils import initialize_moe_config
    from sglang.srt.runtime_context import SpawnRanks, get_parallel, publish, reset_context
    from sglang.srt.server_args import ServerArgs

    device = DEVICE
    reset_context()
    publish(
        ServerArgs(
            model_path=str(model_path),
            tp_size=tp,
            ep_size=ep,
            moe_runner_backend=backend,
            flashinfer_mxfp4_moe_precision=precision,  # "fp8": SM90 W4A8 (Humming)
            disable_custom_all_reduce=True,  # its kernels live in sgl_kernel
            disable_radix_cache=True,
            device=device,
        ),
        role="test",
        ranks=SpawnRanks(world_rank=rank, gpu_id=rank if device == "cuda" else None),
    )
    if device == "cuda":
        torch.cuda.set_device(rank)
    if parallel_state._WORLD is None:
        if "MASTER_PORT" not in os.environ:  # one process: a local rendezvous on a free port
            import socket

            with socket.socket() as sock:
                sock.bind(("127.0.0.1", 0))
                os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(sock.getsockname()[1]))
        init_distributed_environment(
            world_size=tp,
            rank=rank,
            local_rank=rank,
            backend="nccl" if device == "cuda" else "gloo",
        )
    else:  # a second layer setup in this process (reset_context forgot the WORLD group)
        get_parallel().override_permanently(world_group=parallel_state._WORLD)
    set_custom_all_reduce(False)
    initialize_model_parallel(backend="nccl" if device == "cuda" else "gloo")
    initialize_moe_config()
    try:
        yield
    finally:
        destroy_model_parallel()
        reset_context()


def load_plugins_checked() -> None:
    """SGLang's own plugin loading; stop if the kimi_w31 hooks are not in place."""
    from sglang.srt.plugins import load_plugins
    from sglang.srt.plugins.hook_registry import HookRegistry

    load_plugins()
    want = "sglang.srt.models.kimi_k3.KimiK3LinearForCausalLM.load_weights"
    if want not in HookRegistry._patched:
        raise SystemExit("the kimi_w31 plugin's hooks were not applied (entry point missing?)")


def text_config() -> Any:
    from sglang.srt.runtime_context import process_model_config

    hf = process_model_config().hf_config
    return getattr(hf, "text_config", hf)


# --------------------------------------------------------------------------------------
# The layer, built as KimiK3MoE builds it
# --------------------------------------------------------------------------------------


@dataclass
class Layer:
    moe: Any
    topk: Any
    layer_idx: int
    num_experts: int
    top_k: int
    rsf: float
    info: dict[str, Any] = field(default_factory=dict)


def build_layer(
    cfg: Any,
    layer_idx: int,
    *,
    intermediate: int | None = None,
    setup: Callable[[Any], None] | None = None,
    num_experts: int | None = None,
) -> Layer:
    """FusedMoE + TopK with KimiK3MoE's arguments (kimi_k3.py, KimiK3MoE.__init__).

    `intermediate` builds the layer for one moe-TP rank's N on one GPU (with `setup`
    setting that rank), as a TP-sharded server would hold it. `num_experts` overrides the
    config's global expert count (a checkpoint that holds only one EP rank's experts).
    """
    import torch
    from sglang.srt.layers.moe.ep_moe.layer import get_moe_impl_class
    from sglang.srt.layers.moe.topk import TopK, TopKOutputFormat
    from sglang.srt.layers.moe.utils import RoutingMethodType
    from sglang.srt.layers.quantization.mxfp4 import Mxfp4Config

    quant = Mxfp4Config(is_checkpoint_mxfp4_serialized=True)
    num_experts = num_experts or getattr(cfg, "n_routed_experts", None) or cfg.num_experts
    with torch.device(DEVICE):
        moe = get_moe_impl_class(quant)(
            num_experts=num_experts,
            top_k=cfg.num_experts_per_token,
            hidden_size=cfg.routed_expert_hidden_size,
            intermediate_size=intermediate or cfg.moe_intermediate_size,
            layer_id=layer_idx,
            quant_config=quant,
            routed_scaling_factor=cfg.routed_scaling_factor,
            activation=cfg.hidden_act,
            gemm1_alpha=cfg.activation_situ_beta,
            gemm1_clamp_limit=cfg.activation_situ_linear_beta,
            gate_up_interleaved=False,
            routing_method_type=getattr(cfg, "routing_method_type", RoutingMethodType.DeepSeekV3),
            prefix=f"model.layers.{layer_idx}.mlp.experts",
        )
        if setup is not None:
            setup(moe)
        bias = torch.zeros(num_experts, dtype=torch.float32)
        topk = TopK(
            top_k=cfg.num_experts_per_token,
            layer_id=layer_idx,
            renormalize=cfg.moe_renormalize,
            use_grouped_topk=True,
            num_expert_group=cfg.num_expert_group,
            topk_group=cfg.topk_group,
            scoring_func=cfg.moe_router_activation_func,
            correction_bias=bias,
            quant_config=None,
            routed_scaling_factor=cfg.routed_scaling_factor,
            apply_routed_scaling_factor_on_output=moe.should_fuse_routed_scaling_factor_in_topk,
            output_format=TopKOutputFormat.STANDARD,  # situ + flashinfer_mxfp4 (KimiK3MoE)
        )
    topk.bind_runner_backend(moe.runner_backend, routing_method_type=moe.routing_method_type)
    return Layer(
        moe=moe,
        topk=topk,
        layer_idx=layer_idx,
        num_experts=num_experts,
        top_k=cfg.num_experts_per_token,
        rsf=float(cfg.routed_scaling_factor),
        info={
            "quant_method": type(moe.quant_method).__name__,
            "fuse_rsf_in_topk": bool(moe.should_fuse_routed_scaling_factor_in_topk),
            "renormalize": bool(cfg.moe_renormalize),
            "scoring": cfg.moe_router_activation_func,
        },
    )


class _FakeLayer:
    pass


def load_weights(layer: Layer, cfg: Any, tensors: dict[str, Any]) -> None:
    """Checkpoint names -> the VL wrapper's mapper -> the real (hooked) load_weights, then
    `process_weights_after_loading` as SGLang's loader runs it after loading."""
    import torch
    from sglang.srt.models.kimi_k3 import KimiK3ForConditionalGeneration, KimiK3LinearForCausalLM

    model = torch.nn.Module()
    model.config = cfg
    model.model = torch.nn.Module()
    layers = []
    for i in range(layer.layer_idx + 1):
        blk = torch.nn.Module()
        blk.mlp = torch.nn.Module()
        blk.mlp.experts = layer.moe if i == layer.layer_idx else torch.nn.Identity()
        layers.append(blk)
    model.model.layers = torch.nn.ModuleList(layers)
    model.model.start_layer, model.model.end_layer = 0, len(layers)
    model.post_load_weights = lambda *a, **k: None
    mapped = KimiK3ForConditionalGeneration.hf_to_sglang_mapper.apply(iter(tensors.items()))
    items = ((n.replace("language_model.", "", 1), t) for n, t in mapped)
    KimiK3LinearForCausalLM.load_weights(model, items)
    layer.moe.quant_method.process_weights_after_loading(layer.moe)
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def read_layer_tensors(repo: Path, layer_idx: int) -> dict[str, Any]:
    """Every expert tensor of one MoE layer of a safetensors repo (CPU torch tensors)."""
    from safetensors import safe_open

    weight_map = json.loads((repo / "model.safetensors.index.json").read_text())["weight_map"]
    by_file: dict[str, list[str]] = {}
    for name, fname in weight_map.items():
        if _moe_layer_of(name) == layer_idx:
            by_file.setdefault(fname, []).append(name)
    out: dict[str, Any] = {}
    for fname, names in by_file.items():
        with safe_open(str(repo / fname), framework="pt") as fh:
            for name in names:
                out[name] = fh.get_tensor(name)
    if not out:
        raise SystemExit(f"{repo}: no expert tensors for layer {layer_idx}")
    return out


# A routed expert's layer, in either spelling: the published checkpoint's MoE blocks are
# `block_sparse_moe.` (SGLang maps them to `mlp.`), synth's coverage layout writes `mlp.`.
_EXPERT_LAYER = re.compile(r"\.layers\.(\d+)\.(?:mlp|block_sparse_moe)\.experts\.")


def _moe_layer_of(name: str) -> int | None:
    m = _EXPERT_LAYER.search(name)
    return int(m.group(1)) if m else None


def first_moe_layer(repo: Path) -> int:
    weight_map = json.loads((repo / "model.safetensors.index.json").read_text())["weight_map"]
    idx = sorted({i for i in map(_moe_layer_of, weight_map) if i is not None})
    if not idx:
        raise SystemExit(f"{repo}: no MoE layer")
    return idx[0]


def swap_w31_halves(tensors: dict[str, Any]) -> dict[str, Any]:
    """A bad conversion: every w31 fed as [gate; up]."""
    import torch

    out = {}
    for name, t in tensors.items():
        if ".w31." in name:
            n = t.shape[0] // 2
            t = torch.cat([t[n:], t[:n]]).contiguous()
        out[name] = t
    return out


# --------------------------------------------------------------------------------------
# Forward and reference
# --------------------------------------------------------------------------------------


def forward(layer: Layer, x: Any, logits: Any, bias: Any) -> tuple[Any, Any]:
    """TopK then FusedMoE.forward, as KimiK3MoE runs them; returns (output, topk_output)."""
    layer.topk.topk_config.correction_bias.copy_(bias)
    topk_output = layer.topk(x, logits)
    return layer.moe(x, topk_output), topk_output


def reference_experts(repo: Path, layer_idx: int, num_experts: int) -> dict[int, Any]:
    from kimi_w31.converter import reference as ref

    tensors = read_layer_tensors(repo, layer_idx)
    prefix = next(n for n in tensors if ".experts.0.w1." in n).split("experts.0.")[0]

    def pair(e: int, w: str) -> tuple[np.ndarray, np.ndarray]:
        return (
            tensors[f"{prefix}experts.{e}.{w}.weight_packed"].numpy(),
            tensors[f"{prefix}experts.{e}.{w}.weight_scale"].numpy(),
        )

    return {
        e: ref.dequant_expert(pair(e, "w1"), pair(e, "w3"), pair(e, "w2"))
        for e in range(num_experts)
    }


@dataclass
class Inputs:
    x: Any  # bf16 [M, K] on the GPU
    x_host: np.ndarray  # the same bf16 values in fp32
    router: Any  # sglang_cases.Router
    ids: np.ndarray  # reference routing
    weights: np.ndarray


def make_inputs(
    m: int, k: int, num_experts: int, top_k: int, rsf: float, renormalize: bool, seed: int
) -> Inputs:
    import torch

    from . import sglang_cases as S

    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g).to(torch.bfloat16)
    router = S.make_router(m, num_experts, seed + 1, SKEW)
    ids, w = S.route(router, top_k, renormalize, rsf)
    return Inputs(x=x.to(DEVICE), x_host=x.float().numpy(), router=router, ids=ids, weights=w)


def to_cuda(router: Any) -> tuple[Any, Any]:
    import torch

    return torch.from_numpy(router.logits).to(DEVICE), torch.from_numpy(router.bias).to(DEVICE)
