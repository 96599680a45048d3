"""The plugin's own FlashInfer kernels: one JIT module per serving path, holding exactly the
runner that path calls.

FlashInfer's SM90 fused-MoE module (`fused_moe_90`) compiles every runner of its CUTLASS
MoE: 248 translation units, about 55 minutes on 16 cores. The plugin calls one of them per
serving path:

- `w4a16` (SM90): `CutlassMoeFCRunner<__nv_bfloat16, Fp4Type>` and the
  `<__nv_bfloat16, SafeFP4>` grouped GEMMs of Kimi-K3's measured tactic set
  (`KIMI_K3_W4A16`); `w4a16-all` the same runner with every tactic FlashInfer lists;
- `w4a8` (SM90, `--flashinfer-mxfp4-moe-precision fp8`): the two Humming runners (FP8 x
  MXFP4, pre-MMA E8M0) and the `<__nv_fp8_e4m3, SafeFP4>` grouped GEMMs;
- `sm120`: FlashInfer's whole SM120 module, not trimmed (no SM120 machine has validated a
  subset), built and bundled the same way.

Each module is built through FlashInfer's own `gen_jit_spec` with the flags FlashInfer
computes for its stock module: we let FlashInfer's generator run, stop it at
`gen_jit_spec` (nothing registers or builds), and keep its name suffix, flags, include paths
and link flags, changing only the source list (plus the stock binding's folder on the
include path). Two files are derived from FlashInfer's sources because they name every
runner type (the explicit-instantiation file and the binding's runner constructor).

The generated grouped-GEMM files are split: each holds eight explicit instantiations, and
one (M256) unit alone took 876 s. `partition_generated` cuts a file into parts of bounded
estimated cost (several instantiations per `.cu`, see `part_path`), and `Recipe.sources`
lists the costliest units first, because ninja starts edges in manifest order on a cold
build. Every derived file is written to the plugin's own cache (`derived_root`), never into
FlashInfer's package folder (read-only on some installs, shared by every process).

`install(variant, library)` makes `flashinfer.fused_moe` use one of these modules (an
already built library, or the JIT spec); `ensure(arch, humming)` is what the adapter calls
before its first FlashInfer MoE call: the bundle named by `KIMI_W31_KERNELS` when set
(checked against the running stack, see `bundle.py`), else the JIT spec in FlashInfer's
cache. Only the fused-MoE generator of the served architecture is redirected; the rest of
FlashInfer is untouched.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from .arch import CUDA_ARCH_LIST, Arch, arch_name

ENV_BUNDLE = "KIMI_W31_KERNELS"

BINDING = "flashinfer_cutlass_fused_moe_binding.cu"
INSTANTIATION = "cutlass_fused_moe_instantiation.cu"
TRIMMED_PREFIX = "kimi_w31_trimmed_"
SPLIT_TAG = "kimi_w31_part"

# The binding's constructor picks a runner per dtype combination between these two lines.
_CTOR_START = "    // keep consistent with cpp/tensorrt_llm/plugins/mixtureOfExperts"
_CTOR_END = "    if (!mKernelRunner) {"

_CTOR_W4A16 = """    // Trimmed build: only the SM90 MXFP4 W4A16 runner (bf16 x FP4 weights) is
    // compiled; every other combination falls through to the check below.
#if defined(ENABLE_FP4) && defined(ENABLE_BF16)
    if (isWFP4A16Quant()) {
      TVM_FFI_ICHECK_EQ(mActivationDtype, dl_bfloat16)
          << "SM90 MXFP4 W4A16 supports BF16 activations only";
      mInnerDimMultiplier = 2;
      mKernelRunner =
          std::make_shared<kernels::CutlassMoeFCRunner<__nv_bfloat16, kernels::Fp4Type>>();
    }
#endif
"""

_INSTANTIATION_W4A16 = """// Trimmed build: only the runner the SM90 MXFP4 W4A16 MoE needs.
#include "cutlass_fused_moe_kernels.cuh"
#include "moe_kernels.h"

namespace tensorrt_llm::kernels::cutlass_kernels {
#if defined(ENABLE_FP4) && defined(ENABLE_BF16)
template class CutlassMoeFCRunner<__nv_bfloat16, Fp4Type>;
#endif
"""

# SM90 W4A8 "Humming" (FP8 activations quantized online x MXFP4 weights with pre-MMA E8M0
# scale folding): the binding's branch for `use_wfp4afp8_humming=True`, verbatim in effect.
_CTOR_W4A8 = """    // Trimmed build: only the SM90 MXFP4 x FP8 Humming runner
    // (online FP8 activation quant); every other combination falls through to the check below.
#ifdef ENABLE_FP4
    if (isWMxfp4AFp8HummingQuant()) {
      TVM_FFI_ICHECK_EQ(common::getSMVersion(), 90)
          << "Humming-style MXFP4 x FP8 is only supported on SM90.";
      mInnerDimMultiplier = 2;
      mSm90Wfp4Afp8Mode = kernels::Sm90Wfp4Afp8ScaleMode::kHummingPreMmaE8M0;
      TVM_FFI_ICHECK(mActivationDtype == dl_float16 || mActivationDtype == dl_bfloat16)
          << "Humming-style MXFP4 x FP8 requires FP16/BF16 inputs and online FP8 activation "
             "quantization.";
      TVM_FFI_ICHECK(mActivationDtype == mOutputDtype)
          << "Humming-style MXFP4 x FP8 online activation quantization currently requires "
             "activation dtype and output dtype to match.";
      mKernelRunner =
          switch_output_type<__nv_fp8_e4m3, kernels::Fp4Type, true, false,
                             kernels::Sm90Wfp4Afp8ScaleMode::kHummingPreMmaE8M0>(mOutputDtype);
    }
#endif
"""

_INSTANTIATION_W4A8 = """// Trimmed build: only the SM90 MXFP4 x FP8 Humming runners
// (both output types the binding's switch_output_type names).
#include "cutlass_fused_moe_kernels.cuh"
#include "moe_kernels.h"

namespace tensorrt_llm::kernels::cutlass_kernels {
#ifdef ENABLE_FP4
template class CutlassMoeFCRunner<__nv_fp8_e4m3, Fp4Type, half, half, half, false,
                                  Sm90Wfp4Afp8ScaleMode::kHummingPreMmaE8M0>;
#ifdef ENABLE_BF16
template class CutlassMoeFCRunner<__nv_fp8_e4m3, Fp4Type, __nv_bfloat16, __nv_bfloat16,
                                  __nv_bfloat16, false, Sm90Wfp4Afp8ScaleMode::kHummingPreMmaE8M0>;
#endif
#endif
"""


SPLIT_DIR = "kimi_w31_split"  # where split parts go (see `part_path`)
Shape3 = tuple[int, int, int]
Launcher = tuple[Shape3, Shape3]  # (CTA tile M x N x K, cluster shape)

# The launchers Kimi-K3's W4A16 serving needs, as (tile, cluster) with their index in
# FlashInfer 0.7.2's SM90 candidate list (tile-major, clusters 1x1x1, 2x1x1, 1x2x1, 2x2x1).
# Measured on an H200 (`python -m gpu.tactics --variant w4a16`, results in
# gpu/results/2026-12-01-h200-tactics/): every valid tactic of both GEMMs timed in the whole
# forward at per-rank shapes TP 1, 2, 8 x M 1..8192; the fewest launchers keeping every case
# within 1 % of its best (9), plus the full set's best of the one case whose forward
# re-check came out over 2 % (72); and the launcher FlashInfer sizes its workspace with
# (`calcMaxWorkspaceSizeTmaWarpSpecializedMixedInput`: 128x64x256, 1x1x1). Config 0 is the
# runner's default tactic. 11 of the 116 launchers of the full set.
KIMI_K3_W4A16: frozenset[Launcher] = frozenset(
    {
        ((64, 16, 128), (1, 1, 1)),  # 0: the default tactic
        ((64, 64, 128), (2, 1, 1)),  # 25
        ((128, 16, 128), (1, 1, 1)),  # 48
        ((128, 16, 256), (2, 1, 1)),  # 53
        ((128, 16, 512), (1, 1, 1)),  # 56
        ((128, 16, 512), (2, 1, 1)),  # 57
        ((128, 32, 128), (1, 1, 1)),  # 60
        ((128, 32, 256), (1, 1, 1)),  # 64
        ((128, 64, 128), (1, 1, 1)),  # 72
        ((128, 64, 128), (2, 1, 1)),  # 73
        ((128, 64, 256), (1, 1, 1)),  # 76: workspace sizing
    }
)


@dataclass(frozen=True)
class Trim:
    """What a trimmed module keeps of FlashInfer's stock source list."""

    kernel_marker: str  # generated grouped-GEMM files instantiating this dtype pair
    gemm_source: str  # the one moe_gemm_kernels_<act>_<weight>.cu kept
    ctor: str
    instantiation_head: str
    required_runner: str  # must appear in the stock instantiation file
    derived_prefix: str
    # (tile, cluster) of the launchers compiled; None: every launcher a tactic can select
    launchers: frozenset[Launcher] | None = None
    split_dir: str = SPLIT_DIR  # one tree per launcher set: their parts differ


@dataclass(frozen=True)
class Variant:
    """One serving path's module."""

    key: str
    arch: Arch
    module_name: str  # FlashInfer's stock name prefix is replaced by this
    stock_prefix: str  # e.g. "fused_moe_90"; a suffix after it (FlashInfer's flavour) is kept
    generator: str  # FlashInfer's generator, in flashinfer.jit.fused_moe and fused_moe.core
    trim: Trim | None  # None: FlashInfer's stock module as is

    @property
    def derived_prefix(self) -> str:
        return self.trim.derived_prefix if self.trim else ""


def _sm90(
    key: str,
    module_name: str,
    *,
    activation: str,
    act: str,
    ctor: str,
    head: str,
    runner: str,
    prefix: str,
    launchers: frozenset[Launcher] | None = None,
) -> Variant:
    """An SM90 serving path: FlashInfer's SM90 generator, its stock module trimmed to the
    runner of one activation type (`activation`, `act` in file names) with FP4 weights."""
    return Variant(
        key=key,
        arch="sm90",
        module_name=module_name,
        stock_prefix="fused_moe_90",
        generator="gen_cutlass_fused_moe_sm90_module",
        trim=Trim(
            kernel_marker=f"{activation}, SafeFP4",
            gemm_source=f"moe_gemm_kernels_{act}_fp4.cu",
            ctor=ctor,
            instantiation_head=head,
            required_runner=runner,
            derived_prefix=prefix,
            launchers=launchers,
        ),
    )


W4A16 = _sm90(
    "w4a16",
    "fused_moe_90_kimi_w31_w4a16",
    activation="__nv_bfloat16",
    act="bf16",
    ctor=_CTOR_W4A16,
    head=_INSTANTIATION_W4A16,
    runner="CutlassMoeFCRunner<__nv_bfloat16, Fp4Type>",
    prefix=TRIMMED_PREFIX,
    launchers=KIMI_K3_W4A16,
)
# The same runner with every launcher a tactic can select: its own module name, derived
# files and split tree, so the two never share a cache entry, a bundle entry or a part.
W4A16_ALL = replace(
    W4A16,
    key="w4a16-all",
    module_name="fused_moe_90_kimi_w31_w4a16_all",
    trim=replace(
        W4A16.trim,  # type: ignore[arg-type]
        launchers=None,
        derived_prefix=TRIMMED_PREFIX + "all_",
        split_dir="kimi_w31_split_all",
    ),
)
W4A8_HUMMING = _sm90(
    "w4a8",
    "fused_moe_90_kimi_w31_w4a8_humming",
    activation="__nv_fp8_e4m3",
    act="fp8",
    ctor=_CTOR_W4A8,
    head=_INSTANTIATION_W4A8,
    runner="Sm90Wfp4Afp8ScaleMode::kHummingPreMmaE8M0>;",
    prefix=TRIMMED_PREFIX + "w4a8_",
)
SM120 = Variant(
    key="sm120",
    arch="sm120",
    module_name="fused_moe_120",
    stock_prefix="fused_moe_120",
    generator="gen_cutlass_fused_moe_sm120_module",
    trim=None,
)
VARIANTS = {v.key: v for v in (W4A16, W4A16_ALL, W4A8_HUMMING, SM120)}
DEFAULT_VARIANTS: dict[str, tuple[str, ...]] = {"sm90": ("w4a16",), "sm120": ("sm120",)}
# "all": serve SM90 W4A16 with every tactic FlashInfer lists (module `w4a16-all`), e.g. for
# shapes far from Kimi-K3's, instead of the measured Kimi-K3 set
ENV_TACTICS = "KIMI_W31_TACTICS"
TACTIC_SETS = ("kimi-k3", "all")


def variant_for(arch: Arch, humming: bool = False, tactics: str = "kimi-k3") -> Variant:
    """The module a serving path needs (SM90 W4A8 only with `humming`; W4A16 with the
    Kimi-K3 tactic set unless `tactics` is "all")."""
    if tactics not in TACTIC_SETS:
        raise ValueError(f"{ENV_TACTICS}={tactics!r}: expected one of {', '.join(TACTIC_SETS)}")
    if arch == "sm90":
        if humming:
            return W4A8_HUMMING
        return W4A16_ALL if tactics == "all" else W4A16
    if arch == "sm120":
        return SM120
    raise ValueError(f"unsupported arch {arch!r}: expected 'sm90' or 'sm120'")


# --------------------------------------------------------------------------------------
# The two derived sources
# --------------------------------------------------------------------------------------


def trim_binding(text: str, trim: Trim) -> str:
    """Keep only the trim's branch of the binding's runner constructor."""
    start = text.find(_CTOR_START)
    end = text.find(_CTOR_END, start)
    if start < 0 or end < 0:
        raise ValueError("binding layout changed: runner constructor markers not found")
    if text.find(_CTOR_START, start + 1) >= 0:
        raise ValueError("binding layout changed: constructor marker found twice")
    return text[:start] + trim.ctor + text[end:]


def trim_instantiation(text: str, trim: Trim) -> str:
    """Keep the trim's runners and every finalize-routing instantiation of the original."""
    finalize = re.findall(
        r"^(?:#ifdef ENABLE_BF16\n)?INSTANTIATE_FINALIZE_MOE_ROUTING\(.*?\);\n"
        r"(?:#endif\n)?",
        text,
        flags=re.M,
    )
    if not finalize or trim.required_runner not in text:
        raise ValueError("instantiation layout changed: expected instantiations not found")
    return trim.instantiation_head + "".join(finalize) + "}  // namespace\n"


# --------------------------------------------------------------------------------------
# Splitting the generated grouped-GEMM files
# --------------------------------------------------------------------------------------

# One explicit instantiation: `template void launcher<...>(...);` (no `;` inside).
_INSTANCE = re.compile(r"^template\s[^;]*;[ \t]*\n?", re.M)
_HEAD_LINE = re.compile(r"^\s*(#\s*include\b.*|namespace\s+[\w:]+\s*\{?|\{|//.*)?\s*$")
_TAIL_LINE = re.compile(r"^\s*(\}\s*(//.*)?|//.*)?\s*$")
_TILE = re.compile(r"cute::Shape<cute::Int<(\d+)>,\s*cute::Int<(\d+)>,\s*cute::Int<(\d+)>>")
# The compile cost model, in units of ~11 s of one nvcc among 16 on a 16-core H200 machine,
# fitted to ninja's per-unit times of a cold W4A16 build there (45 kernel units, rms error
# ~35 s): a kernel unit costs ~110 s whatever it holds (CUTLASS headers, host pass), plus
# ~11 s per instantiation, plus ~10.5 s per 128^3 of CTA tile volume (the K depth of the
# tile counts: a file of eight M128xN16xK512 kernels took 287 s, one M256xN256xK128 ~200 s).
UNIT_OVERHEAD = 10.0
_TILE_VOLUME = 128**3
# A part of at most this cost (~330 s) never dominates a build whose units sum to ~800 of
# them on 16 cores; fewer parts than that bound cost an overhead each.
DEFAULT_MAX_PART_WEIGHT = 30.0


def instance_weight(instance: str) -> float:
    """Estimated compile cost of one instantiation (see UNIT_OVERHEAD); 2.0 if unknown."""
    tile = _TILE.search(instance)
    if tile is None:
        return 2.0
    m, n, k = (int(x) for x in tile.groups())
    return 1.0 + m * n * k / _TILE_VOLUME


@dataclass(frozen=True)
class Part:
    text: str
    instances: int
    weight: float  # estimated cost of the unit, UNIT_OVERHEAD included


def _balanced(weights: Sequence[float], cap: float) -> list[int]:
    """Chunk sizes cutting `weights` (in order) into the fewest contiguous chunks of at most
    `cap` each, as even as the order allows (a single heavier item is a chunk of its own)."""
    total = sum(weights)
    count = max(1, -(-total // cap)) if cap > 0 else len(weights)
    target = total / count
    sizes: list[int] = []
    acc, size = 0.0, 0
    for w in weights:
        if size and acc + w > target + 1e-9 and len(sizes) < count - 1:
            sizes.append(size)
            acc, size = 0.0, 0
        acc += w
        size += 1
    sizes.append(size)
    # Balancing may leave a chunk over the cap, or (a heavy item late) cut more chunks than
    # filling up to the cap would: then plain first-fit by the cap, which is the fewest.
    fit: list[int] = []
    acc = 0.0
    for w in weights:
        if not fit or acc + w > cap + 1e-9:
            fit.append(0)
            acc = 0.0
        fit[-1] += 1
        acc += w
    chunks, i = [], 0
    for n in sizes:
        chunks.append(weights[i : i + n])
        i += n
    if len(sizes) > len(fit) or any(len(c) > 1 and sum(c) > cap + 1e-9 for c in chunks):
        sizes = fit
    return sizes


def _layout(text: str) -> tuple[str, list[re.Match[str]], str] | None:
    """(head, instantiations, tail) of a generated kernel file, or None when its layout is
    not the one we know: instantiations separated by blank lines only, a head and a tail of
    includes, namespace braces and comments only (they are repeated in every part we write:
    a definition there would be linked once per part)."""
    found = list(_INSTANCE.finditer(text))
    if not found:
        return None
    head, tail = text[: found[0].start()], text[found[-1].end() :]
    between = (text[a.end() : b.start()] for a, b in zip(found, found[1:], strict=False))
    if (
        any(gap.strip() for gap in between)
        or not all(_HEAD_LINE.match(line) for line in head.splitlines())
        or not all(_TAIL_LINE.match(line) for line in tail.splitlines())
    ):
        return None
    return head, found, tail


def partition_generated(text: str, max_weight: float = DEFAULT_MAX_PART_WEIGHT) -> list[Part]:
    """Cut one generated kernel file into the fewest parts of estimated cost at most
    `max_weight` each (UNIT_OVERHEAD included; a single heavier instantiation is a part of
    its own), in file order; each part keeps the file's head (includes, namespace openings)
    and tail (namespace closings). A file of unknown layout (`_layout`) is returned whole
    (one part): it is compiled as FlashInfer wrote it.
    """
    found = list(_INSTANCE.finditer(text))
    weights = [instance_weight(m.group(0)) for m in found]
    layout = _layout(text)
    if layout is None:
        return [Part(text, len(found), UNIT_OVERHEAD + sum(weights))]
    head, _, tail = layout
    parts, i = [], 0
    for n in _balanced(weights, max_weight - UNIT_OVERHEAD):
        chunk = [m.group(0).rstrip("\n") + "\n" for m in found[i : i + n]]
        parts.append(
            Part(head + "\n".join(chunk) + tail, n, UNIT_OVERHEAD + sum(weights[i : i + n]))
        )
        i += n
    return parts


# --------------------------------------------------------------------------------------
# Pruning: only the launchers a tactic can select
# --------------------------------------------------------------------------------------

# FlashInfer's SM90 candidate list (`get_candidate_configs_sm90`, weight-only grouped) gives
# each CTA tile ONE mainloop schedule: cooperative where `sm90_supports_coop` holds, else
# ping-pong, with every cluster shape. FlashInfer's generator instantiates both schedules
# for every tile of M >= 128, so 68 of the 184 launchers per dtype pair and output type can
# never be selected by any tactic. The served output type is bf16 (Kimi-K3's activations):
# the W4A8 runner's f16-output launchers are never called either.
SERVED_OUTPUT = "__nv_bfloat16"
_SCHEDULE = re.compile(r"cutlass::gemm::KernelTmaWarpSpecialized(Cooperative|Pingpong)\b")
_SMALL_K = "sm90_generic_mixed_moe_small_k_kernelLauncher"
_LAUNCHER = re.compile(r"^template\s+void\s+(\w+)<([^;]*?)>\s*\(([^;]*)\);", re.S)


def cooperative_tile(m: int, n: int, k: int) -> bool:
    """`sm90_supports_coop` of FlashInfer 0.7.2: the tiles the candidate list schedules
    cooperatively (all others ping-pong)."""
    if m == 128 and n in (16, 32, 64):
        return k in (128, 256, 512)
    if (m == 128 and n in (128, 256)) or (m == 256 and n == 128):
        return k in (128, 256)
    return m == 256 and n == 256 and k == 128


def selectable(instance: str, trim: Trim) -> bool:
    """Whether a tactic of the served runner can call this launcher. What we cannot read
    (no tile, no schedule) counts as selectable: it is compiled as FlashInfer wrote it."""
    text = " ".join(instance.split())
    if trim.kernel_marker in text and f"{trim.kernel_marker}, {SERVED_OUTPUT}" not in text:
        return False  # another output type of the served dtype pair
    if _SMALL_K in instance:
        return True  # Humming's small-K configs: every tile and schedule is a candidate
    shapes, schedule = _TILE.findall(instance), _SCHEDULE.search(instance)
    if len(shapes) < 2 or schedule is None:
        return True
    tile, cluster = (tuple(int(x) for x in shape) for shape in shapes[:2])
    if (schedule.group(1) == "Cooperative") != cooperative_tile(*tile):
        return False
    return trim.launchers is None or (tile, cluster) in trim.launchers


def prune_generated(text: str, trim: Trim) -> tuple[str, list[str]]:
    """(the file with only its selectable launchers, "" if none; the launchers left out).
    A file of unknown layout (`_layout`) is kept whole."""
    layout = _layout(text)
    if layout is None:
        return text, []
    head, found, tail = layout
    kept = [m.group(0) for m in found if selectable(m.group(0), trim)]
    left = [m.group(0) for m in found if not selectable(m.group(0), trim)]
    if not left:
        return text, []
    if not kept:
        return "", left
    return head + "\n".join(k.rstrip("\n") + "\n" for k in kept) + tail, left


_LAUNCHER_HEADER = "tensorrt_llm/kernels/cutlass_kernels/moe_gemm/launchers/"
_UNBUILT_HEAD = """// Launchers FlashInfer's generator instantiates but no tactic of this module can
// select (kimi_w31 adapter/kernels.py, `selectable`). Defined here to refuse, without
// compiling their kernels: the module links, and a call that never should fails clearly.
#include "LAUNCHERS/moe_gemm_tma_ws_mixed_input_launcher.h"
#include "cutlass/epilogue/dispatch_policy.hpp"
#include "cutlass/gemm/dispatch_policy.hpp"
#include "cutlass_extensions/epilogue_helpers.h"
#include "tensorrt_llm/common/assert.h"

namespace tensorrt_llm {
namespace kernels {
namespace cutlass_kernels_oss {
using namespace tensorrt_llm::kernels::cutlass_kernels;
#ifdef ENABLE_FP4
using SafeFP4 = Fp4Type;
#else
struct SafeFP4 {};
#endif
""".replace("LAUNCHERS/", _LAUNCHER_HEADER)
_UNBUILT_TAIL = (
    "}  // namespace cutlass_kernels_oss\n}  // namespace kernels\n}  // namespace tensorrt_llm\n"
)


def unbuilt_definitions(instances: Sequence[str]) -> str:
    """One translation unit defining each left-out launcher as an explicit specialization
    that throws (same symbol as the instantiation it replaces)."""
    bodies = []
    for text in instances:
        match = _LAUNCHER.match(text.strip())
        if match is None:
            raise ValueError(f"not a launcher instantiation: {text[:80]!r}")
        name, args, params = match.groups()
        bodies.append(
            f"template <>\nvoid {name}<{args}>(\n{params}) {{\n"
            f'  TLLM_THROW("kimi_w31: this CUTLASS MoE launcher is not built into the '
            f"plugin's module (outside its tactic set)\");\n}}\n"
        )
    return _UNBUILT_HEAD + "\n".join(bodies) + _UNBUILT_TAIL


def part_path(
    path: Path, index: int, count: int, split_dir: str = SPLIT_DIR, root: Path | None = None
) -> Path:
    """Where part `index` (1-based) of a generated kernel file goes.

    Not beside it: FlashInfer's generator deletes every file of its output directory
    (`cutlass_instantiations/<arch>`) it did not generate itself, each time any process
    builds the spec, which would make ninja recompile our parts in every new process. So a
    tree of our own, `<root>/kimi_w31_split/<arch>/gemm_grouped/90/<file>.kimi_w31_partIofN.cu`
    (the parts' only include is include-path relative; the last two folder names are kept:
    FlashInfer names objects after the source's folder), under a name FlashInfer's
    `*.generated.cu` glob never matches. `root`: the plugin's cache (`derived_root`);
    without it, FlashInfer's generated-source directory.
    """
    if len(path.parents) < 5:
        raise ValueError(f"{path}: not a generated kernel file path (<gen>/x/<arch>/a/b/file)")
    stem = path.name.removesuffix(".generated.cu")
    base = root if root is not None else path.parents[4]
    where = base / split_dir / path.parents[2].name / path.parents[1].name
    return where / path.parent.name / f"{stem}.{SPLIT_TAG}{index}of{count}.cu"


# --------------------------------------------------------------------------------------
# The recipe: sources in build order, derived texts, FlashInfer's flags
# --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Unit:
    path: Path
    weight: float  # estimated compile cost, for ordering
    text: str | None = None  # derived (written by us); None: FlashInfer's file as is


@dataclass(frozen=True)
class Recipe:
    variant: Variant
    name: str
    units: tuple[Unit, ...]  # build order: costliest first
    kwargs: dict[str, Any] = field(default_factory=dict)  # FlashInfer's gen_jit_spec kwargs

    @property
    def sources(self) -> list[Path]:
        return [u.path for u in self.units]


# Estimated cost (same units) of FlashInfer's own sources, from the same build; the rest
# take seconds.
_FIXED_COST = {
    INSTANTIATION: 10.0,  # the runner's explicit instantiation (113 s)
    "fp8_blockscale_gemm.cu": 10.0,  # 113 s
    BINDING: 7.0,  # 77 s
    "moe_gemm_tma_warp_specialized_input.cu": 4.0,  # 40 s
}
_GEMM_SOURCE_COST = 5.0  # moe_gemm_kernels_<act>_<weight>.cu (59 s)
UNBUILT_COST = 8.0  # CUTLASS headers parsed, no kernel instantiated (estimate)


def fixed_cost(path: Path, trim: Trim) -> float:
    name = path.name.removeprefix(trim.derived_prefix)
    if name == trim.gemm_source:
        return _GEMM_SOURCE_COST
    return _FIXED_COST.get(name, 1.0 if path.suffix == ".cu" else 0.5)


def _m_tile(path: Path) -> int:
    match = re.search(r"_M(\d+)_", path.name)
    return int(match.group(1)) if match else 0


def select_generated(
    paths: Sequence[Path], read: Callable[[Path], str] = Path.read_text, trim: Trim = W4A16.trim
) -> list[Path]:  # type: ignore[assignment]
    """The generated SM90 grouped-GEMM files that instantiate the trim's dtype pair,
    largest M tile first."""
    picked = [
        p
        for p in paths
        if p.name.endswith(".generated.cu")
        and p.parent.name == "90"
        and p.parent.parent.name == "gemm_grouped"
        and trim.kernel_marker in read(p)
    ]
    return sorted(picked, key=lambda p: (-_m_tile(p), p.name))


def trimmed_sources(
    stock: Sequence[Path],
    generated: Sequence[Path],
    binding: Path,
    instantiation: Path,
    trim: Trim = W4A16.trim,  # type: ignore[assignment]
) -> list[Path]:
    """The stock source list with every other dtype's GEMM file and kernel file dropped.

    Order: selected generated kernels, then the derived instantiation and binding, then the
    stock non-kernel sources in stock order (`recipe` reorders by estimated cost).
    """
    rest: list[Path] = []
    for p in stock:
        if p.name.endswith(".generated.cu"):
            continue  # replaced by `generated`
        if p.name.startswith("moe_gemm_kernels_") and p.name != trim.gemm_source:
            continue
        if p.name in (BINDING, INSTANTIATION):
            continue
        rest.append(p)
    missing = {BINDING, INSTANTIATION} - {p.name for p in stock}
    if missing or trim.gemm_source not in {p.name for p in rest}:
        raise ValueError(f"stock source list changed: missing {sorted(missing)} / gemm file")
    return [*generated, instantiation, binding, *rest]


def order_units(units: Iterable[Unit]) -> tuple[Unit, ...]:
    """Costliest first (stable among equals), so the longest units start at once."""
    return tuple(sorted(units, key=lambda u: -u.weight))


def build_units(
    stock: Sequence[Path],
    trim: Trim,
    *,
    read: Callable[[Path], str] = Path.read_text,
    split: bool = True,
    prune: bool = True,
    max_weight: float = DEFAULT_MAX_PART_WEIGHT,
    derived: Path | None = None,
) -> list[Unit]:
    """The trimmed module's units from FlashInfer's stock source list (pure but for `read`):
    with `prune`, only the launchers a tactic can select are compiled (`selectable`), the
    others defined to refuse in one light unit (`unbuilt_definitions`). Every derived file
    is placed under `derived` (the plugin's cache, `derived_root`; the binding's folder name
    kept, FlashInfer names objects after it); without it, beside FlashInfer's files."""
    backend = next((p.parent for p in stock if p.name == BINDING), None)
    if backend is None:
        raise ValueError(f"stock source list changed: no {BINDING}")
    beside = derived / backend.name if derived is not None else backend
    binding = beside / f"{trim.derived_prefix}{BINDING}"
    instantiation = beside / f"{trim.derived_prefix}{INSTANTIATION}"
    generated = select_generated([p for p in stock if p.name.endswith(".generated.cu")], read, trim)
    if not generated:
        raise ValueError(f"no generated kernel file instantiates <{trim.kernel_marker}>")
    ordered = trimmed_sources(stock, generated, binding, instantiation, trim)
    units: list[Unit] = []
    unbuilt: list[str] = []
    for path in ordered:
        if path == binding:
            text = trim_binding(read(backend / BINDING), trim)
            units.append(Unit(path, fixed_cost(path, trim), text))
        elif path == instantiation:
            text = trim_instantiation(read(backend / INSTANTIATION), trim)
            units.append(Unit(path, fixed_cost(path, trim), text))
        elif path in generated:
            text = read(path)
            kept, left = prune_generated(text, trim) if prune else (text, [])
            unbuilt += left
            if not kept:
                continue
            parts = partition_generated(kept, max_weight if split else float("inf"))
            if len(parts) == 1 and kept == text:
                units.append(Unit(path, parts[0].weight))
            else:
                units += [
                    Unit(part_path(path, i, len(parts), trim.split_dir, derived), p.weight, p.text)
                    for i, p in enumerate(parts, 1)
                ]
        else:
            units.append(Unit(path, fixed_cost(path, trim)))
    if unbuilt:
        split = part_path(generated[0], 1, 1, trim.split_dir, derived).parent
        where = split / f"{trim.derived_prefix}unbuilt_launchers.cu"
        units.append(Unit(where, UNBUILT_COST, unbuilt_definitions(unbuilt)))
    return units


def stock_recipe(generator: str) -> tuple[str, list[Path], dict[str, Any]]:
    """Run FlashInfer's generator (it also writes its generated kernel files) but stop it at
    `gen_jit_spec`: (module name, sources, keyword arguments), nothing registered or built."""
    from flashinfer.jit import fused_moe as fm

    captured: dict[str, Any] = {}
    real = fm.gen_jit_spec

    def capture(name: str, sources: Sequence[Any], **kwargs: Any) -> None:
        captured.update(name=name, sources=[Path(s) for s in sources], kwargs=kwargs)

    fm.gen_jit_spec = capture
    try:
        getattr(fm, generator)(False)
    finally:
        fm.gen_jit_spec = real
    if "name" not in captured:
        raise RuntimeError(f"flashinfer's {generator} did not call gen_jit_spec")
    return str(captured["name"]), captured["sources"], captured["kwargs"]


def recipe(
    variant: Variant,
    *,
    split: bool = True,
    prune: bool = True,
    max_weight: float = DEFAULT_MAX_PART_WEIGHT,
) -> Recipe:
    """The variant's module recipe from the installed FlashInfer (no GPU, no file written
    but FlashInfer's own generated kernel files)."""
    stock_name, stock, kwargs = stock_recipe(variant.generator)
    if not stock_name.startswith(variant.stock_prefix):
        raise RuntimeError(f"unexpected stock module {stock_name!r} from {variant.generator}")
    # A flavour of the stock module (e.g. FlashInfer's H20 prebuilt-descriptor one) keeps its
    # suffix, so differently flagged builds never share a cache directory or a bundle entry.
    name = variant.module_name + stock_name[len(variant.stock_prefix) :]
    if variant.trim is None:
        return Recipe(variant, name, tuple(Unit(p, 0.0) for p in stock), kwargs)
    units = build_units(
        stock,
        variant.trim,
        split=split,
        prune=prune,
        max_weight=max_weight,
        derived=derived_root(),
    )
    # The derived binding and instantiation include their stock siblings by relative path
    # ("cutlass_fused_moe_kernels.cuh", "../../tvm_ffi_utils.h"): resolved from the stock
    # folder on the include path, as they were beside it.
    backend = next(p.parent for p in stock if p.name == BINDING)
    include = [*(kwargs.get("extra_include_paths") or []), backend]
    kwargs = {**kwargs, "extra_include_paths": include}
    return Recipe(variant, name, order_units(units), kwargs)


ENV_CACHE = "XDG_CACHE_HOME"


def derived_root(environ: Mapping[str, str] = os.environ) -> Path:
    """Where the plugin writes the sources it derives (trimmed binding and instantiation,
    split kernel parts): its own cache, `$XDG_CACHE_HOME/kimi-w31/flashinfer/<version>/<arch>`
    (`~/.cache` without the variable), per FlashInfer version and target as FlashInfer's own
    generated sources are. Never FlashInfer's package folder: it may be read-only, and is
    shared by every user and process of that installation."""
    from flashinfer.jit import env as jit_env

    gen = Path(jit_env.FLASHINFER_GEN_SRC_DIR)  # <workspace>/flashinfer/<version>/<arch>/generated
    base = Path(environ.get(ENV_CACHE) or Path.home() / ".cache")
    return base / "kimi-w31" / "flashinfer" / gen.parent.parent.name / gen.parent.name


def _write_if_changed(path: Path, text: str) -> None:
    # Keep mtimes stable so ninja does not rebuild an unchanged unit.
    if not path.exists() or path.read_text() != text:
        path.write_text(text)


def jit_spec(rec: Recipe, *, write: bool = True) -> Any:
    """FlashInfer's JitSpec for the recipe; `write` puts the derived files in place first."""
    from flashinfer.jit import gen_jit_spec

    if write:
        for unit in rec.units:
            if unit.text is not None:
                unit.path.parent.mkdir(parents=True, exist_ok=True)
                _write_if_changed(unit.path, unit.text)
    return gen_jit_spec(rec.name, rec.sources, **rec.kwargs)


# nvcc's own thread count changes how fast it compiles, not what it emits.
_NEUTRAL_FLAG = re.compile(r"^--threads(=\d+)?$|^-t\d+$")


def _relative(path: Path, roots: Sequence[Path]) -> str:
    for i, root in enumerate(roots):
        try:
            return f"<{i}>/{path.resolve().relative_to(root.resolve()).as_posix()}"
        except ValueError:
            continue
    return path.as_posix()


def source_hash(rec: Recipe, spec: Any, roots: Sequence[Path] | None = None) -> str:
    """sha256 over the module's name, every source's content (derived texts as generated)
    and the compiler and linker flags, machine paths made relative to FlashInfer's source and
    generated-source directories and the plugin's derived-source cache: equal on every
    machine with the same FlashInfer, CUDA flags and plugin recipe."""
    if roots is None:
        from flashinfer.jit import env as jit_env

        roots = [
            Path(jit_env.FLASHINFER_CSRC_DIR),
            Path(jit_env.FLASHINFER_GEN_SRC_DIR),
            derived_root(),
        ]
    h = hashlib.sha256()
    h.update(rec.name.encode() + b"\0")
    for unit in rec.units:
        data = unit.text.encode() if unit.text is not None else unit.path.read_bytes()
        h.update(_relative(unit.path, roots).encode() + b"\0")
        h.update(hashlib.sha256(data).digest())
    flags = {
        "cflags": list(spec.extra_cflags or []),
        "cuda_cflags": [f for f in spec.extra_cuda_cflags or [] if not _NEUTRAL_FLAG.match(f)],
        "ldflags": list(spec.extra_ldflags or []),
        "include": [_relative(Path(p), roots) for p in spec.extra_include_dirs or []],
    }
    h.update(json.dumps(flags, sort_keys=True).encode())
    return h.hexdigest()


# --------------------------------------------------------------------------------------
# Loading: route FlashInfer's fused-MoE module lookup to the plugin's module
# --------------------------------------------------------------------------------------


class _Library:
    """A spec stand-in that loads an already built library instead of running ninja: a
    bundle's (`bundle.Library`, loaded from the descriptor it was hashed from) or a file."""

    def __init__(self, library: Path | Any) -> None:
        self.library = library

    def build_and_load(self) -> Any:
        import tvm_ffi

        if isinstance(self.library, Path):
            return tvm_ffi.load_module(str(self.library))
        with self.library.loadable() as path:
            return tvm_ffi.load_module(path)


# arch -> (variant key, library or None) installed in this process
_installed: dict[str, tuple[str, Any]] = {}


def install(variant: Variant, library: Path | Any = None) -> None:
    """Route FlashInfer's fused-MoE module for `variant.arch` to the variant's module.

    `get_cutlass_fused_moe_module` (which `cutlass_fused_moe` and the weight interleaves
    call) looks its generator up as a module global at call time and caches the loaded
    module, so this must run before the first call. With `library`, that file (a bundle's,
    or one built by `prebuild` with the same FlashInfer and CUDA) is loaded as is and
    nothing is compiled. One module per architecture per process: FlashInfer caches one,
    and installing another variant later re-routes the next lookup to it.
    """
    from flashinfer.fused_moe import core

    def gen(use_fast_build: bool = False) -> Any:
        if library is not None:
            return _Library(library)
        return jit_spec(recipe(variant))

    setattr(core, variant.generator, gen)
    core.get_cutlass_fused_moe_module.cache_clear()
    _installed[variant.arch] = (variant.key, library)


def ensure(arch: Arch, humming: bool = False) -> Variant:
    """Before the adapter's first FlashInfer MoE call in a process: use the plugin's module,
    from the bundle `$KIMI_W31_KERNELS` names (refused unless it matches this stack: raises
    `bundle.BundleError`), else built into FlashInfer's JIT cache on first use. Idempotent;
    an explicit `install` made earlier in the process (the GPU harness) is kept."""
    variant = variant_for(arch, humming, os.environ.get(ENV_TACTICS, "").strip() or "kimi-k3")
    current = _installed.get(arch)
    if current is not None and current[0] == variant.key:
        return variant
    library = None
    where = os.environ.get(ENV_BUNDLE, "").strip()
    if where:
        library = bundle_library(Path(where), variant)
    install(variant, library)
    return variant


# Set to 1: check a bundle's recipe by running FlashInfer's generator and hashing every
# source at start-up, even when its recorded recipe key matches (see `recipe_key`).
ENV_FULL_CHECK = "KIMI_W31_KERNELS_FULL_CHECK"
# The variables FlashInfer's JIT spec reads for a module's compiler flags.
_FLAG_ENV = ("FLASHINFER_JIT_DEBUG", "FLASHINFER_JIT_VERBOSE", "FLASHINFER_JIT_LINEINFO")
_ARCH_LIST_ENV = "FLASHINFER_CUDA_ARCH_LIST"
_DEFAULT_ARCH_LIST = CUDA_ARCH_LIST  # prebuild's, and what the GPU picks


def _flashinfer_files() -> str | None:
    """FlashInfer's installed files as its distribution records them (path, sha256, size
    of each: the C++/CUDA sources and the Python generator alike); None when the
    installation keeps no record (an editable install)."""
    from importlib import metadata

    try:
        return metadata.distribution("flashinfer-python").read_text("RECORD")
    except metadata.PackageNotFoundError:
        return None


def recipe_key(variant: Variant, cuda: str, environ: Mapping[str, str] = os.environ) -> str | None:
    """A digest of everything the variant's recipe (`recipe`, `source_hash`) is made from,
    computed without running FlashInfer's generator: this module's code (the trims, the
    launcher sets, the split rule), FlashInfer's installed files, the CUDA version and the
    environment that changes FlashInfer's flags. Equal keys give equal recipes; a key that
    differs only means the recipe must be regenerated to tell. None: not computable here."""
    record = _flashinfer_files()
    if record is None:
        return None
    arch_list = environ.get(_ARCH_LIST_ENV, "").strip()
    if arch_list == _DEFAULT_ARCH_LIST.get(variant.arch):
        arch_list = ""  # what a GPU of this arch picks by itself: the same flags
    h = hashlib.sha256()
    for part in (
        variant.key,
        variant.module_name,
        variant.arch,
        cuda,
        arch_list,
        json.dumps({k: environ.get(k) for k in _FLAG_ENV}, sort_keys=True),
    ):
        h.update(part.encode() + b"\0")
    h.update(hashlib.sha256(Path(__file__).read_bytes()).digest())
    h.update(hashlib.sha256(record.encode()).digest())
    return h.hexdigest()


def regenerated_source_hash(variant: Variant) -> str:
    """The full check: FlashInfer's generator run, the recipe derived, every source hashed."""
    rec = recipe(variant)
    return source_hash(rec, jit_spec(rec, write=False))


def full_check(environ: Mapping[str, str] = os.environ) -> bool:
    return environ.get(ENV_FULL_CHECK, "").strip() not in ("", "0")


def bundle_library(root: Path, variant: Variant) -> Any:
    """What the plugin loads for `variant` from the bundle at `root` (a `bundle.Library`,
    held open): the running stack, then `bundle.check` with the recipe key computed here and
    the full regeneration as the fallback (always, with KIMI_W31_KERNELS_FULL_CHECK=1).
    Raises BundleError."""
    from . import bundle

    running = bundle.current_stack(variant.arch)
    key = None if full_check() else recipe_key(variant, running.cuda)
    regenerate = lambda: regenerated_source_hash(variant)  # noqa: E731  only on a key miss
    return bundle.check(root, variant.key, running, regenerate, key)[1]


def preflight_bundle(environ: Mapping[str, str] = os.environ) -> None:
    """The bundle `KIMI_W31_KERNELS` names, checked before any weight loads: there, safe to
    read and built for this stack (the GPU compared where this process has CUDA up
    already: the plugin never starts CUDA in a launcher). No variable: nothing to check.
    Raises BundleError."""
    where = environ.get(ENV_BUNDLE, "").strip()
    if not where:
        return
    from . import bundle

    bundle.preflight(Path(where), bundle.current_stack(_gpu_arch_if_up()))


def _gpu_arch_if_up() -> str:
    """The GPU's serving arch if CUDA is initialized in this process, else "" (unknown)."""
    import torch

    if not torch.cuda.is_initialized():
        return ""
    return arch_name(*torch.cuda.get_device_capability())
