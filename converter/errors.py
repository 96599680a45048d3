"""Problems are values: every check returns them, the CLI renders them.

A `Problem` says why (a stable `Code`), where (file, tensor), what is wrong, and expected
vs found, so a user can act on it without reading a traceback and a script or a test can
act on the reason without matching message text. `Fatal` carries one or more of them out
of deep code to the command line, which prints them all and exits with its `exit_code`.
"""

from __future__ import annotations

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
    # -- the config
    NO_QUANTIZATION_CONFIG = "no-quantization-config"
    ALREADY_MARKED = "already-marked"
    CONFIG_FIELD = "config-field"
    PINNED_MISMATCH = "pinned-mismatch"
    SITU_MISMATCH = "situ-mismatch"
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
    TENSOR_DTYPE_DIFFERS = "tensor-dtype-differs"
    TENSOR_SHAPE_DIFFERS = "tensor-shape-differs"
    FILE_NOT_FROM_SOURCE = "file-not-from-source"
    # -- a prebuilt kernel bundle (adapter: kimi-convert prebuild --out, KIMI_W31_KERNELS)
    KERNEL_BUNDLE_INVALID = "kernel-bundle-invalid"
    KERNEL_BUNDLE_ARCH = "kernel-bundle-arch"
    KERNEL_BUNDLE_FLASHINFER = "kernel-bundle-flashinfer"
    KERNEL_BUNDLE_CUDA = "kernel-bundle-cuda"
    KERNEL_BUNDLE_TORCH = "kernel-bundle-torch"
    KERNEL_BUNDLE_PYTHON = "kernel-bundle-python"
    KERNEL_BUNDLE_NO_MODULE = "kernel-bundle-no-module"
    KERNEL_BUNDLE_SOURCES = "kernel-bundle-sources"
    KERNEL_BUNDLE_LIBRARY = "kernel-bundle-library"


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
        if self.expected is not None or self.found is not None:
            text += f" (expected {self.expected}, found {self.found})"
        return text

    def as_dict(self) -> dict[str, str]:
        fields = {k: v for k, v in self.__dict__.items() if v is not None}
        fields["code"] = self.code.value
        return fields


EXIT_PROBLEMS = 1
EXIT_USAGE = 2


@dataclass
class Fatal(Exception):
    """Raised with every problem found; the CLI prints them and exits with `exit_code`."""

    problems: list[Problem] = field(default_factory=list)
    exit_code: int = EXIT_PROBLEMS
    hint: str | None = None

    def __post_init__(self) -> None:
        super().__init__(self.summary())

    def summary(self) -> str:
        if len(self.problems) == 1:
            return self.problems[0].render()
        return f"{len(self.problems)} problems found"

    @property
    def codes(self) -> list[Code]:
        return [p.code for p in self.problems]


def fail(
    code: Code,
    what: str,
    *,
    hint: str | None = None,
    exit_code: int = EXIT_PROBLEMS,
    **where: str | None,
) -> Fatal:
    """Shorthand for a single-problem error."""
    return Fatal([Problem(code, what, **where)], exit_code=exit_code, hint=hint)


def usage(what: str, **where: str | None) -> Fatal:
    return fail(Code.USAGE, what, exit_code=EXIT_USAGE, **where)
