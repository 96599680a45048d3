"""Problems are values: every check returns them, the CLI renders them.

A `Problem` says why (a stable `Code`), where (file, tensor), what is wrong, and expected
vs found, so a user can act on it without reading a traceback and a script or a test can
act on the reason without matching message text. `Fatal` carries one or more of them out
of deep code to the command line, which prints their causes (`CONSEQUENCES`: what follows
from another reason is counted, not repeated) and exits with the code `EXIT_CODES` gives
their reasons: raise sites never choose an exit code.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from enum import Enum


class Code(str, Enum):
    """One value per reason a checkpoint, an output or a request is refused.

    The values are part of the `--json` interface: add new ones, never rename.
    """

    # -- what the user asked for
    USAGE = "usage"
    MANIFEST_NOT_FOUND = "manifest-not-found"
    MANIFEST_INVALID = "manifest-invalid"
    # -- finding and reading the source
    SOURCE_NOT_FOUND = "source-not-found"
    SOURCE_NOT_IN_CACHE = "source-not-in-cache"
    OUTPUT_INSIDE_SOURCE = "output-inside-source"
    FILE_MISSING = "file-missing"
    FILE_UNREADABLE = "file-unreadable"
    JSON_INVALID = "json-invalid"
    NOT_A_REGULAR_FILE = "not-a-regular-file"
    LINK_ESCAPES = "link-escapes"
    HUB_ERROR = "hub-error"
    HUB_GATED = "hub-gated"
    HUB_NOT_FOUND = "hub-not-found"
    HUB_REVISION = "hub-revision"
    # -- the index
    INDEX_INVALID = "index-invalid"
    WEIGHT_MAP_ENTRY_UNSAFE = "weight-map-entry-unsafe"
    SHARD_MISSING = "shard-missing"
    INDEX_TENSOR_NOT_IN_SHARD = "index-tensor-not-in-shard"
    INDEX_TENSOR_MISSING = "index-tensor-missing"
    INDEX_WRONG_SHARD = "index-wrong-shard"
    INDEX_TOTAL_SIZE = "index-total-size"
    SHARD_UNREFERENCED = "shard-unreferenced"
    SHARD_NOT_LOADED = "shard-not-loaded"  # a shard the index names that loaders never open
    TENSOR_IN_TWO_SHARDS = "tensor-in-two-shards"  # no index: one name in two shards
    # -- safetensors headers (one per rule, as the library's own reader)
    HEADER_TOO_SMALL = "header-too-small"
    HEADER_LENGTH_ZERO = "header-length-zero"
    HEADER_TOO_LARGE = "header-too-large"
    HEADER_BEYOND_FILE = "header-beyond-file"
    HEADER_NOT_UTF8 = "header-not-utf8"
    HEADER_NOT_JSON = "header-not-json"
    HEADER_DUPLICATE_KEY = "header-duplicate-key"
    HEADER_METADATA = "header-metadata"
    HEADER_ENTRY = "header-entry"
    HEADER_DTYPE = "header-dtype"
    HEADER_SHAPE = "header-shape"
    HEADER_OFFSETS = "header-offsets"
    HEADER_SIZE_MISMATCH = "header-size-mismatch"
    HEADER_OVERLAP = "header-overlap"
    HEADER_GAP = "header-gap"
    FILE_TRUNCATED = "file-truncated"
    FILE_TRAILING_BYTES = "file-trailing-bytes"
    HEADER_OVERFLOW = "header-overflow"
    HEADER_SUB_BYTE = "header-sub-byte"
    HEADER_LIBRARY_REFUSES = "header-library-refuses"
    # -- the config
    NO_QUANTIZATION_CONFIG = "no-quantization-config"
    ALREADY_MARKED = "already-marked"
    CONFIG_FIELD = "config-field"
    PINNED_MISMATCH = "pinned-mismatch"
    SITU_MISMATCH = "situ-mismatch"
    CONFIG_CONFLICT = "config-conflict"  # one field said twice, two ways (alias, top level)
    CONFIG_BOUND = "config-bound"  # a size beyond what the checkpoint can hold
    # -- routed experts and MoE layers
    EXPERT_NAME = "expert-name"
    EXPERT_ID_RANGE = "expert-id-range"
    EXPERT_TENSOR_UNEXPECTED = "expert-tensor-unexpected"
    EXPERT_DTYPE = "expert-dtype"
    EXPERT_SHAPE = "expert-shape"
    EXPERT_PARTNER_MISSING = "expert-partner-missing"
    EXPERT_OUTSIDE_LAYER = "expert-outside-layer"
    LAYER_MISSING = "layer-missing"
    LAYER_INCOMPLETE = "layer-incomplete"
    LAYER_UNEXPECTED = "layer-unexpected"
    LAYER_DUPLICATED = "layer-duplicated"
    NO_EXPERTS = "no-experts"
    INVENTORY_MISSING = "inventory-missing"
    INVENTORY_DTYPE = "inventory-dtype"
    # -- the output directory and the run
    OUTPUT_NOT_DIRECTORY = "output-not-directory"
    OUTPUT_NOT_EMPTY = "output-not-empty"
    FOREIGN_OUTPUT = "foreign-output"
    OUTPUT_LOCKED = "output-locked"
    STATE_LOST = "state-lost"
    NO_SPACE = "no-space"
    IO_ERROR = "io-error"
    SOURCE_CHANGED = "source-changed"
    SCALE_NAN = "scale-nan"
    WINDOW_TOO_SMALL = "window-too-small"
    OUTPUT_HEADER_TOO_LARGE = "output-header-too-large"
    STATE_FOLDER_INVALID = "state-folder-invalid"
    PERMISSION_DENIED = "permission-denied"
    OUTPUT_OF_ANOTHER_SOURCE = "output-of-another-source"
    FILE_NAME_INVALID = "file-name-invalid"
    # -- a converted checkpoint (verify, serve)
    INCOMPLETE_OUTPUT = "incomplete-output"
    BLOCK_MISSING = "block-missing"
    BLOCK_FIELD = "block-field"
    BLOCK_MISMATCH = "block-mismatch"
    NOT_WRAPPED = "not-wrapped"
    CHECKSUMS_INVALID = "checksums-invalid"
    FILE_SIZE_MISMATCH = "file-size-mismatch"
    HEADER_HASH_MISMATCH = "header-hash-mismatch"
    CHECKSUM_MISMATCH = "checksum-mismatch"
    FILE_UNRECORDED = "file-unrecorded"
    TENSOR_NOT_FROM_SOURCE = "tensor-not-from-source"
    TENSOR_MISSING = "tensor-missing"
    BYTES_DIFFER = "bytes-differ"
    W31_NOT_UP_GATE = "w31-not-up-gate"
    CONFIG_DIFFERS = "config-differs"
    SOURCE_CHANGED_SINCE = "source-changed-since"
    NUMERICS_DIFFER = "numerics-differ"
    NUMERICS_UNAVAILABLE = "numerics-unavailable"
    NUMERICS_SELF_TEST = "numerics-self-test"
    TENSOR_DTYPE_DIFFERS = "tensor-dtype-differs"
    TENSOR_SHAPE_DIFFERS = "tensor-shape-differs"
    FILE_NOT_FROM_SOURCE = "file-not-from-source"


@dataclass(frozen=True)
class Problem:
    code: Code
    what: str
    file: str | None = None
    tensor: str | None = None
    expected: str | None = None
    found: str | None = None

    def render(self) -> str:
        where = ", ".join(p for p in (self.file, self.tensor and f"tensor {self.tensor}") if p)
        text = f"{where}: {self.what}" if where else self.what
        # Only what is known: a check that knows what it found but not what it expected
        # (or the reverse) says so, never "expected None".
        facts = [
            f"{label} {value}"
            for label, value in (("expected", self.expected), ("found", self.found))
            if value is not None
        ]
        return text + (f" ({', '.join(facts)})" if facts else "")

    def as_dict(self) -> dict[str, str]:
        fields = {k: v for k, v in self.__dict__.items() if v is not None}
        fields["code"] = self.code.value
        return fields


# -- exit codes: they belong to the reason, never to the place that raises it -------------
EXIT_OK = 0
EXIT_PROBLEMS = 1  # the input is invalid or a check failed
EXIT_USAGE = 2  # the request cannot be carried out as asked: fix the command line
EXIT_INTERRUPTED = 130  # Ctrl-C; state kept, a rerun resumes
EXIT_TERMINATED = 143  # SIGTERM, handled as Ctrl-C
EXIT_BUG = 1  # an unexpected exception (a bug, or an OS error nobody turned into a Code)

# The one table: every reason's exit code, the same in every command and in `--json`.
# One line per code, so a new code without its line fails tests/test_exit_codes.py instead
# of silently taking a default. EXIT_USAGE: what was asked (an option, a manifest name, an
# output path, a window) cannot be done as asked; EXIT_PROBLEMS: the data is wrong.
EXIT_CODES: dict[Code, int] = {
    Code.USAGE: EXIT_USAGE,
    Code.MANIFEST_NOT_FOUND: EXIT_USAGE,
    Code.MANIFEST_INVALID: EXIT_USAGE,
    Code.SOURCE_NOT_FOUND: EXIT_PROBLEMS,
    Code.SOURCE_NOT_IN_CACHE: EXIT_PROBLEMS,
    Code.OUTPUT_INSIDE_SOURCE: EXIT_USAGE,
    Code.FILE_MISSING: EXIT_PROBLEMS,
    Code.FILE_UNREADABLE: EXIT_PROBLEMS,
    Code.JSON_INVALID: EXIT_PROBLEMS,
    Code.NOT_A_REGULAR_FILE: EXIT_PROBLEMS,
    Code.LINK_ESCAPES: EXIT_PROBLEMS,
    Code.HUB_ERROR: EXIT_PROBLEMS,
    Code.HUB_GATED: EXIT_PROBLEMS,
    Code.HUB_NOT_FOUND: EXIT_PROBLEMS,
    Code.HUB_REVISION: EXIT_PROBLEMS,
    Code.INDEX_INVALID: EXIT_PROBLEMS,
    Code.WEIGHT_MAP_ENTRY_UNSAFE: EXIT_PROBLEMS,
    Code.SHARD_MISSING: EXIT_PROBLEMS,
    Code.INDEX_TENSOR_NOT_IN_SHARD: EXIT_PROBLEMS,
    Code.INDEX_TENSOR_MISSING: EXIT_PROBLEMS,
    Code.INDEX_WRONG_SHARD: EXIT_PROBLEMS,
    Code.INDEX_TOTAL_SIZE: EXIT_PROBLEMS,
    Code.SHARD_UNREFERENCED: EXIT_PROBLEMS,
    Code.HEADER_TOO_SMALL: EXIT_PROBLEMS,
    Code.HEADER_LENGTH_ZERO: EXIT_PROBLEMS,
    Code.HEADER_TOO_LARGE: EXIT_PROBLEMS,
    Code.HEADER_BEYOND_FILE: EXIT_PROBLEMS,
    Code.HEADER_NOT_UTF8: EXIT_PROBLEMS,
    Code.HEADER_NOT_JSON: EXIT_PROBLEMS,
    Code.HEADER_DUPLICATE_KEY: EXIT_PROBLEMS,
    Code.HEADER_METADATA: EXIT_PROBLEMS,
    Code.HEADER_ENTRY: EXIT_PROBLEMS,
    Code.HEADER_DTYPE: EXIT_PROBLEMS,
    Code.HEADER_SHAPE: EXIT_PROBLEMS,
    Code.HEADER_OFFSETS: EXIT_PROBLEMS,
    Code.HEADER_SIZE_MISMATCH: EXIT_PROBLEMS,
    Code.HEADER_OVERLAP: EXIT_PROBLEMS,
    Code.HEADER_GAP: EXIT_PROBLEMS,
    Code.FILE_TRUNCATED: EXIT_PROBLEMS,
    Code.FILE_TRAILING_BYTES: EXIT_PROBLEMS,
    Code.HEADER_OVERFLOW: EXIT_PROBLEMS,
    Code.HEADER_SUB_BYTE: EXIT_PROBLEMS,
    Code.HEADER_LIBRARY_REFUSES: EXIT_PROBLEMS,
    Code.NO_QUANTIZATION_CONFIG: EXIT_PROBLEMS,
    Code.ALREADY_MARKED: EXIT_PROBLEMS,
    Code.CONFIG_FIELD: EXIT_PROBLEMS,
    Code.PINNED_MISMATCH: EXIT_PROBLEMS,
    Code.SITU_MISMATCH: EXIT_PROBLEMS,
    Code.EXPERT_NAME: EXIT_PROBLEMS,
    Code.EXPERT_ID_RANGE: EXIT_PROBLEMS,
    Code.EXPERT_TENSOR_UNEXPECTED: EXIT_PROBLEMS,
    Code.EXPERT_DTYPE: EXIT_PROBLEMS,
    Code.EXPERT_SHAPE: EXIT_PROBLEMS,
    Code.EXPERT_PARTNER_MISSING: EXIT_PROBLEMS,
    Code.EXPERT_OUTSIDE_LAYER: EXIT_PROBLEMS,
    Code.LAYER_MISSING: EXIT_PROBLEMS,
    Code.LAYER_INCOMPLETE: EXIT_PROBLEMS,
    Code.LAYER_UNEXPECTED: EXIT_PROBLEMS,
    Code.LAYER_DUPLICATED: EXIT_PROBLEMS,
    Code.NO_EXPERTS: EXIT_PROBLEMS,
    Code.OUTPUT_NOT_DIRECTORY: EXIT_PROBLEMS,
    Code.OUTPUT_NOT_EMPTY: EXIT_PROBLEMS,
    Code.FOREIGN_OUTPUT: EXIT_PROBLEMS,
    Code.OUTPUT_LOCKED: EXIT_PROBLEMS,
    Code.STATE_LOST: EXIT_PROBLEMS,
    Code.NO_SPACE: EXIT_PROBLEMS,
    Code.IO_ERROR: EXIT_PROBLEMS,
    Code.SOURCE_CHANGED: EXIT_PROBLEMS,
    Code.SCALE_NAN: EXIT_PROBLEMS,
    Code.WINDOW_TOO_SMALL: EXIT_USAGE,
    Code.OUTPUT_HEADER_TOO_LARGE: EXIT_PROBLEMS,
    Code.INCOMPLETE_OUTPUT: EXIT_PROBLEMS,
    Code.BLOCK_MISSING: EXIT_PROBLEMS,
    Code.BLOCK_FIELD: EXIT_PROBLEMS,
    Code.BLOCK_MISMATCH: EXIT_PROBLEMS,
    Code.NOT_WRAPPED: EXIT_PROBLEMS,
    Code.CHECKSUMS_INVALID: EXIT_PROBLEMS,
    Code.FILE_SIZE_MISMATCH: EXIT_PROBLEMS,
    Code.HEADER_HASH_MISMATCH: EXIT_PROBLEMS,
    Code.CHECKSUM_MISMATCH: EXIT_PROBLEMS,
    Code.FILE_UNRECORDED: EXIT_PROBLEMS,
    Code.TENSOR_NOT_FROM_SOURCE: EXIT_PROBLEMS,
    Code.TENSOR_MISSING: EXIT_PROBLEMS,
    Code.BYTES_DIFFER: EXIT_PROBLEMS,
    Code.W31_NOT_UP_GATE: EXIT_PROBLEMS,
    Code.CONFIG_DIFFERS: EXIT_PROBLEMS,
    Code.SOURCE_CHANGED_SINCE: EXIT_PROBLEMS,
    Code.NUMERICS_DIFFER: EXIT_PROBLEMS,
    Code.NUMERICS_UNAVAILABLE: EXIT_PROBLEMS,
    Code.NUMERICS_SELF_TEST: EXIT_PROBLEMS,
    Code.INVENTORY_MISSING: EXIT_PROBLEMS,
    Code.INVENTORY_DTYPE: EXIT_PROBLEMS,
    Code.STATE_FOLDER_INVALID: EXIT_PROBLEMS,
    Code.PERMISSION_DENIED: EXIT_PROBLEMS,
    Code.OUTPUT_OF_ANOTHER_SOURCE: EXIT_PROBLEMS,
    Code.FILE_NAME_INVALID: EXIT_PROBLEMS,
    Code.CONFIG_CONFLICT: EXIT_PROBLEMS,
    Code.CONFIG_BOUND: EXIT_PROBLEMS,
    Code.SHARD_NOT_LOADED: EXIT_PROBLEMS,
    Code.TENSOR_IN_TWO_SHARDS: EXIT_PROBLEMS,
    Code.TENSOR_DTYPE_DIFFERS: EXIT_PROBLEMS,
    Code.TENSOR_SHAPE_DIFFERS: EXIT_PROBLEMS,
    Code.FILE_NOT_FROM_SOURCE: EXIT_PROBLEMS,
}


def exit_code(codes: Iterable[Code]) -> int:
    """The exit code of a run that stopped for these reasons: a usage reason wins (the
    command line is wrong whatever else is). A code missing from the table (a test fails on
    that) exits as a failed check."""
    return max((EXIT_CODES.get(c, EXIT_PROBLEMS) for c in codes), default=EXIT_OK)


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
    Code.LAYER_DUPLICATED: frozenset({Code.NO_EXPERTS}),
    Code.EXPERT_TENSOR_UNEXPECTED: frozenset({Code.NO_EXPERTS}),
}


def suppressed_codes(present: Iterable[Code]) -> set[Code]:
    """The reasons among `present` that follow from another reason also present."""
    present = set(present)
    return {c for c in present if any(c in CONSEQUENCES.get(r, ()) for r in present - {c})}


def root_problems(problems: Iterable[Problem]) -> tuple[list[Problem], list[Problem]]:
    """The problems to report (the causes), and those that follow from them."""
    problems = list(problems)
    hidden = suppressed_codes(p.code for p in problems)
    return [p for p in problems if p.code not in hidden], [p for p in problems if p.code in hidden]


def count_codes(problems: Iterable[Problem]) -> dict[str, int]:
    """{code: how many}, in first-seen order: how a list of suppressed problems is shown."""
    counts: dict[str, int] = {}
    for p in problems:
        counts[p.code.value] = counts.get(p.code.value, 0) + 1
    return counts


@dataclass
class Fatal(Exception):
    """Raised with every problem found; the CLI prints their causes and exits with the exit
    code the table gives their reasons."""

    problems: list[Problem] = field(default_factory=list)
    hint: str | None = None

    def __post_init__(self) -> None:
        super().__init__(self.summary())

    @property
    def roots(self) -> list[Problem]:
        return root_problems(self.problems)[0]

    @property
    def suppressed(self) -> list[Problem]:
        return root_problems(self.problems)[1]

    @property
    def exit_code(self) -> int:
        return exit_code(p.code for p in self.roots) or EXIT_PROBLEMS

    def summary(self) -> str:
        roots = self.roots
        if len(roots) == 1:
            return roots[0].render()
        return f"{len(roots)} problems found"

    @property
    def codes(self) -> list[Code]:
        return [p.code for p in self.problems]


def fail(code: Code, what: str, *, hint: str | None = None, **where: str | None) -> Fatal:
    """Shorthand for a single-problem error."""
    return Fatal([Problem(code, what, **where)], hint=hint)


def usage(what: str, **where: str | None) -> Fatal:
    return fail(Code.USAGE, what, **where)
