"""The adapter's reasons: one record each (its kernel bundle, `serve`'s command line and
checks, building kernels and loading experts), and `AdapterCode` built from them.

They are worded, given exit codes and rendered by the converter's mechanism
(`converter.errors`), as the converter's own reasons are; their values are part of the same
`--json` interface and share one name space with the converter's `Code`.
"""

from __future__ import annotations

from ...converter.errors.registry import code_enum
from . import bundle, load, serve

AREAS = (bundle, serve, load)

AdapterCode = code_enum(
    "AdapterCode",
    (r for area in AREAS for r in area.REASONS),
    __name__,
    "One value per reason the adapter refuses a bundle, a serve request or a load.",
)

__all__ = ["AREAS", "AdapterCode"]
