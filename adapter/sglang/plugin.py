"""SGLang general plugin (entry point group `sglang.srt.plugins`, name `kimi_w31`).

SGLang calls `register()` in every process (launcher, tokenizer, each scheduler rank)
before it builds a model. Exceptions raised here are only logged by SGLang, so everything
that must stop a bad setup raises from inside the hooks instead.
"""

from __future__ import annotations

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


def register() -> None:
    """Register the `kimi_w31` quantization name and the hooks (applied by SGLang)."""
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    from . import hooks
    from .quant_config import register_quant_method

    register_quant_method()
    for target, fn_name, hook_type in HOOKS:
        HookRegistry.register(target, getattr(hooks, fn_name), HookType[hook_type])
