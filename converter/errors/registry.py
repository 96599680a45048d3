"""Every reason's record, found by its code.

A package declares its reasons as records and builds its code enum with `code_enum` (the
converter's `Code`, the adapter's `AdapterCode`); the records are registered here, so a
problem of either package is worded, given its exit code and judged for its consequences by
one mechanism that imports neither package's reasons.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from enum import Enum
from types import MappingProxyType

from .reason import Reason

_BY_CODE: dict[str, Reason] = {}
RECORDS: Mapping[str, Reason] = MappingProxyType(_BY_CODE)
"""{code string: record} of every reason registered so far."""


def member_name(code: str) -> str:
    """'header-too-large' -> 'HEADER_TOO_LARGE'."""
    return code.upper().replace("-", "_")


def code_enum(name: str, records: Iterable[Reason], module: str, doc: str) -> type[Enum]:
    """The str Enum of these records' codes, in their order, with the records registered;
    refuses (registering nothing) a code given twice, here or by an enum built before."""
    records = list(records)
    members: dict[str, str] = {}
    for r in records:
        if r.code in _BY_CODE or member_name(r.code) in members:
            raise ValueError(f"reason {r.code!r} is declared twice")
        members[member_name(r.code)] = r.code
    enum = Enum(name, members, type=str, module=module, qualname=name)  # type: ignore[misc]
    enum.__doc__ = doc
    _BY_CODE.update((r.code, r) for r in records)
    return enum


def reason(code: str) -> Reason:
    """The record of `code` (a member of a code enum, or its value)."""
    return _BY_CODE[code.value if isinstance(code, Enum) else code]
