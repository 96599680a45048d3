"""The `kimi_w31` block as the adapter reads it: the contract's checks, raised as errors.

SGLang-free on purpose: `kimi-convert serve` and the plain test suite use it without SGLang.
The rules themselves live in the contract (`converter/contract.py`), shared with the
converter and `verify`; configs may be plain dicts or transformers config objects.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ..converter import contract
from ..converter.contract import BLOCK_KEY, WRAPPER_METHOD, find_block, text_config
from ..converter.errors import Fatal, fatal
from .reasons import AdapterCode
from .refused import Refused

# Serve an unconverted Kimi-K3 checkpoint with the adapter's SiTU method (see README).
OPT_IN_ENV = "KIMI_W31_SERVE_UNCONVERTED"

__all__ = ["BLOCK_KEY", "WRAPPER_METHOD", "find_block", "text_config"]


class LayoutError(Refused, ValueError):
    """The checkpoint's `kimi_w31` block or its quantization wrapper is not usable."""


# What to do about any invalid block, whichever field its problems name.
BLOCK_HINT = (
    "the checkpoint was edited after conversion, written by a newer converter, or converted "
    "with the wrong manifest: convert it again from the source"
)


@dataclass(frozen=True)
class W31Layout:
    """What the adapter needs from the block; the rest is checked, not kept."""

    format_version: int
    situ_beta: float
    situ_linear_beta: float
    group_size: int = contract.GROUP_SIZE


def load_layout(cfg: Any) -> W31Layout | None:
    """The validated layout of a converted config, None for an unconverted one.

    Raises LayoutError with every problem the contract finds (the block's fields, and its
    agreement with the model config's SiTU parameters and activation).
    """
    block = find_block(cfg)
    if block is None:
        return None
    problems = contract.check_block(cfg)
    if problems:
        raise LayoutError(Fatal(problems, hint=BLOCK_HINT))
    return W31Layout(
        format_version=int(block["format_version"]),
        situ_beta=float(block["situ_beta"]),
        situ_linear_beta=float(block["situ_linear_beta"]),
        group_size=int(block["group_size"]),
    )


def unwrap_quantization_config(cfg: Any) -> int:
    """Replace every `{"quant_method": "kimi_w31", "base": X}` on cfg (and its text config)
    by X, in place, so SGLang sees the source's quantization exactly. Idempotent."""
    try:
        return contract.unwrap_quantization_config(cfg)
    except contract.ContractError as exc:
        raise LayoutError(Fatal([exc.problem])) from None


def unwrap_one(qc: Mapping) -> dict:
    """`{"quant_method": "kimi_w31", "base": X}` -> X (validated)."""
    try:
        return contract.unwrap_one(qc)
    except contract.ContractError as exc:
        raise LayoutError(Fatal([exc.problem])) from None


def opt_in_unconverted(environ: Mapping[str, str] | None = None) -> bool:
    """Whether the user asked to serve an unconverted Kimi-K3 checkpoint with the adapter."""
    value = (environ if environ is not None else os.environ).get(OPT_IN_ENV, "")
    if value.strip().lower() in ("", "0", "false", "no", "off"):
        return False
    if value.strip().lower() in ("1", "true", "yes", "on"):
        return True
    raise LayoutError(fatal(AdapterCode.OPT_IN_VALUE, env=OPT_IN_ENV, value=value))
