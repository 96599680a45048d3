"""A safetensors header, one reason per rule, as the library's own reader refuses."""

from __future__ import annotations

from ..errors import Message, Reason

REASONS = (
    Reason(
        "header-too-small",
        "file too small for a safetensors header",
        expected="at least 8 bytes",
        found="{size} bytes",
    ),
    Reason("header-length-zero", "header length is 0"),
    Reason(
        "header-too-large",
        "header length exceeds the 100 MB limit",
        expected="<= {limit}",
        found="{length}",
    ),
    Reason(
        "header-beyond-file",
        "header length is larger than the file",
        expected="<= {room}",
        found="{length}",
    ),
    Reason("header-not-utf8", "header is not UTF-8 ({error})"),
    Reason(
        "header-not-json",
        rules={
            "not-object": Message("header is not a JSON object"),
            "syntax": Message("header is not valid JSON ({error})"),
            "surrogate": Message(
                "header has a string with a lone UTF-16 surrogate escape (not valid Unicode)",
                found="{text}",
            ),
        },
    ),
    Reason("header-duplicate-key", "header has duplicate key {key!r}"),
    Reason("header-metadata", "__metadata__ must map strings to strings"),
    Reason("header-entry", "entry must have exactly dtype, shape and data_offsets"),
    Reason("header-dtype", "unknown dtype", expected="a safetensors dtype", found="{dtype!r}"),
    Reason("header-shape", "shape must be a list of non-negative integers", found="{shape!r}"),
    Reason(
        "header-offsets",
        rules={
            "two-integers": Message("data_offsets must be two integers", found="{offsets!r}"),
            "order": Message("data_offsets out of order or negative", found="{offsets!r}"),
        },
    ),
    Reason(
        "header-size-mismatch",
        "byte size disagrees with dtype and shape",
        expected="{want} bytes for {dtype}{shape}",
        found="{size} bytes",
    ),
    Reason(
        "header-overlap",
        "data_offsets overlaps the previous tensor",
        expected="start at {want}",
        found="{begin}",
    ),
    Reason("header-gap", "data_offsets leaves a gap", expected="start at {want}", found="{begin}"),
    Reason(
        "file-truncated",
        rules={
            "header": Message("file is truncated", expected="{want} bytes", found="{size} bytes"),
            "read": Message(
                "file ended while it was being read (changed during verify?)",
                found="ended at byte {offset}",
            ),
        },
    ),
    Reason(
        "file-trailing-bytes",
        "file has trailing bytes",
        expected="{want} bytes",
        found="{size} bytes",
    ),
    Reason(
        "header-overflow",
        rules={
            "elements": Message(
                "element count overflows a usize (2^64 - 1)", found="{dtype}{shape}"
            ),
            "bits": Message("size in bits overflows a usize (2^64 - 1)", found="{dtype}{shape}"),
        },
    ),
    Reason(
        "header-sub-byte",
        "{count} elements of {dtype} do not fill whole bytes",
        found="{dtype}{shape}",
    ),
    Reason(
        "header-library-refuses",
        rules={
            "open": Message("the safetensors library cannot open this file ({error})"),
            "reads-differently": Message(
                "the safetensors library reads this tensor differently from the strict reader",
                expected="{ours!r}",
                found="{theirs!r}",
            ),
            "tensor": Message("the safetensors library cannot read the {side}'s tensor ({error})"),
        },
    ),
)
