"""The hook functions the plugin installs into SGLang (see plugin.py for the targets).

SGLang is imported inside the functions: this module is imported by the plugin's entry
point in every SGLang process, before any model code is needed.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from ...converter.errors import Fatal, fatal
from ...converter.output import verified
from ...converter.reasons import Code
from .. import flashinfer_moe as fm
from ..arch import is_served
from ..completeness import PROJECTIONS, ExpertLedger, incomplete_report, kind_of, missing_parts
from ..layout import (
    LayoutError,
    W31Layout,
    find_block,
    load_layout,
    opt_in_unconverted,
    text_config,
    unwrap_quantization_config,
)
from ..refused import Refused
from ..served import Refusal, structure_refusal, verified_refusal
from ..split import SplitStats, split_w31_items
from .engage import Decision, MoeFacts, decide, unconverted_warning

logger = logging.getLogger("kimi_w31.adapter")

_logged: set[str] = set()


class W31LoadError(Refused, RuntimeError):
    """A checkpoint whose expert tensors cannot be loaded as they are (reason codes in
    `codes`): a converted one that disagrees with its `kimi_w31` block, or a MoE layer whose
    local experts did not all receive every part."""

    def __init__(
        self,
        error: Fatal,
        text: str | None = None,
        missing: dict[str, dict[str, list[int]]] | None = None,
    ) -> None:
        super().__init__(error, text)
        # {layer: {checkpoint part: expert ids}} for an incomplete load
        self.missing = missing or {}


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
            raise LayoutError(fatal(Code.BLOCK_MISSING, rule="wrapped", file="config.json"))
        load_layout(result)
    return result


# --- load_weights: split w31 -------------------------------------------------------------


def around_load_weights(original: Any, self: Any, weights: Iterable, *args: Any, **kw: Any):
    """KimiK3LinearForCausalLM.load_weights: before the first load, refuse a checkpoint that
    is not what was verified or whose shards disagree (`served.py`); feed SGLang `w3`/`w1`
    views of each `w31`, and refuse a first load that left any local expert of a MoE layer
    without one of its parts."""
    layout = find_block(self.config, _process_hf_config())
    _check_before_first_load(self, converted=layout is not None)
    stats = SplitStats()
    watched = _watch_expert_loads(self)
    try:
        result = original(self, split_w31_items(weights, stats), *args, **kw)
    finally:
        for _, restore in watched:
            restore()
    if stats.w31_tensors:
        _log_once(logging.INFO, "kimi_w31: split fused w31 expert tensors into w3 (up) / w1 (gate)")
    if layout is not None:
        _check_converted_load(stats)
    _check_expert_ledgers([ledger for ledger, _ in watched], converted=layout is not None)
    return result


# --- before the first load: what was verified, and shards that agree ---------------------

_LOAD_CHECKED = "_kimi_w31_load_checked"


def _model_root() -> Path | None:
    from sglang.srt.runtime_context import process_model_config

    try:
        return Path(process_model_config().model_path)
    except Exception:  # not published (a model built outside a server): nothing to check
        return None


def _check_before_first_load(model: Any, converted: bool) -> None:
    """Once per model, before any weight is read: stat calls and shard headers only. A
    later in-place load into the same model (a weight update) is not checked again."""
    root = _model_root()
    if root is None or getattr(model, _LOAD_CHECKED, False):
        return
    checked = converted and not verified.skipped()
    if converted and not checked:
        logger.warning(
            "kimi_w31: %s=1: serving %s WITHOUT checking it against its last passing "
            "`kimi-convert verify --checksums`; damaged or edited files would be served",
            verified.SKIP_ENV,
            root,
        )
    # A matching proof covers the structure rules too (verify's structure level has them):
    # the headers are read only without one, or to name what is wrong once it is refused.
    unproven = verified_refusal(root) if checked else None
    if not checked or unproven is not None:
        found = [r for r in (unproven, structure_refusal(root, converted)) if r is not None]
        if found:
            refusal = Refusal([p for r in found for p in r.problems], found[0].hint)
            raise W31LoadError(Fatal(refusal.problems, refusal.hint), refusal.render(root))
    setattr(model, _LOAD_CHECKED, True)


# --- every part of every local expert ------------------------------------------------------

_CHECKED = "_kimi_w31_experts_checked"
# FusedMoE buffers -> (projection, kind) pairs they receive.
_BUFFERS = {
    "w13_weight": (("w1", "weight_packed"), ("w3", "weight_packed")),
    "w13_weight_scale": (("w1", "weight_scale"), ("w3", "weight_scale")),
    "w2_weight": (("w2", "weight_packed"),),
    "w2_weight_scale": (("w2", "weight_scale"),),
}
_IMPL_ARGS = ("param", "loaded_weight", "weight_name", "shard_id", "expert_id")


def _local_global_ids(module: Any) -> list[int]:
    """The checkpoint (logical) expert id of each local routed slot of a FusedMoE."""
    n = int(getattr(module, "_num_local_routed", module.num_local_experts))
    first = int(getattr(module, "_expert_storage_rank", 0)) * n
    physical = list(range(first, first + n))
    if not getattr(module, "uses_expert_location", False):
        return physical
    from sglang.srt.eplb.expert_location import get_global_expert_location_metadata

    meta = get_global_expert_location_metadata()
    if meta is None:
        return physical
    row = meta.physical_to_logical_map_cpu[module.layer_id]
    return [int(row[p]) for p in physical]


def _watch_expert_loads(model: Any) -> list[tuple[ExpertLedger, Any]]:
    """Record every expert write SGLang's FusedMoE makes during this load, per local slot.

    The first load of each MXFP4 FusedMoE only (the one that builds the model; a later
    in-place update may carry part of the weights). Watched at `_weight_loader_impl`, where
    every path (TP slicing, EP global -> local, EPLB replicas) writes one local slot, for
    every backend that uses SGLang's MXFP4 method (marlin, trtllm-gen, DeepGEMM, the SiTU
    CUTLASS method, which subclasses it). Returns (ledger, restore) pairs.
    """
    from sglang.srt.layers.moe.fused_moe_triton import FusedMoE
    from sglang.srt.layers.quantization.mxfp4 import Mxfp4MoEMethod

    watched = []
    for name, module in model.named_modules():
        if not isinstance(module, FusedMoE) or getattr(module, _CHECKED, False):
            continue
        if not isinstance(getattr(module, "quant_method", None), Mxfp4MoEMethod):
            continue  # expert packs, KTransformers, paged experts: SGLang's own bookkeeping
        params = dict(module.named_parameters(recurse=False))
        required = frozenset(p for buf, pairs in _BUFFERS.items() if buf in params for p in pairs)
        ledger = ExpertLedger(
            where=name,
            global_ids=_local_global_ids(module),
            required=required,
        )
        had_own = "_weight_loader_impl" in module.__dict__
        own = module.__dict__.get("_weight_loader_impl")
        impl = module._weight_loader_impl

        def recording(*a: Any, _impl: Any = impl, _ledger: ExpertLedger = ledger, **k: Any):
            call = {**dict(zip(_IMPL_ARGS, a, strict=False)), **k}
            shard = call.get("shard_id")
            if shard in PROJECTIONS and isinstance(call.get("expert_id"), int):
                _ledger.record(call["expert_id"], shard, kind_of(str(call.get("weight_name"))))
            return _impl(*a, **k)

        def restore(m: Any = module, had: bool = had_own, prev: Any = own) -> None:
            if had:
                m._weight_loader_impl = prev
            else:
                m.__dict__.pop("_weight_loader_impl", None)
            setattr(m, _CHECKED, True)

        module._weight_loader_impl = recording
        watched.append((ledger, restore))
    return watched


def _check_expert_ledgers(ledgers: list[ExpertLedger], converted: bool) -> None:
    report = incomplete_report(ledgers, converted)
    if report is None:
        return
    error = (
        fatal(Code.LAYER_INCOMPLETE, rule="loaded-converted", report=report)
        if converted
        else fatal(Code.LAYER_INCOMPLETE, rule="loaded-source", report=report)
    )
    raise W31LoadError(
        error,
        missing={lg.where: parts for lg in ledgers if (parts := missing_parts(lg, converted))},
    )


def _check_converted_load(stats: SplitStats) -> None:
    if stats.w13_layers:
        raise W31LoadError(
            fatal(
                Code.EXPERT_TENSOR_UNEXPECTED,
                rule="loaded",
                layers=sorted(stats.w13_layers)[:3],
            )
        )
    # A layer that got no w31 at all is one whose experts lack every part: the ledger check.


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
    if not is_served(_arch()):
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
