"""When the adapter's SiTU MoE method replaces SGLang's: a pure decision over plain facts.

Kept free of SGLang imports so the whole matrix is cheap to test; `hooks.py` gathers the
facts. It sits with the SGLang-bound modules all the same: every fact and every way out it
names is one of SGLang's flags, so another engine would decide with its own table.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from ...converter.errors import fatal
from ..arch import ARCHES
from ..layout import OPT_IN_ENV
from ..reasons import AdapterCode
from ..refused import Refused

ADAPTER_ARCHS = ARCHES
BACKEND = "flashinfer_mxfp4"


class Decision(Enum):
    STOCK = "stock"  # SGLang's own method (load hook still splits w31)
    ADAPTER = "adapter"  # the adapter's SiTU CUTLASS method


class UnsupportedCombinationError(Refused, RuntimeError):
    """A configuration that would reach the adapter's method and that it does not handle."""


@dataclass(frozen=True)
class MoeFacts:
    """Everything the decision depends on, read once per FusedMoE layer."""

    activation: str | None
    mxfp4_serialized: bool
    runner_backend: str  # e.g. "flashinfer_mxfp4", "marlin", "auto"
    a2a_backend: str  # "none", "deepep", "megamoe", ...
    arch: str  # "sm90", "sm100", "sm120" or "other"
    converted: bool  # the config carries a kimi_w31 block
    opt_in: bool  # OPT_IN_ENV set: serve an unconverted checkpoint too
    paged_experts: bool = False
    ktransformers: bool = False
    sm90_precision: str | None = None  # --flashinfer-mxfp4-moe-precision (fp8: SM90 W4A8)
    ar_fusion_forced: bool = False  # SGLANG_K3_AR_FUSION=1


def decide(f: MoeFacts) -> Decision:
    """STOCK or ADAPTER; raises UnsupportedCombinationError for what the adapter cannot run."""
    if f.activation != "situ" or not f.mxfp4_serialized:
        return Decision.STOCK
    if f.runner_backend != BACKEND or f.arch not in ADAPTER_ARCHS:
        return Decision.STOCK  # marlin, SM100 trtllm-gen, ...: SGLang's paths
    if not (f.converted or f.opt_in):
        return Decision.STOCK  # unconverted and no opt-in: untouched (hooks.py warns)
    # The situation every refusal below names (facts, not words).
    where = f"Kimi-K3 SiTU experts with --moe-runner-backend {BACKEND} on {f.arch.upper()}"
    if f.a2a_backend != "none":
        raise UnsupportedCombinationError(
            fatal(AdapterCode.UNSUPPORTED_COMBINATION, rule="a2a", where=where, a2a=f.a2a_backend)
        )
    if f.paged_experts:
        raise UnsupportedCombinationError(
            fatal(AdapterCode.UNSUPPORTED_COMBINATION, rule="paged-experts", where=where)
        )
    if f.ktransformers:
        raise UnsupportedCombinationError(
            fatal(AdapterCode.UNSUPPORTED_COMBINATION, rule="ktransformers", where=where)
        )
    if f.ar_fusion_forced:
        raise UnsupportedCombinationError(
            fatal(AdapterCode.UNSUPPORTED_COMBINATION, rule="ar-fusion", where=where)
        )
    return Decision.ADAPTER


def unconverted_warning(f: MoeFacts) -> str | None:
    """The message for an unconverted checkpoint that stock SGLang will run with SwiGLU."""
    if (
        f.activation == "situ"
        and f.mxfp4_serialized
        and f.runner_backend == BACKEND
        and f.arch in ADAPTER_ARCHS
        and not (f.converted or f.opt_in)
    ):
        return (
            f"Kimi-K3 SiTU experts on {f.arch.upper()} with --moe-runner-backend {BACKEND}: "
            "this checkpoint is not converted and the kimi_w31 adapter is not engaged, so "
            "SGLang's own CUTLASS path runs (it applies SwiGLU, not SiTU). Convert the "
            f"checkpoint with kimi-convert, set {OPT_IN_ENV}=1, or use --moe-runner-backend "
            "marlin."
        )
    return None
