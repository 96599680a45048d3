"""The `kimi_w31` block of a converted checkpoint's config.json: read, validate, unwrap.

SGLang-free on purpose: `kimi-convert serve` and the plain test suite use it without SGLang.
Configs may be plain dicts (config.json) or transformers config objects; both are read
through `_get`.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

BLOCK_KEY = "kimi_w31"
WRAPPER_METHOD = "kimi_w31"
FORMAT_VERSIONS = (1,)
# Serve an unconverted Kimi-K3 checkpoint with the adapter's SiTU method (see README).
OPT_IN_ENV = "KIMI_W31_SERVE_UNCONVERTED"

_EXPECTED = {
    "fc1_layout": "w31",
    "fc1_order": ["up", "gate"],
    "activation": "situ",
    "weight_format": "mxfp4",
    "group_size": 32,
}


class LayoutError(ValueError):
    """The checkpoint's `kimi_w31` block or its quantization wrapper is not usable."""


@dataclass(frozen=True)
class W31Layout:
    """What the adapter needs from the block; the rest is checked, not kept."""

    format_version: int
    situ_beta: float
    situ_linear_beta: float
    group_size: int = 32


def _get(cfg: Any, key: str, default: Any = None) -> Any:
    if isinstance(cfg, Mapping):
        return cfg.get(key, default)
    return getattr(cfg, key, default)


def _set(cfg: Any, key: str, value: Any) -> None:
    if isinstance(cfg, dict):
        cfg[key] = value
    else:
        setattr(cfg, key, value)


def text_config(cfg: Any) -> Any:
    """The sub-config that holds the MoE hyper-parameters (VL wrappers nest it)."""
    inner = _get(cfg, "text_config")
    return cfg if inner is None else inner


def find_block(*configs: Any) -> Mapping | None:
    """The first `kimi_w31` block found on the given configs or their text configs."""
    for cfg in configs:
        if cfg is None:
            continue
        for candidate in (cfg, text_config(cfg)):
            block = _get(candidate, BLOCK_KEY)
            if block is not None:
                if not isinstance(block, Mapping):
                    raise LayoutError(
                        f"config.json '{BLOCK_KEY}' must be an object, found {type(block).__name__}"
                    )
                return block
    return None


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def parse_block(block: Mapping) -> W31Layout:
    """Validate the eight contract fields; every problem is reported, not only the first."""
    problems: list[str] = []
    version = block.get("format_version")
    if version not in FORMAT_VERSIONS:
        problems.append(
            f"format_version: expected one of {list(FORMAT_VERSIONS)}, found {version!r} "
            "(a newer converter wrote this checkpoint: upgrade kimi-w31)"
        )
    for key, want in _EXPECTED.items():
        found = block.get(key)
        if isinstance(want, list):
            found = list(found) if isinstance(found, (list, tuple)) else found
        if found != want:
            problems.append(f"{key}: expected {want!r}, found {found!r}")
    for key in ("situ_beta", "situ_linear_beta"):
        value = block.get(key)
        if not _is_number(value) or not math.isfinite(value) or value <= 0:
            problems.append(f"{key}: expected a positive finite number, found {value!r}")
    if problems:
        raise LayoutError(
            f"config.json '{BLOCK_KEY}' block is not valid:\n  - " + "\n  - ".join(problems)
        )
    return W31Layout(
        format_version=int(version),
        situ_beta=float(block["situ_beta"]),
        situ_linear_beta=float(block["situ_linear_beta"]),
        group_size=int(block["group_size"]),
    )


def check_against_model(layout: W31Layout, cfg: Any) -> None:
    """Cross-check the block's SiTU parameters with the model config that SGLang uses."""
    text = text_config(cfg)
    problems: list[str] = []
    act = _get(text, "hidden_act")
    if act != "situ":
        problems.append(f"hidden_act: block says 'situ', model config says {act!r}")
    for block_key, cfg_key in (
        ("situ_beta", "activation_situ_beta"),
        ("situ_linear_beta", "activation_situ_linear_beta"),
    ):
        want = getattr(layout, block_key)
        found = _get(text, cfg_key)
        if not _is_number(found) or float(found) != want:
            problems.append(f"{block_key}: block says {want}, model config {cfg_key} = {found!r}")
    if problems:
        raise LayoutError(
            f"config.json '{BLOCK_KEY}' block disagrees with the model config:\n  - "
            + "\n  - ".join(problems)
            + "\nThe checkpoint was edited after conversion or converted with the wrong "
            "manifest: convert it again from the source."
        )


def load_layout(*configs: Any) -> W31Layout | None:
    """Block found on `configs` -> validated layout (checked against configs[0]); else None."""
    block = find_block(*configs)
    if block is None:
        return None
    layout = parse_block(block)
    check_against_model(layout, configs[0])
    return layout


def unwrap_quantization_config(cfg: Any) -> int:
    """Replace every `{"quant_method": "kimi_w31", "base": X}` on cfg (and its text config)
    by X, in place, so SGLang sees the source's quantization exactly. Returns how many were
    unwrapped. Idempotent."""
    count = 0
    seen: set[int] = set()
    for holder in (cfg, text_config(cfg)):
        if id(holder) in seen:
            continue
        seen.add(id(holder))
        qc = _get(holder, "quantization_config")
        if not isinstance(qc, Mapping) or qc.get("quant_method") != WRAPPER_METHOD:
            continue
        _set(holder, "quantization_config", unwrap_one(qc))
        count += 1
    return count


def unwrap_one(qc: Mapping) -> dict:
    """`{"quant_method": "kimi_w31", "base": X}` -> X (validated)."""
    base = qc.get("base")
    if not isinstance(base, Mapping) or not isinstance(base.get("quant_method"), str):
        raise LayoutError(
            f"quantization_config with quant_method '{WRAPPER_METHOD}' must hold the original "
            f"config under 'base' (an object with a 'quant_method'), found {base!r}"
        )
    if base["quant_method"] == WRAPPER_METHOD:
        raise LayoutError(
            f"quantization_config is wrapped twice in '{WRAPPER_METHOD}': convert it again"
        )
    return dict(base)


def opt_in_unconverted(environ: Mapping[str, str] | None = None) -> bool:
    """Whether the user asked to serve an unconverted Kimi-K3 checkpoint with the adapter."""
    value = (environ if environ is not None else os.environ).get(OPT_IN_ENV, "")
    if value.strip().lower() in ("", "0", "false", "no", "off"):
        return False
    if value.strip().lower() in ("1", "true", "yes", "on"):
        return True
    raise LayoutError(f"{OPT_IN_ENV}={value!r}: expected 1/true/yes/on or 0/false/no/off")
