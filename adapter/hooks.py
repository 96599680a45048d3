"""The hook functions the plugin installs into SGLang (see plugin.py for the targets).

SGLang is imported inside the functions: this module is imported by the plugin's entry
point in every SGLang process, before any model code is needed.
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Iterable
from typing import Any

from ..converter.errors import Code
from . import flashinfer_moe as fm
from .engage import Decision, MoeFacts, decide, unconverted_warning
from .layout import (
    LayoutError,
    W31Layout,
    find_block,
    load_layout,
    opt_in_unconverted,
    text_config,
    unwrap_quantization_config,
)
from .split import SplitStats, split_w31_items

logger = logging.getLogger("kimi_w31.adapter")

_LAYER = re.compile(r"^(.*?\blayers\.\d+\.)")
_logged: set[str] = set()


class W31LoadError(RuntimeError):
    """A converted checkpoint whose expert tensors do not match its `kimi_w31` block."""


def _log_once(level: int, msg: str) -> None:
    if msg not in _logged:
        _logged.add(msg)
        logger.log(level, msg)


def _process_hf_config() -> Any | None:
    """The HF config of the model this process serves, if SGLang has published one."""
    from sglang.srt.runtime_context import process_model_config

    try:
        return process_model_config().hf_config
    except Exception:  # not published (e.g. a model built outside a server)
        return None


# --- config: unwrap kimi_w31 and validate the block --------------------------------------


def after_get_config(result: Any, *args: Any, **kwargs: Any) -> Any:
    """Every HF config SGLang loads: unwrap `kimi_w31` quantization, validate the block.

    Runs in the main process too, so a bad block stops the server before workers spawn.
    """
    if result is not None and not isinstance(result, (str, bytes)):
        if unwrap_quantization_config(result) and find_block(result) is None:
            raise LayoutError(
                "quantization_config is wrapped as 'kimi_w31' but config.json has no "
                "'kimi_w31' block: the checkpoint is half converted or was edited; convert it "
                "again from the source",
                (Code.BLOCK_MISSING.value,),
            )
        load_layout(result)
    return result


# --- load_weights: split w31 -------------------------------------------------------------


def _moe_layers(model: Any) -> dict[str, str]:
    """{layer prefix ('model.layers.3.'): FusedMoE module name} of the model."""
    from sglang.srt.layers.moe.fused_moe_triton import FusedMoE

    found: dict[str, str] = {}
    for name, module in model.named_modules():
        if isinstance(module, FusedMoE):
            m = _LAYER.match(name + ".")
            if m:
                found[m[1]] = name
    return found


def around_load_weights(original: Any, self: Any, weights: Iterable, *args: Any, **kw: Any):
    """KimiK3LinearForCausalLM.load_weights: feed SGLang `w3`/`w1` views of each `w31`."""
    layout = find_block(self.config, _process_hf_config())
    stats = SplitStats()
    seen_layers: set[str] = set()

    def items():
        for item in split_w31_items(weights, stats):
            m = _LAYER.match(item[0]) if isinstance(item[0], str) else None
            if m:
                seen_layers.add(m[1])
            yield item

    result = original(self, items(), *args, **kw)
    if stats.w31_tensors:
        _log_once(logging.INFO, "kimi_w31: split fused w31 expert tensors into w3 (up) / w1 (gate)")
    if layout is not None:
        _check_converted_load(self, stats, seen_layers)
    return result


def _check_converted_load(model: Any, stats: SplitStats, seen_layers: set[str]) -> None:
    if stats.w13_layers:
        raise W31LoadError(
            "config.json announces the kimi_w31 layout, but the checkpoint also has unfused "
            f"w1/w3 expert tensors under {sorted(stats.w13_layers)[:3]}: it is a partial or "
            "mixed conversion. Convert it again from the source and run `kimi-convert verify`."
        )
    fed = {_LAYER.match(p)[1] for p in stats.w31_layers if _LAYER.match(p)}
    missing = [
        name
        for layer, name in sorted(_moe_layers(model).items())
        if layer in seen_layers and layer not in fed
    ]
    if missing:
        raise W31LoadError(
            "config.json announces the kimi_w31 layout, but these MoE layers got no "
            f"experts.E.w31 tensors: {missing[:5]}{' ...' if len(missing) > 5 else ''}. "
            "Their experts would be all zeros. The checkpoint is incomplete: run "
            "`kimi-convert verify` on it."
        )


# --- get_quant_method: choose the SiTU method -------------------------------------------


def _arch() -> str:
    from sglang.srt.runtime_context import get_platform

    p = get_platform()
    for arch in ("sm90", "sm100", "sm120"):
        if getattr(p, f"is_{arch}", False):
            return arch
    return "other"


def _k3_ar_fusion_forced() -> bool:
    from sglang.srt.environ import envs

    var = envs.SGLANG_K3_AR_FUSION
    return bool(var.is_set() and var.get())


def gather_facts(quant_config: Any, layer: Any, hf_config: Any) -> MoeFacts:
    """Read the decision's inputs from SGLang's process state and the layer."""
    from sglang.srt.layers.moe.utils import get_moe_a2a_backend, get_moe_runner_backend
    from sglang.srt.runtime_context import get_exec

    moe = get_exec().moe
    return MoeFacts(
        activation=layer.moe_runner_config.activation,
        mxfp4_serialized=bool(getattr(quant_config, "is_checkpoint_mxfp4_serialized", False)),
        runner_backend=get_moe_runner_backend().value,
        a2a_backend=get_moe_a2a_backend().value,
        arch=_arch(),
        converted=find_block(hf_config) is not None,
        opt_in=opt_in_unconverted(),
        paged_experts=bool(getattr(moe, "enable_paged_experts", False)),
        ktransformers=getattr(moe, "kt_weight_path", None) is not None,
        sm90_precision=getattr(moe, "flashinfer_mxfp4_moe_precision", None),
        ar_fusion_forced=_k3_ar_fusion_forced(),
    )


def situ_constants(layer: Any, layout: W31Layout | None) -> tuple[float, float]:
    """(beta, linear_beta): Kimi-K3 passes them to FusedMoE as gemm1_alpha / clamp limit;
    for a converted checkpoint they must agree with the block."""
    cfg = layer.moe_runner_config
    beta, linear_beta = cfg.gemm1_alpha, cfg.gemm1_clamp_limit
    if beta is None or linear_beta is None:
        raise RuntimeError(
            f"layer {cfg.layer_id}: Kimi-K3 SiTU needs activation_situ_beta and "
            f"activation_situ_linear_beta in the model config (got {beta}, {linear_beta})"
        )
    if layout is not None and (layout.situ_beta, layout.situ_linear_beta) != (
        float(beta),
        float(linear_beta),
    ):
        raise RuntimeError(
            f"layer {cfg.layer_id}: kimi_w31 block SiTU ({layout.situ_beta}, "
            f"{layout.situ_linear_beta}) != model's ({beta}, {linear_beta})"
        )
    return float(beta), float(linear_beta)


def around_get_quant_method(original: Any, self: Any, layer: Any, prefix: str):
    """Mxfp4Config.get_quant_method: the SiTU method for Kimi-K3 where it applies.

    Raising here (not in the plugin entry point, whose errors SGLang only logs) is what
    makes an unsupported setup fail at model construction.
    """
    from sglang.srt.layers.moe.fused_moe_triton import FusedMoE

    if not isinstance(layer, FusedMoE) or layer.moe_runner_config.activation != "situ":
        return original(self, layer, prefix)
    hf_config = _process_hf_config()
    facts = gather_facts(self, layer, hf_config)
    if decide(facts) is Decision.STOCK:
        warning = unconverted_warning(facts)
        if warning:
            _log_once(logging.WARNING, warning)
        return original(self, layer, prefix)
    humming = facts.arch == "sm90" and facts.sm90_precision == "fp8"
    version = fm.check_humming_support() if humming else fm.check_situ_support()
    layout = load_layout(hf_config) if facts.converted else None
    beta, linear_beta = situ_constants(layer, layout)
    from .moe_method import KimiW31SituMoEMethod

    kind = "W4A8 Humming" if humming else "W4A16" if facts.arch == "sm90" else "MXFP8 x MXFP4"
    _log_once(
        logging.INFO,
        f"kimi_w31: Kimi-K3 MoE on {facts.arch.upper()} uses the SiTU CUTLASS method "
        f"(flashinfer-python {version}, {kind}, beta {beta}, linear_beta {linear_beta}, "
        f"{'converted w31' if facts.converted else 'unconverted, opted in'})",
    )
    return KimiW31SituMoEMethod(prefix, beta, linear_beta)


# --- check_server_args: fail in the main process ----------------------------------------


def after_check_server_args(result: Any, server_args: Any, *args: Any, **kw: Any) -> Any:
    """Before any worker spawns: a SiTU CUTLASS setup needs a FlashInfer that has it."""
    if getattr(server_args, "moe_runner_backend", None) != "flashinfer_mxfp4":
        return result
    if _arch() not in ("sm90", "sm120"):
        return result
    from sglang.srt.arg_groups.model_override_base import model_config_of

    hf_config = model_config_of(server_args).hf_config
    if getattr(text_config(hf_config), "hidden_act", None) != "situ":
        return result
    if find_block(hf_config) is not None or opt_in_unconverted(os.environ):
        if (
            _arch() == "sm90"
            and getattr(server_args, "flashinfer_mxfp4_moe_precision", None) == "fp8"
        ):
            fm.check_humming_support()
        else:
            fm.check_situ_support()
    return result
