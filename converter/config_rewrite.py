"""The converted checkpoint's config.json: the source config with exactly two changes.

1. A top-level `kimi_w31` block that announces the fused [up; gate] layout and SiTU.
2. Fail closed: every `quantization_config` becomes
   `{"quant_method": "kimi_w31", "base": <original>}`, so a loader that does not know the
   layout stops with "unknown quantization method" instead of serving zeros for gate/up.
"""

from __future__ import annotations

import copy

from .manifest import Manifest, config_value

BLOCK_KEY = "kimi_w31"
QUANT_METHOD = "kimi_w31"

# The eight keys (and meanings) every consumer relies on; more may be added.
REQUIRED_BLOCK = {
    "format_version": 1,
    "fc1_layout": "w31",
    "fc1_order": ["up", "gate"],
    "activation": "situ",
    "weight_format": "mxfp4",
    "group_size": 32,
}


def layout_block(
    config: dict, manifest: Manifest, tool_version: str, source_identity: dict, dims: dict
) -> dict:
    situ = manifest.raw["situ"]["config_keys"]
    return {
        **REQUIRED_BLOCK,
        "situ_beta": float(config_value(config, situ["beta"])),
        "situ_linear_beta": float(config_value(config, situ["linear_beta"])),
        "group_size": manifest.group_size,
        "converter": f"kimi-w31 {tool_version}",
        "manifest": manifest.name,
        "manifest_sha256": manifest.sha256,
        "source": source_identity,
        "dims": dims,
    }


def wrap_quantization_configs(config: dict) -> int:
    """Wrap each `quantization_config` (top level, `text_config`) in place; count them."""
    count = 0
    for holder in (config, config.get("text_config")):
        if isinstance(holder, dict) and isinstance(holder.get("quantization_config"), dict):
            original = holder["quantization_config"]
            if original.get("quant_method") == QUANT_METHOD:
                continue  # already wrapped: converting twice must not nest
            holder["quantization_config"] = {"quant_method": QUANT_METHOD, "base": original}
            count += 1
    return count


def converted_config(source_config: dict, block: dict) -> dict:
    config = copy.deepcopy(source_config)
    wrap_quantization_configs(config)
    config[BLOCK_KEY] = block
    return config


def unwrap_config(converted: dict) -> dict:
    """Inverse of `converted_config`: what the source config must have been."""
    config = copy.deepcopy(converted)
    config.pop(BLOCK_KEY, None)
    for holder in (config, config.get("text_config")):
        if isinstance(holder, dict):
            q = holder.get("quantization_config")
            if isinstance(q, dict) and q.get("quant_method") == QUANT_METHOD and "base" in q:
                holder["quantization_config"] = q["base"]
    return config
