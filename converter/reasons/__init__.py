"""The converter's reasons: one record each, grouped by what is refused, and `Code` built
from them.

`Code` is how code names a reason (`Code.HEADER_TOO_LARGE`, value "header-too-large", part
of the `--json` interface: add new ones, never rename). A record added to an area module is
a member here; a code string given twice, here or in the adapter's reasons, refuses to
import.
"""

from __future__ import annotations

from ..errors.registry import code_enum
from . import checkpoint, header, model, output, request, source

# In this order, as `list(Code)` lists them.
AREAS = (request, source, header, model, output, checkpoint)

Code = code_enum(
    "Code",
    (r for area in AREAS for r in area.REASONS),
    __name__,
    "One value per reason a checkpoint, an output or a request is refused.",
)

__all__ = ["AREAS", "Code"]
