"""The GPU harness's handle on the plugin's own FlashInfer modules (`adapter/kernels.py`).

The harness builds and loads exactly what the product does: the per-serving-path module
(SM90 W4A16: `CutlassMoeFCRunner<__nv_bfloat16, Fp4Type>`; `--variant w4a8`: the FP8 x
MXFP4 "Humming" runners) from FlashInfer's own `gen_jit_spec`, sources and flags, with the
heavy generated units split. This file only keeps the harness's names and its command line:

    python -m gpu.trimmed_build --list [--variant w4a8]     sources, flags, source hash
    python -m gpu.trimmed_build --build [--variant w4a8]    compile into FlashInfer's cache

`install(prebuilt, variant)` (before the first fused-MoE call of the process) loads
`prebuilt` as is; without it, the bundle `KIMI_W31_KERNELS` names when set (checked against
the running stack, as the plugin does), else the JIT spec.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kimi_w31.adapter import kernels as K

BINDING, INSTANTIATION, TRIMMED_PREFIX = K.BINDING, K.INSTANTIATION, K.TRIMMED_PREFIX
W4A16, W4A8_HUMMING = K.W4A16, K.W4A8_HUMMING
MODULE_NAME = W4A16.module_name
VARIANTS = {v.key: v for v in (W4A16, W4A8_HUMMING)}
Variant = K.Variant


def trim_binding(text: str, variant: K.Variant = W4A16) -> str:
    return K.trim_binding(text, variant.trim)  # type: ignore[arg-type]


def trim_instantiation(text: str, variant: K.Variant = W4A16) -> str:
    return K.trim_instantiation(text, variant.trim)  # type: ignore[arg-type]


def select_generated(
    paths: Sequence[Path], read=Path.read_text, variant: K.Variant = W4A16
) -> list[Path]:
    return K.select_generated(paths, read, variant.trim)  # type: ignore[arg-type]


def trimmed_sources(
    stock: Sequence[Path],
    generated: Sequence[Path],
    binding: Path,
    instantiation: Path,
    variant: K.Variant = W4A16,
) -> list[Path]:
    return K.trimmed_sources(stock, generated, binding, instantiation, variant.trim)  # type: ignore[arg-type]


def trimmed_spec(variant: K.Variant = W4A16, split: bool = True) -> Any:
    """FlashInfer's JitSpec for the product's module (derived and split files written)."""
    return K.jit_spec(K.recipe(variant, split=split))


def install(prebuilt: Path | None = None, variant: K.Variant = W4A16) -> None:
    """Route FlashInfer's SM90 fused-MoE lookup to the product's module (see module doc)."""
    if prebuilt is None and os.environ.get(K.ENV_BUNDLE, "").strip():
        K.ensure(variant.arch, humming=variant is W4A8_HUMMING)
    else:
        K.install(variant, prebuilt)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--list", action="store_true", help="print the sources and flags")
    parser.add_argument("--build", action="store_true", help="compile and load the module")
    parser.add_argument("--no-split", action="store_true", help="generated files unsplit")
    parser.add_argument("--variant", choices=sorted(VARIANTS), default=W4A16.key)
    args = parser.parse_args(argv)
    variant = VARIANTS[args.variant]
    rec = K.recipe(variant, split=not args.no_split)
    spec = K.jit_spec(rec)
    if args.list or not args.build:
        for unit in rec.units:
            print(f"{unit.weight:8.2f}  {unit.path}")
        print(f"{len(spec.sources)} sources, source hash {K.source_hash(rec, spec)}")
        print("cuda flags:", " ".join(map(str, spec.extra_cuda_cflags)))
        print("build dir:", spec.build_dir)
    if args.build:
        t0 = time.time()
        print(f"building {spec.name} ...", flush=True)
        spec.build_and_load()
        lib = spec.get_library_path()
        print(f"built {lib} ({lib.stat().st_size / 1e6:.1f} MB) in {time.time() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
