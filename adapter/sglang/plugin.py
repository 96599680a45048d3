"""SGLang general plugin (entry point group `sglang.srt.plugins`, name `kimi_w31`).

SGLang calls `register()` in every process (launcher, tokenizer, each scheduler rank)
before it builds a model. Exceptions raised here are only logged by SGLang, so everything
that must stop a bad setup raises from inside the hooks instead.

The plugin's first action in a process is the kernel bundle's pre-flight
(`kernels.preflight_bundle`: the bundle `KIMI_W31_KERNELS` names is there, safe to read and
built for this stack). Its refusal is kept and raised by the first hooked call of the
process (`refuse_bad_bundle`, a BEFORE hook on the config read and on the server-argument
check): both run before any weight loads, so a bad bundle never costs a weight load.
"""

from __future__ import annotations

from typing import Any

# (target, hook function name in .hooks, hook type)
HOOKS = (
    ("sglang.srt.utils.hf_transformers.config.get_config", "after_get_config", "AFTER"),
    (
        "sglang.srt.models.kimi_k3.KimiK3LinearForCausalLM.load_weights",
        "around_load_weights",
        "AROUND",
    ),
    (
        "sglang.srt.layers.quantization.mxfp4.Mxfp4Config.get_quant_method",
        "around_get_quant_method",
        "AROUND",
    ),
    ("sglang.srt.server_args.ServerArgs.check_server_args", "after_check_server_args", "AFTER"),
)
# The first calls of every SGLang process that serves, before any weight loads.
EARLY_TARGETS = (
    "sglang.srt.utils.hf_transformers.config.get_config",
    "sglang.srt.server_args.ServerArgs.check_server_args",
)

# This process's pre-flight refusal (None: the bundle passed, or none is named).
_refusal: BaseException | None = None


def check_bundle_now() -> None:
    """Run the bundle's pre-flight and keep its refusal for `refuse_bad_bundle`. A bundle
    that passed is checked again in each hooked call (cheap: its manifest only), so a GPU
    that comes up later in the process is compared too."""
    global _refusal
    from ..bundle import BundleError
    from ..kernels import preflight_bundle

    try:
        preflight_bundle()
        _refusal = None
    except BundleError as exc:
        _refusal = exc


def refuse_bad_bundle(*args: Any, **kwargs: Any) -> None:
    """BEFORE hook: raise the pre-flight's refusal (SGLang only logged it in `register`)."""
    check_bundle_now()
    if _refusal is not None:
        raise _refusal


def register() -> None:
    """Check the kernel bundle, then register the `kimi_w31` quantization name and the
    hooks (applied by SGLang)."""
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    from . import hooks
    from .quant_config import register_quant_method

    check_bundle_now()
    for target in EARLY_TARGETS:
        HookRegistry.register(target, refuse_bad_bundle, HookType.BEFORE)
    register_quant_method()
    for target, fn_name, hook_type in HOOKS:
        HookRegistry.register(target, getattr(hooks, fn_name), HookType[hook_type])
