"""Pay FlashInfer's fused-MoE JIT build once, before serving.

FlashInfer compiles its CUTLASS fused-MoE module for the GPU's architecture on the first
MoE call: on SM90 that is `fused_moe_90`, 248 sources, one to two hours on 16 cores
(docs/gpu-validation.md). A server started cold pays it inside its first forward. `prebuild`
compiles exactly the module `cutlass_fused_moe` will load (same FlashInfer recipe, same
cache directory, `FLASHINFER_WORKSPACE_BASE` respected), reporting progress, so that the
server then finds it in FlashInfer's JIT cache.

    from kimi_w31.adapter.prebuild import prebuild
    result = prebuild(lambda p: print(f"{p.done}/{p.total} {p.stage}"))

Importing this module needs neither torch nor FlashInfer; calling `prebuild` needs both
(and nvcc), but no GPU when `arch` is given: on a machine without the GPU, run it in a
fresh process (FlashInfer picks its cache directory from the target architecture when it is
imported) and copy FlashInfer's cache directory (`FLASHINFER_WORKSPACE_BASE`) over.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

Arch = Literal["sm90", "sm120"]
Stage = Literal["cached", "compile", "done"]

# The FlashInfer generator (in flashinfer.fused_moe.core's namespace) per serving
# architecture, and the FLASHINFER_CUDA_ARCH_LIST entry that makes FlashInfer on a machine
# without that GPU pick the cache directory a server on that GPU will look in (FlashInfer
# adds the same suffix, e.g. 9.0 -> 90a, as it does for a detected GPU).
_GENERATOR = {
    "sm90": "gen_cutlass_fused_moe_sm90_module",
    "sm120": "gen_cutlass_fused_moe_sm120_module",
}
_CUDA_ARCH = {"sm90": "9.0", "sm120": "12.0"}


@dataclass(frozen=True)
class Progress:
    """One progress report: `done` of `total` translation units compiled."""

    stage: Stage
    done: int
    total: int
    elapsed_s: float


@dataclass(frozen=True)
class PrebuildResult:
    arch: Arch
    module: str  # FlashInfer's module name, e.g. "fused_moe_90"
    library: Path  # the shared library cutlass_fused_moe will load
    built: bool  # False when it was already in FlashInfer's JIT cache
    sources: int
    seconds: float


ProgressCallback = Callable[[Progress], None]


class PrebuildError(RuntimeError):
    """The module could not be built (no FlashInfer, no nvcc, unknown arch, build failed)."""


def _gpu_arch() -> Arch | None:
    """The visible GPU's serving arch, None without a GPU; raises for other GPUs."""
    from .flashinfer_moe import arch_of

    try:
        import torch
    except ImportError as exc:
        raise PrebuildError("prebuild needs torch") from exc
    if not torch.cuda.is_available():
        return None
    try:
        return arch_of()
    except ValueError as exc:
        raise PrebuildError(str(exc)) from exc


def _spec(arch: Arch) -> Any:
    import os
    import sys

    if "FLASHINFER_CUDA_ARCH_LIST" not in os.environ and _gpu_arch() is None:
        # FlashInfer fixes its cache directory from this (or the visible GPUs) at import.
        if "flashinfer" in sys.modules:
            raise PrebuildError(
                "flashinfer was imported in this process before prebuild, on a machine "
                "without a GPU: its cache directory would not be the server's. Run prebuild "
                f"in a fresh process, or set FLASHINFER_CUDA_ARCH_LIST={_CUDA_ARCH[arch]}"
            )
        os.environ["FLASHINFER_CUDA_ARCH_LIST"] = _CUDA_ARCH[arch]
    try:
        from flashinfer.fused_moe import core
    except Exception as exc:  # not installed or broken
        raise PrebuildError(f"cannot import flashinfer.fused_moe ({exc!r})") from exc
    return getattr(core, _GENERATOR[arch])(False)


def _objects(build_dir: Path) -> int:
    return sum(1 for _ in build_dir.rglob("*.o")) if build_dir.is_dir() else 0


def prebuild(
    progress_cb: ProgressCallback | None = None,
    *,
    arch: Arch | None = None,
    poll_s: float = 5.0,
) -> PrebuildResult:
    """Compile FlashInfer's CUTLASS fused-MoE module for `arch` (default: this GPU's).

    `progress_cb` gets a `Progress` at the start, every `poll_s` seconds while compiling
    (translation units done, counted from the object files in the build directory), and at
    the end; it is not called from a worker thread. Returns what was built and where; raises
    `PrebuildError` when it cannot. Idempotent: a second call finds the cache and returns
    at once with `built=False`.
    """
    from .flashinfer_moe import check_situ_support

    if arch is not None and arch not in _GENERATOR:
        raise PrebuildError(f"unknown arch {arch!r}: expected one of {sorted(_GENERATOR)}")
    check_situ_support()  # a FlashInfer without CUTLASS SiTU is not worth building
    gpu = _gpu_arch()
    if arch is None and gpu is None:
        raise PrebuildError("no CUDA GPU visible: pass arch='sm90' or arch='sm120'")
    if arch is not None and gpu is not None and arch != gpu:
        raise PrebuildError(
            f"this machine's GPU is {gpu}, not {arch}: prebuild on the GPU you serve on, or "
            "on a machine without a GPU"
        )
    target: Arch = arch or gpu  # type: ignore[assignment]
    spec = _spec(target)
    total = len(spec.sources)
    report = progress_cb or (lambda _p: None)
    t0 = time.monotonic()
    if spec.is_compiled:
        report(Progress("cached", total, total, 0.0))
        return PrebuildResult(target, spec.name, spec.get_library_path(), False, total, 0.0)

    errors: list[BaseException] = []

    def build() -> None:
        try:
            spec.build()
        except BaseException as exc:  # re-raised in the caller's thread
            errors.append(exc)

    worker = threading.Thread(target=build, name="kimi-w31-prebuild", daemon=True)
    report(Progress("compile", _objects(spec.build_dir), total, 0.0))
    worker.start()
    while worker.is_alive():
        worker.join(poll_s)
        done = min(_objects(spec.build_dir), total)
        report(Progress("compile", done, total, time.monotonic() - t0))
    if errors:
        raise PrebuildError(f"building {spec.name} failed: {errors[0]}") from errors[0]
    seconds = time.monotonic() - t0
    report(Progress("done", total, total, seconds))
    return PrebuildResult(target, spec.name, spec.get_library_path(), True, total, seconds)
