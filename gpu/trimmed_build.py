"""Trimmed builds of FlashInfer's SM90 CUTLASS fused-MoE module: bf16 x MXFP4 (W4A16), and
separately FP8 x MXFP4 ("Humming" W4A8).

FlashInfer JIT-compiles its SM90 fused-MoE module on first use: 248 sources, one to two
hours on 16 cores. The SiTU path we validate needs only one runner,
`CutlassMoeFCRunner<__nv_bfloat16, Fp4Type>`, and its 23 generated
`<__nv_bfloat16, SafeFP4>` mixed-input grouped-GEMM kernel files. This module builds exactly
that, through FlashInfer's own `gen_jit_spec` with the flags FlashInfer itself computes for
the stock module (we intercept the stock spec's construction and change only its name and
source list), so the kernels are compiled from the same sources with the same nvcc flags.

Two files are derived from FlashInfer's sources rather than used verbatim, because they
name every runner type: the explicit-instantiation file keeps only the bf16 x FP4 runner
(and the finalize-routing instantiations), and the binding's runner constructor keeps only
the W4A16 branch (any other dtype combination fails with FlashInfer's own "Could not
construct fused moe op" check). Both are written next to the originals so their relative
includes resolve unchanged.

The W4A8 variant (`--variant w4a8`, module `fused_moe_90_kimi_w31_w4a8_humming`) is built
the same way from the 49 generated `<__nv_fp8_e4m3, SafeFP4>` kernel files,
`moe_gemm_kernels_fp8_fp4.cu`, the two Humming runners the binding's output-type switch
names, and the binding's `use_wfp4afp8_humming` branch. It is a separate module so that the
W4A16 module (and its prebuilt library) stays exactly as it was.

`install()` makes `flashinfer.fused_moe` use a trimmed module (call it before the first
fused-MoE call in the process); `python -m gpu.trimmed_build --build [--variant w4a8]`
compiles one.
"""

from __future__ import annotations

import argparse
import functools
import re
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

MODULE_NAME = "fused_moe_90_kimi_w31_w4a16"
MIXED_KERNEL_MARKER = "__nv_bfloat16, SafeFP4"
KEEP_GEMM_SOURCE = "moe_gemm_kernels_bf16_fp4.cu"
BINDING = "flashinfer_cutlass_fused_moe_binding.cu"
INSTANTIATION = "cutlass_fused_moe_instantiation.cu"
TRIMMED_PREFIX = "kimi_w31_trimmed_"

# The binding's constructor picks a runner per dtype combination between these two lines.
_CTOR_START = "    // keep consistent with cpp/tensorrt_llm/plugins/mixtureOfExperts"
_CTOR_END = "    if (!mKernelRunner) {"
_CTOR_TRIMMED = """    // Trimmed build: only the SM90 MXFP4 W4A16 runner (bf16 x FP4 weights) is
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

_INSTANTIATION_TRIMMED = """// Trimmed build: only the runner the SM90 MXFP4 W4A16 MoE needs.
#include "cutlass_fused_moe_kernels.cuh"
#include "moe_kernels.h"

namespace tensorrt_llm::kernels::cutlass_kernels {
#if defined(ENABLE_FP4) && defined(ENABLE_BF16)
template class CutlassMoeFCRunner<__nv_bfloat16, Fp4Type>;
#endif
"""


# SM90 W4A8 "Humming" (FP8 activations quantized online x MXFP4 weights with pre-MMA E8M0
# scale folding): the binding's branch for `use_wfp4afp8_humming=True`, verbatim in effect.
_CTOR_TRIMMED_W4A8 = """    // Trimmed build: only the SM90 MXFP4 x FP8 Humming runner
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

_INSTANTIATION_TRIMMED_W4A8 = """// Trimmed build: only the SM90 MXFP4 x FP8 Humming runners
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


@dataclass(frozen=True)
class Variant:
    """One trimmed module: its name, the kernels it keeps and its two derived files."""

    key: str
    module_name: str
    kernel_marker: str  # generated grouped-GEMM files instantiating this dtype pair
    gemm_source: str  # the one moe_gemm_kernels_<act>_<weight>.cu kept
    ctor: str
    instantiation_head: str
    required_runner: str  # must appear in the stock instantiation file
    derived_prefix: str


W4A16 = Variant(
    key="w4a16",
    module_name=MODULE_NAME,
    kernel_marker=MIXED_KERNEL_MARKER,
    gemm_source=KEEP_GEMM_SOURCE,
    ctor=_CTOR_TRIMMED,
    instantiation_head=_INSTANTIATION_TRIMMED,
    required_runner="CutlassMoeFCRunner<__nv_bfloat16, Fp4Type>",
    derived_prefix=TRIMMED_PREFIX,
)
W4A8_HUMMING = Variant(
    key="w4a8",
    module_name="fused_moe_90_kimi_w31_w4a8_humming",
    kernel_marker="__nv_fp8_e4m3, SafeFP4",
    gemm_source="moe_gemm_kernels_fp8_fp4.cu",
    ctor=_CTOR_TRIMMED_W4A8,
    instantiation_head=_INSTANTIATION_TRIMMED_W4A8,
    required_runner="Sm90Wfp4Afp8ScaleMode::kHummingPreMmaE8M0>;",
    derived_prefix=TRIMMED_PREFIX + "w4a8_",
)
VARIANTS = {v.key: v for v in (W4A16, W4A8_HUMMING)}


def trim_binding(text: str, variant: Variant = W4A16) -> str:
    """Keep only the variant's branch of the binding's runner constructor."""
    start = text.find(_CTOR_START)
    end = text.find(_CTOR_END, start)
    if start < 0 or end < 0:
        raise ValueError("binding layout changed: runner constructor markers not found")
    if text.find(_CTOR_START, start + 1) >= 0:
        raise ValueError("binding layout changed: constructor marker found twice")
    return text[:start] + variant.ctor + text[end:]


def trim_instantiation(text: str, variant: Variant = W4A16) -> str:
    """Keep the variant's runners and every finalize-routing instantiation of the original."""
    finalize = re.findall(
        r"^(?:#ifdef ENABLE_BF16\n)?INSTANTIATE_FINALIZE_MOE_ROUTING\(.*?\);\n"
        r"(?:#endif\n)?",
        text,
        flags=re.M,
    )
    if not finalize or variant.required_runner not in text:
        raise ValueError("instantiation layout changed: expected instantiations not found")
    return variant.instantiation_head + "".join(finalize) + "}  // namespace\n"


def _m_tile(path: Path) -> int:
    match = re.search(r"_M(\d+)_", path.name)
    return int(match.group(1)) if match else 0


def select_generated(
    paths: Sequence[Path], read=Path.read_text, variant: Variant = W4A16
) -> list[Path]:
    """The generated SM90 grouped-GEMM files that instantiate bf16 x SafeFP4 kernels.

    Sorted largest M tile first: those units compile longest (~15 min for M256 on the
    reference machine), and ninja starts edges in manifest order, so they must start first.
    """
    picked = [
        p
        for p in paths
        if p.name.endswith(".generated.cu")
        and p.parent.name == "90"
        and p.parent.parent.name == "gemm_grouped"
        and variant.kernel_marker in read(p)
    ]
    return sorted(picked, key=lambda p: (-_m_tile(p), p.name))


def trimmed_sources(
    stock: Sequence[Path],
    generated: Sequence[Path],
    binding: Path,
    instantiation: Path,
    variant: Variant = W4A16,
) -> list[Path]:
    """The stock source list with every other dtype's GEMM file and kernel file dropped.

    Order: selected generated kernels (big M first), then the patched instantiation and
    binding (the next-slowest units), then the stock non-kernel sources in stock order.
    """
    rest: list[Path] = []
    for p in stock:
        if p.name.endswith(".generated.cu"):
            continue  # replaced by `generated`
        if p.name.startswith("moe_gemm_kernels_") and p.name != variant.gemm_source:
            continue
        if p.name in (BINDING, INSTANTIATION):
            continue
        rest.append(p)
    missing = {BINDING, INSTANTIATION} - {p.name for p in stock}
    if missing or variant.gemm_source not in {p.name for p in rest}:
        raise ValueError(f"stock source list changed: missing {sorted(missing)} / gemm file")
    return [*generated, instantiation, binding, *rest]


def _write_if_changed(path: Path, text: str) -> None:
    # Keep mtimes stable so ninja does not rebuild an unchanged unit.
    if not path.exists() or path.read_text() != text:
        path.write_text(text)


@functools.cache
def trimmed_spec(variant: Variant = W4A16) -> Any:
    """FlashInfer's JitSpec for a trimmed module (flags from FlashInfer's own SM90 recipe)."""
    from flashinfer.jit import fused_moe as fm

    captured: dict[str, Any] = {}
    real_gen_jit_spec = fm.gen_jit_spec

    def capture(name: str, sources: Sequence[Any], **kwargs: Any) -> Any:
        captured.update(name=name, sources=[Path(s) for s in sources], kwargs=kwargs)
        return None

    # Let FlashInfer compute its stock SM90 recipe (this also generates the kernel files),
    # but stop it at gen_jit_spec so nothing registers or builds.
    fm.gen_jit_spec = capture
    try:
        fm.gen_cutlass_fused_moe_sm90_module(False)
    finally:
        fm.gen_jit_spec = real_gen_jit_spec
    stock_name = str(captured.get("name"))
    if not stock_name.startswith("fused_moe_90"):
        raise RuntimeError(f"unexpected stock SM90 module {stock_name!r}")
    stock: list[Path] = captured["sources"]

    backend_dir = next(p.parent for p in stock if p.name == BINDING)
    binding = backend_dir / f"{variant.derived_prefix}{BINDING}"
    instantiation = backend_dir / f"{variant.derived_prefix}{INSTANTIATION}"
    _write_if_changed(binding, trim_binding((backend_dir / BINDING).read_text(), variant))
    _write_if_changed(
        instantiation, trim_instantiation((backend_dir / INSTANTIATION).read_text(), variant)
    )
    generated = select_generated(
        [p for p in stock if p.name.endswith(".generated.cu")], variant=variant
    )
    sources = trimmed_sources(stock, generated, binding, instantiation, variant)
    # A variant of the stock module (e.g. FlashInfer's H20 prebuilt-descriptor flavour)
    # keeps its suffix, so differently flagged builds never share a cache directory.
    name = variant.module_name + stock_name[len("fused_moe_90") :]
    return real_gen_jit_spec(name, sources, **captured["kwargs"])


class _Prebuilt:
    """A spec stand-in that loads an already built library instead of running ninja."""

    def __init__(self, spec: Any, library: Path) -> None:
        self.spec, self.library = spec, library

    def build_and_load(self) -> Any:
        return self.spec.load(self.library)


def install(prebuilt: Path | None = None, variant: Variant = W4A16) -> None:
    """Route FlashInfer's SM90 fused-MoE module lookup to the trimmed module.

    `get_cutlass_fused_moe_module` (which `cutlass_fused_moe` and the SM90 weight
    interleave both call) looks `gen_cutlass_fused_moe_sm90_module` up as a module global
    at call time and caches the loaded module, so this must run before the first call.
    With `prebuilt`, that library (built by `--build` on another machine with the same
    FlashInfer and CUDA) is loaded as is and nothing is compiled. One variant per process:
    FlashInfer caches one SM90 module.
    """
    from flashinfer.fused_moe import core

    def gen(use_fast_build: bool = False) -> Any:
        spec = trimmed_spec(variant)
        return _Prebuilt(spec, prebuilt) if prebuilt is not None else spec

    core.gen_cutlass_fused_moe_sm90_module = gen
    core.get_cutlass_fused_moe_module.cache_clear()


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--list", action="store_true", help="print the sources and flags")
    parser.add_argument("--build", action="store_true", help="compile and load the module")
    parser.add_argument(
        "--variant",
        choices=sorted(VARIANTS),
        default=W4A16.key,
        help="w4a16: bf16 x MXFP4 (default); w4a8: FP8 (Humming) x MXFP4",
    )
    args = parser.parse_args(argv)
    variant = VARIANTS[args.variant]
    spec = trimmed_spec(variant)
    if args.list or not args.build:
        for s in spec.sources:
            print(s)
        print(f"{len(spec.sources)} sources")
        print("cuda flags:", " ".join(map(str, spec.extra_cuda_cflags)))
        print("build dir:", spec.build_dir)
    if args.build:
        t0 = time.time()
        print(f"building {variant.module_name} ...", flush=True)
        spec.build_and_load()
        lib = spec.get_library_path()
        print(f"built {lib} ({lib.stat().st_size / 1e6:.1f} MB) in {time.time() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
