"""`Code`, built from the records: one member per `Reason`, named after its code string.

The records are the declaration; the enum is how code names a reason (`Code.HEADER_TOO_LARGE`,
value "header-too-large", part of the `--json` interface). A record added in a `reasons_*`
module is a member here; a code string given twice refuses to import.
"""

from __future__ import annotations

from collections.abc import Iterable
from enum import Enum

from . import (
    reasons_bundle,
    reasons_checkpoint,
    reasons_header,
    reasons_load,
    reasons_model,
    reasons_output,
    reasons_request,
    reasons_serve,
    reasons_source,
)
from .reason import Reason

# In this order, as `list(Code)` lists them.
AREAS = (
    reasons_request,
    reasons_source,
    reasons_header,
    reasons_model,
    reasons_output,
    reasons_checkpoint,
    reasons_bundle,
    reasons_serve,
    reasons_load,
)


def member_name(code: str) -> str:
    """'header-too-large' -> 'HEADER_TOO_LARGE'."""
    return code.upper().replace("-", "_")


def build(name: str, records: Iterable[Reason], module: str) -> tuple[type[Enum], dict]:
    """The str Enum of these records' codes, and {member: record}; refuses a code (or a
    member name) given twice."""
    members: dict[str, str] = {}
    by_name: dict[str, Reason] = {}
    for r in records:
        key = member_name(r.code)
        if key in members:
            raise ValueError(f"reason {r.code!r} is declared twice")
        members[key] = r.code
        by_name[key] = r
    enum = Enum(name, members, type=str, module=module, qualname=name)  # type: ignore[misc]
    return enum, {enum[k]: r for k, r in by_name.items()}


Code, RECORDS = build("Code", (r for area in AREAS for r in area.REASONS), __name__)
Code.__doc__ = """One value per reason a checkpoint, an output or a request is refused.

The values are part of the `--json` interface: add new ones, never rename."""


def reason(code: Code) -> Reason:
    """The record of `code`."""
    return RECORDS[code]


# -- one cause, one message -----------------------------------------------------------------
# When the reason on the left is reported, the reasons on the right follow from it and are
# not reported beside it (only counted): a config field the layer rule cannot read makes
# every expert layer "not a MoE layer"; a converted checkpoint given as a source lacks every
# w1/w3 and holds w31; an unconverted one given to verify the reverse. Judged by code, so
# the rule is the same wherever problems are rendered. Acyclic (a test holds it), so every
# non-empty list keeps at least one problem.
CONSEQUENCES: dict[Code, frozenset[Code]] = {
    Code.CONFIG_FIELD: frozenset(
        {
            Code.LAYER_UNEXPECTED,
            Code.LAYER_MISSING,
            Code.LAYER_INCOMPLETE,
            Code.EXPERT_ID_RANGE,
            Code.EXPERT_SHAPE,
            Code.NO_EXPERTS,
        }
    ),
    Code.ALREADY_MARKED: frozenset(
        {
            Code.EXPERT_TENSOR_UNEXPECTED,
            Code.EXPERT_PARTNER_MISSING,
            Code.LAYER_INCOMPLETE,
            Code.NO_EXPERTS,
        }
    ),
    Code.BLOCK_MISSING: frozenset(
        {
            Code.NOT_WRAPPED,
            Code.CHECKSUMS_INVALID,
            Code.EXPERT_TENSOR_UNEXPECTED,
            Code.EXPERT_PARTNER_MISSING,
            Code.LAYER_INCOMPLETE,
            Code.NO_EXPERTS,
        }
    ),
    # Experts that exist but sit where no MoE layer loads them are not "no experts".
    Code.LAYER_UNEXPECTED: frozenset({Code.NO_EXPERTS}),
    Code.EXPERT_OUTSIDE_LAYER: frozenset({Code.NO_EXPERTS}),
    # A layer's experts under two spellings, or a w1/w3 left beside its w31: the names
    # that reach one parameter follow from it.
    Code.LAYER_DUPLICATED: frozenset({Code.NO_EXPERTS, Code.NAME_COLLISION}),
    Code.EXPERT_TENSOR_UNEXPECTED: frozenset({Code.NO_EXPERTS, Code.NAME_COLLISION}),
}
