"""The `kimi_w31` quantization method: SGLang's name for a converted checkpoint's config.

A converted config.json wraps each `quantization_config` as
`{"quant_method": "kimi_w31", "base": <original>}` so that loaders without the adapter
refuse it. With the adapter, `from_config` builds the *original* method's config object
from `base`, so attention, dense and expert layers are quantized exactly as in the source.
(The config hook in `hooks.py` unwraps the HF config itself, so SGLang's checks keyed on
the method's name also see the source's; this class is what a still-wrapped config meets.)
"""

from __future__ import annotations

from typing import Any

import torch
from sglang.srt.layers.quantization import (
    BASE_QUANTIZATION_METHODS,
    CPU_QUANTIZATION_METHODS,
    QUANTIZATION_METHODS,
    get_quantization_config,
)
from sglang.srt.layers.quantization.base_config import QuantizationConfig

from ..layout import WRAPPER_METHOD, unwrap_one

# Keys SGLang adds to the checkpoint's dict before from_config (weight_utils.get_quant_config).
_RUNTIME_KEYS = ("packed_modules_mapping", "hf_config", "requantization_method")


class KimiW31Config(QuantizationConfig):
    """Factory: `from_config` returns the base method's config object, never an instance
    of this class, so every `isinstance` check and attribute SGLang reads is the source's."""

    def __init__(self) -> None:
        raise TypeError(
            f"{WRAPPER_METHOD} is a wrapper: build it with from_config(), which returns the "
            "original quantization method's config"
        )

    @classmethod
    def get_name(cls) -> str:
        return WRAPPER_METHOD

    @classmethod
    def get_supported_act_dtypes(cls) -> list[torch.dtype]:
        return [torch.bfloat16, torch.float16]

    @classmethod
    def get_min_capability(cls) -> int:
        return 0  # the base config object enforces its own minimum

    @staticmethod
    def get_config_filenames() -> list[str]:
        return []

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> QuantizationConfig:
        base = unwrap_one(config)
        for key in _RUNTIME_KEYS:
            if key in config and key not in base:
                base[key] = config[key]
        return get_quantization_config(base["quant_method"]).from_config(base)

    def get_quant_method(self, layer: torch.nn.Module, prefix: str) -> None:
        raise TypeError(f"{WRAPPER_METHOD} never quantizes layers itself")  # see __init__

    def get_scaled_act_names(self) -> list[str]:
        return []


def register_quant_method() -> None:
    """Make `kimi_w31` a known method name (idempotent)."""
    for table in (BASE_QUANTIZATION_METHODS, QUANTIZATION_METHODS, CPU_QUANTIZATION_METHODS):
        table[WRAPPER_METHOD] = KimiW31Config
