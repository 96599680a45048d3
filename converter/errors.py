"""Problems are values: every check returns them, the CLI renders them.

A `Problem` says why (a stable `Code`), where (file, tensor), what is wrong, and expected
vs found, so a user can act on it without reading a traceback and a script or a test can
act on the reason without matching message text. `Fatal` carries one or more of them out
of deep code to the command line, which prints their causes (`CONSEQUENCES`: what follows
from another reason is counted, not repeated) and exits with the code `EXIT_CODES` gives
their reasons: raise sites never choose an exit code.

Each reason's message lives beside it (`MESSAGES`, as the safetensors library keeps each
error's message with its variant): a call site names the code and passes the facts,
`problem(Code.HEADER_TOO_LARGE, file=name, length=n)`, and never writes message text. Where
one code covers several situations, a `rule` fact picks the situation's message.
"""

from __future__ import annotations

import string
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
    HUB_TIMEOUT = "hub-timeout"
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
    INVENTORY_SHAPE = "inventory-shape"
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
    PATH_UNUSABLE = "path-unusable"  # a path argument the OS refuses to look up
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
    # -- what is served is what was verified (the adapter, at load)
    NOT_VERIFIED = "not-verified"
    VERIFIED_FILES_CHANGED = "verified-files-changed"
    NAME_COLLISION = "name-collision"  # two checkpoint names reach one model parameter
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
    KERNEL_BUNDLE_MISSING = "kernel-bundle-missing"
    KERNEL_BUNDLE_LINK = "kernel-bundle-link"
    KERNEL_BUNDLE_NOT_REGULAR = "kernel-bundle-not-regular"
    KERNEL_BUNDLE_OWNER = "kernel-bundle-owner"
    KERNEL_BUNDLE_WRITABLE = "kernel-bundle-writable"
    KERNEL_BUNDLE_TOO_LARGE = "kernel-bundle-too-large"
    KERNEL_BUNDLE_CPU = "kernel-bundle-cpu"
    KERNEL_BUNDLE_LIBC = "kernel-bundle-libc"
    KERNEL_BUNDLE_PYTHON_ABI = "kernel-bundle-python-abi"
    KERNEL_BUNDLE_BUSY = "kernel-bundle-busy"


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


def human_size(n: float) -> str:
    """1_600_000_000_000 -> '1.6 TB' (decimal units, as disks are sold and `df -H` shows)."""
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1000
    return str(n)


def repair_command(output: str, source: str = "SRC") -> str:
    """The command that repairs an output whose data was damaged after its conversion: the
    conversion again, re-reading every kept shard (verify names it; so does a plain rerun,
    which does not re-read and so cannot see the damage)."""
    return f"kimi-convert {source} {output} --rehash"


def plural(n: int, noun: str, many: str | None = None) -> str:
    """'1 shard', '2 shards', '0 shards' (`many` where the plural is not noun + s)."""
    return f"{n} {noun if n == 1 else many or noun + 's'}"


class Size(int):
    """A byte count as a fact: messages show it for people and exactly ('46.0 GB
    (45,998,000,000 bytes)'); it is still the int, for code that reads it."""

    def __str__(self) -> str:
        return f"{human_size(self)} ({int(self):,} bytes)"

    def __format__(self, spec: str) -> str:
        return str(self) if not spec else int(self).__format__(spec)


# -- messages: each reason's words, over the facts its call sites pass ----------------------
@dataclass(frozen=True)
class Message:
    """Templates (`str.format` over named facts) for a problem's `what`, and for its
    `expected`/`found`/`hint` where the code always words them the same way. A call site
    passes `expected`/`found` itself only where the message has no template for them."""

    what: str
    expected: str | None = None
    found: str | None = None
    hint: str | None = None


# Every reason's message, keyed by its code as `--json` shows it, and `code/rule` where one
# code covers several situations. An entry is `key: what`, then `  expected:`, `  found:` and
# `  hint:` lines where the code words them itself; a line indented four spaces continues the
# one before. Templates are `str.format` over the facts a call site passes (`{{` is a brace).
# Text rather than a dict of calls: one line per thing said, read like the catalog it is.
_CATALOG = """
# -- what the user asked for
usage/ray-address: --ray-address only applies with --executor ray
usage/download-options: {options} only apply with --download
usage/download-with-ray: --download and --executor ray do not combine: download first (hf download
    ... --local-dir on shared storage), then convert on Ray
usage/synth-group: --k and --n must be multiples of {group} (the MXFP4 group size)
usage/synth-no-moe: no MoE layer: raise --layers or lower --dense-layers / --moe-every
usage/ray-missing: --executor ray needs Ray, an optional dependency: pip install ray (or install
    kimi-w31 with its 'ray' extra) on the driver and on every node of the cluster
usage/ray-version: kimi-w31 on this node differs from the driver's
  expected: {driver}
  found: {node}
usage/hub-repo-id: --download needs a Hugging Face repo id (org/name)
usage/revision-local: --revision {revision!r} applies to a Hugging Face repo id, not to a local
    directory
usage/hub-timeout: {name} must be a positive number of seconds
  found: {value}
usage/hub-retries: {name} must be a whole number of retries (0 or more)
  found: {value}
usage/max-shard-size: --max-shard-size must be positive
  found: {size}
usage/numerics-source: --numerics needs --source SRC: it computes each expert from the source and
    from the output
usage/sample: the number of experts to sample must be at least 1 (or all)
  found: {sample}
usage/workers: workers must be at least 1
  found: {workers}
usage/numerics-options: {options} only apply with --numerics
usage/experts-with-all: --experts and --all do not combine: sample N experts, or check all
usage/source-is-output: --source is the output directory itself
manifest-not-found/name: unknown manifest {name!r}
  expected: {known} or a path to a .json file
  found: {name}
manifest-not-found/file: manifest file not found
manifest-invalid/not-json: manifest is malformed: not valid JSON ({error})
manifest-invalid/not-object: manifest is malformed: not a JSON object
manifest-invalid/no-key: manifest is malformed: it has no '{key}' ({meaning})
manifest-invalid/dims: manifest is malformed: 'dims' must map symbols to config field names
manifest-invalid/dims-missing: manifest is malformed: 'dims' does not name the config field of
    {symbols}
manifest-invalid/situ: manifest is malformed: 'situ' must give numbers 'beta' and 'linear_beta'
manifest-invalid/group-size: manifest is malformed: 'group_size' must be {group} (MXFP4)
manifest-invalid/pinned: manifest is malformed: 'pinned' must map config fields to values
manifest-invalid/section-keys: manifest is malformed: '{section}' must have exactly {want}
manifest-invalid/entry: manifest is malformed: '{section}.{key}' must be {{"dtype": str, "shape":
    [formula, ...]}} with formulas like N, 2*N, K/32 over the symbols in 'dims'
manifest-invalid/name: manifest is malformed: 'name' must be a string
manifest-invalid/inventory: manifest is malformed: 'inventory' must be {{"dtypes": [str], "aliases":
    {{str: str}}, "layer_prefix": str with {{L}}, "vision_block_prefix": str with {{B}},
    "vision_blocks": [field, default], "groups": [{{"place": one of {places}, "names": [str],
    optional "when"/"unless": config field}}]}}

# -- finding and reading the source
source-not-found/spec: source not found: expected a directory with model.safetensors.index.json or
    model.safetensors, or a Hugging Face repo id (org/name) in the local cache
source-not-found/not-directory: source is not a directory
source-not-in-cache: {where!r} is not a local directory and is not in the local Hugging Face cache
  hint: download it first (`hf download {command}`), stream it with --download, or pass a directory
output-inside-source: output directory is the source or inside it
  expected: a directory outside the source
  found: {source}
file-missing/file: file is missing
file-missing/no-weights: no model.safetensors.index.json and no *.safetensors file in the source
    directory
file-missing/hub-config: the repository has no config.json
file-missing/hub-weights: the repository has no model.safetensors.index.json or model.safetensors
file-missing/recorded: file recorded by the conversion is missing
file-missing/from-source: file of the source is missing from the output (or not a regular file)
file-missing/served: source: no index and no *.safetensors file
file-unreadable/read: cannot read ({error})
file-unreadable/served: source: cannot read ({error})
file-unreadable/list: cannot list ({error})
json-invalid/not-json: not valid JSON ({error})
json-invalid/config-not-object: config.json is not a JSON object
not-a-regular-file/file: not a regular file
  expected: a regular file
  found: {kind}
not-a-regular-file/shard: shard is not a regular file
  expected: a regular file (a shard may be a symlink to one, e.g. on another disk)
  found: {kind}
not-a-regular-file/publish: not a regular file: it cannot be copied into the output
  expected: a regular file
  found: {kind}
not-a-regular-file/output: not a regular file (a converted checkpoint holds only regular files)
  found: {kind}
not-a-regular-file/served: source: not a regular file
link-escapes/output: output path leads outside the output directory (a symlink?)
link-escapes/publish-inside: file is a symlink into a hidden or unpublished path of the source: it
    would publish a file that is not published directly
  expected: a regular file, or a link to one of the source's own published files
  found: {kind}
link-escapes/publish-outside: file is a symlink outside the source: it would publish a file that is
    not published directly
  expected: a regular file, or a link to one of the source's own published files
  found: {kind}
link-escapes/publish-loop: folder is a symlink to a folder that holds it: every file under it
    would be published under endless names
  expected: a folder, or a link to a folder that does not hold the link
  found: {kind}
hub-error/request: {action} failed: {error}
  hint: rerun the same command once the cause is fixed: finished output shards and fully downloaded
    source shards are kept
hub-error/no-commit: the Hub did not report a commit for this revision
hub-error/no-size: the Hub did not report size and content id for a file
hub-error/short-range: the server returned a short range for the header
hub-error/bad-range: the server answered a range request with other bytes than asked
  expected: bytes from {first}
  found: {said}
hub-gated: the repository is gated: accept its terms on the Hub and log in (hf auth login)
hub-not-found: repository not found (or private: log in with hf auth login or set HF_TOKEN)
hub-timeout/request: {action}: the Hub did not answer within {timeout} s ({tries} tries)
  hint: check the network and the endpoint (HF_ENDPOINT); KIMI_W31_HUB_TIMEOUT and
    KIMI_W31_HUB_RETRIES set the wait and the retries; rerun the same command: finished output
    shards and fully downloaded source shards are kept
hub-timeout/client: {action}: the Hub did not answer in time (huggingface_hub's own wait and
    retries were spent)
  hint: check the network and the endpoint (HF_ENDPOINT); HF_HUB_ETAG_TIMEOUT and
    HF_HUB_DOWNLOAD_TIMEOUT set huggingface_hub's waits; rerun the same command: finished output
    shards and fully downloaded source shards are kept
hub-revision: revision not found in the repository
  expected: a branch, tag or commit
  found: {revision}
  hint: check --revision (without it: the default branch, main)

path-unusable/loop: {argument}: the path cannot be looked up: a link on the way leads back to
    itself
  found: {error}
  hint: fix or remove the link named in the path (ls -l each folder on the way)
path-unusable/too-long: {argument}: the path is too long to look up on this system
  expected: names of at most {name_max} bytes, a path of at most {path_max}
  found: {error}
  hint: use a shorter path (a symlink with a short name to a folder on the way works)
path-unusable/os: {argument}: the path cannot be looked up
  found: {error}

# -- the index
index-invalid/no-weight-map: index has no weight_map object
index-invalid/served: source: index without a readable weight_map
weight-map-entry-unsafe: weight_map entry {why}
  found: {shard!r}
shard-missing/local: shard named in the index is missing
shard-missing/hub: shard named in the index is missing from the repository
shard-missing/cache: the Hugging Face cache holds part of this repository: {missing} of {total}
    shards the index names are not in its snapshot {snapshot} (a download that did not finish)
  hint: finish the download (`hf download {command}`: it fetches only what is missing), or stream
    it with --download
shard-missing/served: source: index names a shard that is not there
shard-missing/dangling: shard named in the index is a symlink to nothing
  expected: a regular file (a shard may be a symlink to one, e.g. on another disk)
  found: {kind}
index-tensor-not-in-shard: index names a tensor its shard does not hold
index-tensor-missing: tensor is missing from {index}
index-wrong-shard: tensor is in a different shard than the index says
  expected: {owner}
  found: {file}
index-total-size: metadata.total_size is not the sum of the tensors' bytes
  expected: {data}
  found: {total!r}
shard-unreferenced: safetensors file the index does not reference
shard-not-loaded/index: index names {count} shard(s) that loaders never open: they load only
    top-level *.safetensors files, so these tensors would not be served
  expected: top-level file names (move the shards, or links to them, to the top)
  found: {shards}
shard-not-loaded/served: source: index names a shard loaders never open
tensor-in-two-shards: tensor is in two shards and there is no index to say which one serves
  expected: only in {first}

# -- safetensors headers (one per rule, as the library's own reader)
header-too-small: file too small for a safetensors header
  expected: at least 8 bytes
  found: {size} bytes
header-length-zero: header length is 0
header-too-large: header length exceeds the 100 MB limit
  expected: <= {limit}
  found: {length}
header-beyond-file: header length is larger than the file
  expected: <= {room}
  found: {length}
header-not-utf8: header is not UTF-8 ({error})
header-not-json/not-object: header is not a JSON object
header-not-json/syntax: header is not valid JSON ({error})
header-not-json/surrogate: header has a string with a lone UTF-16 surrogate escape (not valid
    Unicode)
  found: {text}
header-duplicate-key: header has duplicate key {key!r}
header-metadata: __metadata__ must map strings to strings
header-entry: entry must have exactly dtype, shape and data_offsets
header-dtype: unknown dtype
  expected: a safetensors dtype
  found: {dtype!r}
header-shape: shape must be a list of non-negative integers
  found: {shape!r}
header-offsets/two-integers: data_offsets must be two integers
  found: {offsets!r}
header-offsets/order: data_offsets out of order or negative
  found: {offsets!r}
header-size-mismatch: byte size disagrees with dtype and shape
  expected: {want} bytes for {dtype}{shape}
  found: {size} bytes
header-overlap: data_offsets overlaps the previous tensor
  expected: start at {want}
  found: {begin}
header-gap: data_offsets leaves a gap
  expected: start at {want}
  found: {begin}
file-truncated/header: file is truncated
  expected: {want} bytes
  found: {size} bytes
file-truncated/read: file ended while it was being read (changed during verify?)
  found: ended at byte {offset}
file-trailing-bytes: file has trailing bytes
  expected: {want} bytes
  found: {size} bytes
header-overflow/elements: element count overflows a usize (2^64 - 1)
  found: {dtype}{shape}
header-overflow/bits: size in bits overflows a usize (2^64 - 1)
  found: {dtype}{shape}
header-sub-byte: {count} elements of {dtype} do not fill whole bytes
  found: {dtype}{shape}
header-library-refuses/open: the safetensors library cannot open this file ({error})
header-library-refuses/reads-differently: the safetensors library reads this tensor differently from
    the strict reader
  expected: {ours!r}
  found: {theirs!r}
header-library-refuses/tensor: the safetensors library cannot read the {side}'s tensor ({error})

# -- the config
no-quantization-config/source: config has no quantization_config: this is not an MXFP4 checkpoint
no-quantization-config/output: config has no quantization_config
already-marked: config already carries the kimi_w31 markers: this checkpoint is converted already,
    or tampered with
  expected: no kimi_w31 block or wrapper
  found: {marks}
config-field/text-config: text_config must be an object (SGLang builds the text model from it)
  found: {kind}
config-field/top-level: config field {key} at the top level of a {model_type} config: SGLang takes
    it from text_config only and cannot load this config
  found: {value!r}
config-field/integer: config field {key} must be an integer >= {minimum}
  found: {value}
config-field/num-experts: config field {key} must be an integer >= {minimum} (without it SGLang
    builds no MoE layer)
  found: {value}
config-field/positive: config field {key} is missing or not a positive integer
  found: {value}
config-field/group: {key} is not a multiple of the MXFP4 group size {group}
  found: {value}
pinned-mismatch: config field {key} does not match manifest {manifest}
  expected: {want!r}
  found: {value!r}
situ-mismatch/hidden-act: config's hidden_act is not 'situ': the converted block would announce an
    activation the model does not use
  expected: 'situ'
  found: {act!r}
situ-mismatch/not-numeric: config has no numeric {key}
  expected: {want!r}
  found: {value!r}
situ-mismatch/value: {key} does not match manifest {manifest}
  expected: {want!r}
  found: {value!r}
config-conflict/alias: config fields {first} and {second} give one value two ways (SGLang reads
    both, in different places)
  expected: {first} = {first_value!r}
  found: {second} = {second_value!r}
config-conflict/top-level: config field {key} at the top level disagrees with what SGLang's Kimi-K3
    model reads (text_config.{key}, or its default); it never reads the top-level copy
  expected: {want!r}
  found: {value!r}
config-bound: config describes more routed experts than the checkpoint has tensors
  expected: {field} <= {bound}
  found: {value}

# -- routed experts and MoE layers
expert-name/source: tensor under an 'experts' component that is not a routed-expert tensor of the
    contract's grammar
  expected: {grammar}
  found: {tail!r}
expert-name/output: tensor under an 'experts' component is not a routed-expert tensor of the
    contract's grammar
  expected: experts.<id>.<w31|w2>.<weight_packed|weight_scale>
expert-id-range/expert: expert id out of range
  expected: < {experts}
  found: {expert}
expert-id-range/layer: expert ids beyond the config's num_experts
  expected: ids 0..{last}
  found: ids {ids}
expert-tensor-unexpected/source: {why}
  expected: {allowed}
  found: {key}
expert-tensor-unexpected/output: w1/w3 expert tensor left in a converted checkpoint (it must be
    fused into w31)
expert-dtype: wrong dtype
  expected: {want}
  found: {dtype}
expert-shape: wrong shape
  expected: {want}
  found: {shape}
expert-partner-missing/expert: expert tensor is missing (its partners exist)
expert-partner-missing/plan: w1/w3 half without its partner
expert-partner-missing/source-half: the source lacks a half of this w31 (w3 = up, w1 = gate)
  expected: both halves in the source
  found: {missing}
expert-outside-layer: routed experts outside a 'layers.<i>.' component: no layer would load them
layer-missing: {count} MoE layer(s) have no routed experts at all
  expected: experts in MoE layers {layers}
  found: none in layers {missing}
layer-incomplete: MoE layer is missing {count} of {experts} experts
  expected: ids 0..{last}
  found: missing {missing}
layer-unexpected: layer {layer} is not a MoE layer under the config's rule (num_hidden_layers,
    first_k_dense_replace, moe_layer_freq) but has routed experts
layer-duplicated: layer {layer} has routed experts under two prefixes
  expected: only {prefix}experts.*
no-experts/source: no routed-expert tensors found: not a Kimi-K3 MXFP4 checkpoint
  expected: experts.<id>.<w1|w2|w3>.<weight_packed|weight_scale> tensors in every MoE layer
no-experts/output: no routed-expert tensors under the contract's grammar: not a converted Kimi-K3
    MXFP4 checkpoint
  expected: experts.<id>.<w31|w2>.<weight_packed|weight_scale> in every MoE layer
inventory-missing: tensor the model loads is missing{where}
  expected: present (manifest {manifest})
inventory-dtype: {place} tensor is not stored unquantized: the model loads it with an unquantized
    method
  expected: {dtypes}
  found: {dtype}
inventory-shape: {place} tensor has another shape than the config gives it: SGLang would copy
    it into part of its parameter, or refuse it
  expected: {want}
  found: {shape}

# -- the output directory and the run
output-not-directory/exists: output path exists and is not a directory
output-not-directory/folder: a folder of the output path is not a directory
  expected: a directory
  found: {kind}
output-not-directory/absent: output path does not exist
output-not-directory/not-directory: output path is not a directory
output-not-empty/convert: output directory is not empty and is not a resumable run of this
    conversion
output-not-empty/convert-owned: output directory is not empty and is not a resumable run of this
    conversion: it holds the conversion of {owner}
output-not-empty/synth: synth writes into an empty or new directory
  hint: choose another directory or remove this one first
foreign-output/force: --force only removes files kimi-convert's own records (its ledger, journal or
    checksums file in this directory) say it wrote, unchanged since; these are not: {files}
  hint: move them out or choose another output directory; nothing was deleted
foreign-output/finalize: file in the output directory that this conversion did not write; the output
    is not finalized while it is there
output-locked/take: could not take the output lock
output-locked/busy: another conversion is writing this output directory ({who}); wait for it, or
    remove {lock} if you are sure it is gone
state-lost: the state folder {state} was removed or replaced during the run: there is no longer a
    record of what this run wrote
  expected: the state folder this run made
  found: {kind}
  hint: find what removed it, then rerun: files kimi-convert cannot prove it wrote are never deleted
    (choose an empty directory if it refuses)
no-space/output: not enough free space for the output
  expected: {need} free
  found: {free} free
  hint: free space or choose another output directory (--dry-run checks this before a run)
no-space/downloads: not enough free space for the downloads and the output
  expected: {need} free
  found: {free} free
  hint: pass --delete-source-shards and a smaller --max-source-window, or free space; --dry-run
    shows the peak
no-space/device: no space left on the device (or file size limit reached)
  found: {error}
io-error: I/O error: {error}
source-changed/copy: source file changed while it was being copied
source-changed/read: source file {change}
scale-nan/tensor: {count} E8M0 scale byte(s) are 0xFF (NaN); first at byte {first} of the tensor
  expected: no 0xFF scale bytes
  found: {count}
scale-nan/source: {count} E8M0 scale byte(s) are 0xFF (NaN); first at byte {first} of the tensor
    (byte {at} of the file; it was being copied into {output})
  expected: no 0xFF scale bytes
  found: {count}
scale-nan/numerics: {count} E8M0 scale byte(s) are 0xFF (NaN) in the {side}; first at byte {first}
    of the tensor
window-too-small: --max-source-window is too small for this checkpoint's layout
  expected: at least {need}
  found: {window}
  hint: rerun with --max-source-window {need}: downloaded in the order the output needs them, that
    many source shards must be present at once (--dry-run shows it before any download)
output-header-too-large: planned shard header exceeds the safetensors limit
  expected: <= {limit}
  found: {length}
state-folder-invalid/state: the state folder {state}/ is not a directory kimi-convert made
  expected: a directory, or nothing
  found: {kind}
  hint: move or remove {file} yourself (it is not this tool's to delete), then rerun; nothing was
    changed
state-folder-invalid/lock: the lock file is not a regular file kimi-convert made
  expected: a regular file, or nothing
  found: {kind}
  hint: remove {file} yourself if no conversion is running; nothing was changed
permission-denied/folder: no permission to write here
  expected: a directory this user may write in
  hint: make it writable for this user, or choose another output directory
permission-denied/write: no permission: {error}
output-of-another-source: output directory holds the conversion of another source: {owner}
  hint: a rerun continues only the conversion of the same source; pass --force to replace it (only
    files kimi-convert recorded writing are removed), or choose another directory
file-name-invalid: file name {why}: the output could not be published or verified with it
  expected: a plain name (UTF-8, no control characters or backslashes)
  found: {file!r}

# -- a converted checkpoint (verify, serve)
incomplete-output/no-index: no index: the conversion is incomplete (the index is written last) or
    this is not a converted checkpoint
  expected: a complete conversion
  found: no index
incomplete-output/running: no index: the conversion is incomplete (the index is written last) or
    this is not a converted checkpoint
  expected: a complete conversion
  found: a conversion in progress or interrupted ({state}/ is there): rerun kimi-convert to finish
    it
block-missing: config has no 'kimi_w31' block: not a converted checkpoint
block-field/not-object: 'kimi_w31' must be an object
  expected: an object
  found: {kind}
block-field/format-version: kimi_w31.format_version is not one this tool knows (a newer converter
    wrote it: upgrade kimi-w31)
  expected: {known}
  found: {value!r}
block-field/value: kimi_w31.{key} is wrong
  expected: {want!r}
  found: {value!r}
block-field/positive: kimi_w31.{key} is not a positive number
  expected: a positive finite number
  found: {value!r}
block-field/source-files: kimi_w31.source.files is not an object
block-mismatch/activation: kimi_w31.activation is 'situ' but the model config's hidden_act is not
  expected: 'situ'
  found: {act!r}
block-mismatch/config: kimi_w31.{key} disagrees with the model config's {config_key}
  expected: {want!r}
  found: {value!r}
block-mismatch/manifest: kimi_w31.{key} disagrees with manifest {manifest}
  expected: {want!r}
  found: {value!r}
block-mismatch/dims: kimi_w31.dims do not match the dimensions of the source config
  expected: {want}
  found: {value}
block-mismatch/manifest-hash: kimi_w31.manifest_sha256 is not the hash of manifest {manifest} (pass
    --manifest with the one the conversion used)
  expected: {want}
  found: {value}
not-wrapped/no-base: quantization_config with quant_method '{method}' must hold the original config
    under 'base' (an object with a 'quant_method')
  found: {base!r}
not-wrapped/twice: quantization_config is wrapped twice in '{method}'
not-wrapped/not-wrapped: quantization_config is not wrapped: a loader without the adapter would not
    refuse it
  expected: {method!r}
  found: {value!r}
checksums-invalid/missing: the checksums file is missing: the output cannot be proven intact without
    the source
checksums-invalid/not-file: the checksums file is not a regular file
checksums-invalid/not-json: the checksums file is not readable JSON ({error})
checksums-invalid/not-object: the checksums file is not a JSON object
checksums-invalid/format: unknown checksums file format
  found: {value!r}
checksums-invalid/algorithm: unknown tensor checksum algorithm
  found: {value!r}
checksums-invalid/no-files: the checksums file has no 'files' object
checksums-invalid/name: recorded file name {why}; it is not opened
  found: {name!r}
checksums-invalid/record: malformed record
  found: {record}
checksums-invalid/no-shard-record: shard has no checksum record
checksums-invalid/no-tensor-record: tensor has no recorded checksum
checksums-invalid/tensor-not-in-shard: recorded tensor is not in the shard
file-size-mismatch/file: file size differs from the conversion record
  expected: {want}
  found: {size}
file-size-mismatch/shard: shard size differs from the conversion record
  expected: {want}
  found: {size}
header-hash-mismatch: shard header differs from the conversion record (sha256)
checksum-mismatch/file: file differs from the conversion record (sha256)
checksum-mismatch/tensor: tensor bytes differ from the conversion record (CRC-32): corrupt
  expected: {want}
  found: {crc}
file-unrecorded: file in the output that the checksums file does not record: the conversion did not
    write it
tensor-not-from-source: tensor has no counterpart in the source
tensor-missing: tensor the source requires is not in the output
bytes-differ/tensor: tensor bytes differ from the source
  found: first difference at byte {pos}
bytes-differ/file: file differs from the source
  found: first difference at byte {pos}
bytes-differ/file-size: file differs from the source (size)
  expected: {want}
  found: {size}
w31-not-up-gate: w31 is not concat([w3, w1]) of the source ([up; gate])
  expected: w3 bytes then w1 bytes
  found: first difference at byte {pos}, in the {half} half
config-differs/beyond-block: config.json differs from the source config beyond the kimi_w31 block
    and the wrapped quantization_config
  found: differs at {keys}
config-differs/unwrap: the quantization_config wrapper cannot be undone ({error})
source-changed-since/shard: source shard is not the one the output was converted from (the source
    changed since, or this is another source): not output corruption
  expected: {then}
  found: {now}
source-changed-since/tensor: tensor differs from the source, whose shard changed since the
    conversion
  found: first difference at byte {pos}
numerics-differ: the converted expert computes a different function than the source expert
  expected: relative max error <= {rtol:g}
  found: {rel_error:.3g} (cosine {cosine:.6f})
numerics-unavailable/no-expert: no expert is complete in both the output and the source (see the
    checks above)
numerics-unavailable/fc1-order: kimi_w31.fc1_order does not name 'up' and 'gate' once each
  found: {order!r}
numerics-unavailable/situ: the {side} side has no numeric {key}
  found: {value!r}
numerics-unavailable/expert: cannot compute this expert ({error})
numerics-self-test: the MXFP4/SiTU reference fails a known answer: {case}
tensor-dtype-differs: dtype differs from the source
  expected: {want}
  found: {dtype}
tensor-shape-differs/source-halves: the source's w3 and w1 shapes differ: no w31 can be formed
  expected: {want}
  found: {shape}
tensor-shape-differs/shape: shape differs from the source
  expected: {want}
  found: {shape}
file-not-from-source: file in the output that the conversion of this source would not write

# -- what is served is what was verified (the adapter, at load)
not-verified/never: checkpoint was never verified with --checksums on this filesystem
  hint: run `kimi-convert verify {root} --checksums` on this node (or once on a shared
    filesystem), or set {env}=1 to serve it unverified
not-verified/no-checksums: checkpoint was verified, but not with --checksums
  found: levels {levels}
  hint: run `kimi-convert verify {root} --checksums`, or set {env}=1 to serve it unverified
not-verified/not-local: model path is not a local directory: a converted checkpoint is served from
    a verified local copy
  found: {root}
  hint: download it, run `kimi-convert verify DIR --checksums` and serve DIR, or set {env}=1
verified-files-changed/changed: file changed since the last passing `verify --checksums` (size,
    mtime, ctime, inode or device)
  expected: {want}
  found: {identity}
  hint: run `kimi-convert verify {root} --checksums` again (a copy needs its own verify), or set
    {env}=1 to serve it unverified
verified-files-changed/added: file added since the last passing `verify --checksums`
  hint: run `kimi-convert verify {root} --checksums` again, or set {env}=1 to serve it unverified
verified-files-changed/removed: file removed since the last passing `verify --checksums`
  hint: run `kimi-convert verify {root} --checksums` again, or set {env}=1 to serve it unverified
name-collision: two tensor names reach the same model parameter under SGLang's name mapping (the
    one loaded last would win)
  expected: one of {first!r} and {second!r}
  found: both, as {key!r}

# -- a prebuilt kernel bundle (adapter: kimi-convert prebuild --out, KIMI_W31_KERNELS)
kernel-bundle-invalid/unreadable: no readable manifest ({error})
kernel-bundle-invalid/not-manifest: not a kernel bundle manifest ({error})
kernel-bundle-arch: the bundle was built for another GPU architecture
  expected: {running}
  found: {built}
kernel-bundle-flashinfer: the bundle was built for another FlashInfer version
  expected: {running}
  found: {built}
kernel-bundle-cuda: the bundle was built for another CUDA version
  expected: {running}
  found: {built}
kernel-bundle-torch: the bundle was built for another torch version
  expected: {running}
  found: {built}
kernel-bundle-python: the bundle was built for another Python version
  expected: {running}
  found: {built}
kernel-bundle-no-module: the bundle has no {variant} module (it has: {have}); build it with
    `kimi-convert prebuild --precision {variant}`
kernel-bundle-sources: {module} was built from other sources or flags than this FlashInfer and
    plugin would compile
  expected: {want}
  found: {built}
kernel-bundle-library: the library is missing or not the one the manifest records
  expected: {want}
  found: {digest}
kernel-bundle-missing/missing: no kernel bundle here
kernel-bundle-missing/not-directory: not a directory ({kind}): a kernel bundle is a directory
kernel-bundle-link: a link in the bundle (-> {target}): a bundle holds its own files only, so
    what is checked is what is loaded
kernel-bundle-not-regular: not a regular file ({kind}): a bundle's manifest and libraries are
    plain files
kernel-bundle-owner: owned by uid {uid}, neither this user ({me}) nor root: another user could
    change the native code every serving process loads
kernel-bundle-writable: writable by group or others (mode {mode}): anyone who can write it can
    change the native code every serving process loads
  hint: chmod go-w the bundle directory and its files
kernel-bundle-too-large: larger than a bundle's {what} can be ({size} bytes, at most {limit})
kernel-bundle-cpu: the bundle was built for another CPU architecture
  expected: {running}
  found: {built}
kernel-bundle-libc: the bundle was built against another or a newer C library
  expected: {running}
  found: {built}
kernel-bundle-python-abi: the bundle was built for another Python ABI
  expected: {running}
  found: {built}
kernel-bundle-busy: another prebuild is publishing into this bundle ({who}); it did not finish
    within {seconds} s
"""


def _parse_catalog(text: str) -> dict[Code, Message | dict[str, Message]]:
    """{code: message} or {code: {rule: message}}; refuses an unknown code or field, and a
    key given twice."""
    entries: dict[str, dict[str, str]] = {}
    entry: dict[str, str] = {}
    field_name = "what"
    for line in text.splitlines():
        if not line.strip() or line.startswith("#"):
            continue
        if line.startswith("    "):  # continues the field before
            entry[field_name] += " " + line.strip()
            continue
        head, _, rest = line.strip().partition(": ")
        if line.startswith("  "):
            field_name = head
            if field_name not in ("expected", "found", "hint") or field_name in entry:
                raise ValueError(f"catalog: bad line {line!r}")
        else:
            if head in entries:
                raise ValueError(f"catalog: {head} twice")
            entry = entries[head] = {}
            field_name = "what"
        entry[field_name] = rest
    table: dict[Code, Message | dict[str, Message]] = {}
    for key, fields in entries.items():
        value, _, rule = key.partition("/")
        m = Message(**fields)
        if rule:
            variants = table.setdefault(Code(value), {})
            if not isinstance(variants, dict):
                raise ValueError(f"catalog: {key} has rules and a plain message")
            variants[rule] = m
        else:
            if Code(value) in table:
                raise ValueError(f"catalog: {key} has rules and a plain message")
            table[Code(value)] = m
    return table


MESSAGES = _parse_catalog(_CATALOG)

# The fields of a Problem: a template may name them, and they are never facts to check.
WHERE = frozenset({"file", "tensor", "expected", "found"})


def message(code: Code, rule: str | None = None) -> Message:
    """The message of `code` (in the situation `rule`, where the code has several)."""
    entry = MESSAGES[code]
    if isinstance(entry, Message):
        if rule is not None:
            raise KeyError(f"{code.value} has one message: no rule {rule!r}")
        return entry
    if rule not in entry:
        raise KeyError(f"{code.value}: rule {rule!r} is not one of {sorted(entry)}")
    return entry[rule]


def rules(code: Code) -> list[str | None]:
    """The situations `code` has messages for ([None]: one message)."""
    entry = MESSAGES[code]
    return [None] if isinstance(entry, Message) else list(entry)


def _names(template: str | None) -> set[str]:
    if template is None:
        return set()
    return {
        name.split(".")[0].split("[")[0]
        for _, name, _, _ in string.Formatter().parse(template)
        if name
    }


def facts_of(code: Code, rule: str | None = None) -> frozenset[str]:
    """The facts a call site must pass for this message (beyond file/tensor)."""
    m = message(code, rule)
    names = set().union(*(_names(t) for t in (m.what, m.expected, m.found, m.hint)))
    return frozenset(names - {"file", "tensor"})


class _Facts(dict):
    # A fact a call site failed to pass shows as its name rather than losing the problem
    # to a KeyError on the error path; tests/test_messages.py holds every call site to the
    # facts its message names.
    def __missing__(self, key: str) -> str:
        return "{" + key + "}"


def _render(template: str | None, facts: _Facts) -> str | None:
    return None if template is None else template.format_map(facts)


def _text(value: object) -> str | None:
    return None if value is None else str(value)


def problem(
    code: Code,
    *,
    rule: str | None = None,
    file: object = None,
    tensor: str | None = None,
    expected: object = None,
    found: object = None,
    **facts: object,
) -> Problem:
    """The Problem for `code` with these facts: its words come from the code's message.
    `expected`/`found` given here are facts of their own, for a message without templates
    for them."""
    m = message(code, rule)
    values = _Facts(facts, file=_text(file), tensor=tensor)
    values.update(expected=_text(expected), found=_text(found))
    return Problem(
        code,
        _render(m.what, values) or "",
        file=_text(file),
        tensor=tensor,
        expected=_render(m.expected, values) if m.expected is not None else _text(expected),
        found=_render(m.found, values) if m.found is not None else _text(found),
    )


def fatal(code: Code, *, hint: str | None = None, **facts: object) -> Fatal:
    """A single-problem error for `code` with these facts; its hint is the message's unless
    the call site has one only it can word (what a rerun would keep, say)."""
    p = problem(code, **facts)
    m = message(code, facts.get("rule"))  # type: ignore[arg-type]
    if hint is None and m.hint is not None:
        values = _Facts(facts, file=p.file, tensor=p.tensor)
        hint = m.hint.format_map(values)
    return Fatal([p], hint=hint)


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
    Code.HUB_TIMEOUT: EXIT_PROBLEMS,
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
    Code.INVENTORY_SHAPE: EXIT_PROBLEMS,
    Code.STATE_FOLDER_INVALID: EXIT_PROBLEMS,
    Code.PERMISSION_DENIED: EXIT_PROBLEMS,
    Code.OUTPUT_OF_ANOTHER_SOURCE: EXIT_PROBLEMS,
    Code.FILE_NAME_INVALID: EXIT_PROBLEMS,
    Code.PATH_UNUSABLE: EXIT_USAGE,
    Code.CONFIG_CONFLICT: EXIT_PROBLEMS,
    Code.CONFIG_BOUND: EXIT_PROBLEMS,
    Code.SHARD_NOT_LOADED: EXIT_PROBLEMS,
    Code.TENSOR_IN_TWO_SHARDS: EXIT_PROBLEMS,
    Code.TENSOR_DTYPE_DIFFERS: EXIT_PROBLEMS,
    Code.TENSOR_SHAPE_DIFFERS: EXIT_PROBLEMS,
    Code.FILE_NOT_FROM_SOURCE: EXIT_PROBLEMS,
    Code.NOT_VERIFIED: EXIT_PROBLEMS,
    Code.VERIFIED_FILES_CHANGED: EXIT_PROBLEMS,
    Code.NAME_COLLISION: EXIT_PROBLEMS,
    # a kernel bundle that does not match the serving stack: the data is wrong for here
    **dict.fromkeys(
        (
            Code.KERNEL_BUNDLE_INVALID,
            Code.KERNEL_BUNDLE_ARCH,
            Code.KERNEL_BUNDLE_FLASHINFER,
            Code.KERNEL_BUNDLE_CUDA,
            Code.KERNEL_BUNDLE_TORCH,
            Code.KERNEL_BUNDLE_PYTHON,
            Code.KERNEL_BUNDLE_NO_MODULE,
            Code.KERNEL_BUNDLE_SOURCES,
            Code.KERNEL_BUNDLE_LIBRARY,
            Code.KERNEL_BUNDLE_MISSING,
            Code.KERNEL_BUNDLE_LINK,
            Code.KERNEL_BUNDLE_NOT_REGULAR,
            Code.KERNEL_BUNDLE_OWNER,
            Code.KERNEL_BUNDLE_WRITABLE,
            Code.KERNEL_BUNDLE_TOO_LARGE,
            Code.KERNEL_BUNDLE_CPU,
            Code.KERNEL_BUNDLE_LIBC,
            Code.KERNEL_BUNDLE_PYTHON_ABI,
            Code.KERNEL_BUNDLE_BUSY,
        ),
        EXIT_PROBLEMS,
    ),
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
    # A layer's experts under two spellings, or a w1/w3 left beside its w31: the names
    # that reach one parameter follow from it.
    Code.LAYER_DUPLICATED: frozenset({Code.NO_EXPERTS, Code.NAME_COLLISION}),
    Code.EXPERT_TENSOR_UNEXPECTED: frozenset({Code.NO_EXPERTS, Code.NAME_COLLISION}),
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
