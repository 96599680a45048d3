"""The SiTU CUTLASS MoE method for Kimi-K3 on SM90/SM120 with `flashinfer_mxfp4`.

A subclass of SGLang's `Mxfp4MoEMethod` that keeps its buffers, loader and runner setup and
changes only what Kimi-K3 needs: `w13` is loaded `[up; gate]` (so a converted `w31` lands
byte-identical), no reorder or padding after loading (only the kernel-mandated swizzles),
no biases, SiTU instead of SwiGLU, and the routed scaling factor fused into top-k. Every
FlashInfer call goes through `flashinfer_moe`, the module validated on GPUs.
"""

from __future__ import annotations

import logging

import torch
from sglang.srt.distributed.device_communicators.pynccl_allocator import use_symmetric_memory
from sglang.srt.environ import envs
from sglang.srt.layers.dp_attention import is_allocation_symmetric
from sglang.srt.layers.moe.moe_runner.flashinfer_cutlass import (
    _cutlass_moe_tune_max_num_tokens,
)
from sglang.srt.layers.moe.token_dispatcher import StandardCombineInput
from sglang.srt.layers.moe.topk import TopKOutputChecker
from sglang.srt.layers.quantization.mxfp4 import Mxfp4MoEMethod
from sglang.srt.runtime_context import get_parallel

from .. import flashinfer_moe as fm

logger = logging.getLogger(__name__)

_ARCH_OF_KERNEL = {"cutlass_sm90": "sm90", "cutlass_sm120": "sm120"}
# Where fc2's weight scales sit in FlashInfer's quant_scales list.
_FC2_SCALE_SLOT = {"sm90": 1, "sm120": 2, "humming": 3}
_HUMMING_BUFFERS = (
    "kimi_w31_w13_humming_residual",
    "kimi_w31_humming_fc2_act_scale",
    "kimi_w31_w2_humming_residual",
)


class KimiW31SituMoEMethod(Mxfp4MoEMethod):
    """`Mxfp4MoEMethod` for Kimi-K3 SiTU experts, `[up; gate]` fc1, FlashInfer CUTLASS."""

    # FusedMoE._load_w13 puts w3 (up) in the first half of w13 when this is set.
    load_up_proj_weight_first = True
    # The CUTLASS call takes final weights; TopK applies routed_scaling_factor once.
    fuse_routed_scaling_factor_in_topk = True

    def __init__(self, prefix: str, situ_beta: float, situ_linear_beta: float) -> None:
        super().__init__(prefix)
        arch = _ARCH_OF_KERNEL.get(self._fi_kernel or "")
        if arch is None:
            raise RuntimeError(
                f"{prefix}: the kimi_w31 SiTU method needs the FlashInfer CUTLASS kernel of SM90 "
                f"or SM120, but SGLang selected {self._fi_kernel!r}"
            )
        self.arch: fm.Arch = arch  # type: ignore[assignment]
        self.situ_beta = float(situ_beta)
        self.situ_linear_beta = float(situ_linear_beta)
        # --flashinfer-mxfp4-moe-precision fp8 on SM90: W4A8 "Humming" (FP8 activations),
        # validated with SiTU on an H200 (docs/gpu-validation.md); inert elsewhere, as in SGLang.
        self.humming = self.arch == "sm90" and bool(self._use_sm90_humming)
        self._dims: fm.MoeDims | None = None

    def create_weights(
        self,
        layer: torch.nn.Module,
        num_experts: int,
        hidden_size: int,
        intermediate_size_per_partition: int,
        params_dtype: torch.dtype,
        with_bias: bool = False,
        **extra_weight_attrs,
    ) -> None:
        where = f"{self.prefix} ({self.arch.upper()}, kimi_w31 SiTU CUTLASS)"
        if with_bias:
            raise ValueError(f"{where}: expert biases are not supported (Kimi-K3 has none)")
        if getattr(layer, "num_fused_shared_experts", 0):
            # The kernel maps global ids to local slots by EP rank; fused shared slots break that.
            raise ValueError(f"{where}: shared experts fused into the routed MoE are not supported")
        unpadded = getattr(layer, "hidden_size_unpadded", hidden_size)
        if hidden_size != unpadded:
            raise ValueError(
                f"{where}: hidden size {unpadded} was padded to {hidden_size}; this method has "
                "no padding path (Kimi-K3's routed hidden size is a multiple of 256)"
            )
        bad = {
            "hidden size (K)": hidden_size,
            "intermediate size per moe-TP rank (N/moe_tp)": intermediate_size_per_partition,
        }
        bad = {k: v for k, v in bad.items() if v % fm.ALIGNMENT}
        if bad:
            raise ValueError(
                f"{where}: {bad} must be multiples of {fm.ALIGNMENT} for the CUTLASS MXFP4 MoE "
                "and this method does not pad. Pick a moe-TP size that keeps N/moe_tp a "
                "multiple of 128 (Kimi-K3: 1, 2, 3, 4, 6, 8, 12 or 24; or use expert "
                "parallelism), or serve with --moe-runner-backend marlin."
            )
        super().create_weights(
            layer,
            num_experts,
            hidden_size,
            intermediate_size_per_partition,
            params_dtype,
            with_bias=False,
            **extra_weight_attrs,
        )

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        """Swizzle for the kernel, drop biases, build the per-local-expert SiTU tensors.

        The stock SM90/SM120 routines are not called: they reorder `[gate; up]` (or
        GPT-OSS-interleaved) rows into `[up; gate]`, which would scramble this layout.
        """
        tensors = (
            layer.w13_weight.data,
            layer.w13_weight_scale.data,
            layer.w2_weight.data,
            layer.w2_weight_scale.data,
        )
        if self.humming:
            prepared = fm.prepare_sm90_humming(*tensors)
        else:
            prepared = fm.prepare_weights(self.arch, *tensors)
        self._dims = prepared.dims
        scales = prepared.quant_scales
        params = {
            "w13_weight": prepared.fc1,
            "w2_weight": prepared.fc2,
            "w13_weight_scale": scales[0],
            "w2_weight_scale": scales[_FC2_SCALE_SLOT["humming" if self.humming else self.arch]],
        }
        if self.arch == "sm120":
            params["mxfp4_weight_global_scale"] = scales[1]
        if self.humming:  # per-local-expert residuals (x 64) and the fc2 activation scale
            for name, t in zip(_HUMMING_BUFFERS, (scales[1], scales[2], scales[4]), strict=True):
                layer.register_buffer(name, t, persistent=False)
        for name, tensor in params.items():
            setattr(layer, name, torch.nn.Parameter(tensor, requires_grad=False))
        # Kimi-K3 has no expert biases; SGLang allocates zero bf16 ones on CUDA anyway.
        for name in ("w13_weight_bias", "w2_weight_bias"):
            if hasattr(layer, name):
                setattr(layer, name, None)
        beta, linear_beta = fm.situ_params(
            prepared.dims.num_local_experts,
            self.situ_beta,
            self.situ_linear_beta,
            device=layer.w13_weight.device,
        )
        layer.register_buffer("kimi_w31_situ_beta", beta, persistent=False)
        layer.register_buffer("kimi_w31_situ_linear_beta", linear_beta, persistent=False)
        layer._mxfp4_backend = f"flashinfer_cutlass_{self.arch}_situ"
        if torch.cuda.is_available() and layer.w13_weight.is_cuda:
            torch.cuda.empty_cache()

    def restore_weights_before_loading(self, layer: torch.nn.Module) -> None:
        raise NotImplementedError(
            f"{self.prefix}: reloading weights in place is not supported by the kimi_w31 SiTU "
            "method (its weights are swizzled for the kernel); restart the server to load "
            "new weights"
        )

    def _prepared(self, layer: torch.nn.Module) -> fm.PreparedMoeWeights:
        # Rebuilt from the layer's own parameters on each call: no copy, no allocation.
        if self._dims is None:
            raise RuntimeError(f"{self.prefix}: apply() before process_weights_after_loading()")
        if self.humming:
            r1, act, r2 = (getattr(layer, name) for name in _HUMMING_BUFFERS)
            scales = (layer.w13_weight_scale, r1, act, layer.w2_weight_scale, r2)
        elif self.arch == "sm90":
            scales = (layer.w13_weight_scale, layer.w2_weight_scale)
        else:
            gs = layer.mxfp4_weight_global_scale
            scales = (layer.w13_weight_scale, gs, layer.w2_weight_scale, gs)
        return fm.PreparedMoeWeights(
            arch=self.arch,
            dims=self._dims,
            fc1=layer.w13_weight,
            fc2=layer.w2_weight,
            quant_scales=scales,
            humming=self.humming,
        )

    def apply(self, layer: torch.nn.Module, dispatch_output) -> StandardCombineInput:
        x = dispatch_output.hidden_states
        if x.shape[0] == 0:
            return StandardCombineInput(hidden_states=x)
        topk_output = dispatch_output.topk_output
        if TopKOutputChecker.format_is_bypassed(topk_output):
            topk_output = topk_output.to_standard()
        cfg = self.moe_runner_config
        with use_symmetric_memory(get_parallel().tp_group, disabled=not is_allocation_symmetric()):
            out = torch.empty(x.shape[0], x.shape[1], dtype=torch.bfloat16, device=x.device)
        out = fm.run_situ_moe(
            x,
            topk_output.topk_ids.to(torch.int32),
            topk_output.topk_weights.to(torch.float32),
            self._prepared(layer),
            layer.kimi_w31_situ_beta,
            layer.kimi_w31_situ_linear_beta,
            output=out,
            tp_size=cfg.moe_tp_size,
            tp_rank=cfg.moe_tp_rank,
            ep_size=cfg.moe_ep_size,
            ep_rank=cfg.moe_ep_rank,
            use_fused_finalize=envs.SGLANG_FLASHINFER_MOE_FUSED_FINALIZE.get(),
            tune_max_num_tokens=_cutlass_moe_tune_max_num_tokens(x.shape[0]),
        )
        return StandardCombineInput(hidden_states=out)
