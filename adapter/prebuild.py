"""Pay the plugin's FlashInfer build once, before serving, and optionally bundle it.

The plugin runs on its own FlashInfer modules (`kernels.py`: per serving path, exactly the
runner it calls, heavy translation units split, costliest first). Without them ready, the
first MoE call of every cold server rank compiles one. `prebuild` compiles them ahead:

- into FlashInfer's JIT cache (same recipe and cache directory the plugin uses,
  `FLASHINFER_WORKSPACE_BASE` respected), so a server on this machine finds them; and,
  with `out`, into a relocatable bundle (`bundle.py`: the libraries plus a manifest of the
  stack they are bound to) that serving nodes load through `KIMI_W31_KERNELS` with no
  compiler and no build.

    from .prebuild import prebuild
    result = prebuild(lambda p: print(f"{p.module} {p.done}/{p.total}"), arch="sm90", out=d)

Importing this module needs neither torch nor FlashInfer; calling `prebuild` needs both
(and nvcc), but no GPU when `arch` is given: FlashInfer fixes its target architecture and
cache directory when it is imported, so `prebuild` sets `FLASHINFER_CUDA_ARCH_LIST` for
`arch` before it imports FlashInfer (a process that imported FlashInfer earlier without a
GPU is refused: its cache directory would not be the server's).

Parallelism is bounded by memory as well as cores (`default_jobs`): ninja's default of one
nvcc per core has had builds killed for memory (one CUTLASS MoE unit took 9.4 GiB).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import threading
import time
from collections.abc import Callable, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from ..converter.errors import fatal
from ..converter.hashing import sha256_file
from .arch import ARCHES, CUDA_ARCH_LIST, Arch
from .reasons import AdapterCode
from .refused import Refused

Stage = Literal["cached", "compile", "done"]

# The FLASHINFER_CUDA_ARCH_LIST entry that makes FlashInfer on a machine without that GPU
# target it and pick the cache directory a server on that GPU will look in (e.g. 90a).
_CUDA_ARCH = CUDA_ARCH_LIST
# Host memory one nvcc of these CUTLASS units may take (measured up to 9.4 GiB for an
# unsplit M256 unit; the split units stay well below).
GIB_PER_JOB = 6.0


@dataclass(frozen=True)
class BuildProgress:
    """One progress report: `done` of `total` translation units of `module` compiled."""

    stage: Stage
    done: int
    total: int
    elapsed_s: float
    module: str = ""


@dataclass(frozen=True)
class ModuleResult:
    variant: str  # kernels.Variant.key
    module: str  # FlashInfer's module name
    library: Path  # in FlashInfer's JIT cache
    built: bool  # False when it was already in the cache
    sources: int
    seconds: float
    source_hash: str
    recipe_key: str | None = None  # kernels.recipe_key: compared at start-up


@dataclass(frozen=True)
class PrebuildResult:
    arch: Arch
    modules: list[ModuleResult]
    jobs: int
    bundle: Path | None = None  # the manifest written, with `out`
    seconds: float = 0.0
    notes: list[str] = field(default_factory=list)


ProgressCallback = Callable[[BuildProgress], None]


class PrebuildError(Refused, RuntimeError):
    """The modules cannot be built here (no FlashInfer, no nvcc, wrong arch, build failed).
    `reason` is stable (tests, tools); the message says what to install or pass."""


INSTALL_SERVING = (
    "pip install '.[sglang]' from a clone of kimi-w31 (torch, FlashInfer, SGLang), in the "
    "environment that serves"
)


def cuda_home(
    environ: dict[str, str] | os._Environ[str] = os.environ,
    which: Callable[[str], str | None] = shutil.which,
) -> Path:
    """The CUDA toolkit FlashInfer's JIT compiles with, found by its own rule
    (flashinfer/jit/cpp_ext.py `get_cuda_path`): CUDA_HOME, CUDA_PATH, nvcc's folder's
    parent, /usr/local/cuda."""
    given = environ.get("CUDA_HOME") or environ.get("CUDA_PATH")
    if given:
        return Path(given)
    nvcc = which("nvcc")
    return Path(nvcc).resolve().parent.parent if nvcc else Path("/usr/local/cuda")


def toolkit_problems(home: Path) -> list[str]:
    """What the build needs from the CUDA toolkit at `home` and does not find there: nvcc,
    and the cuRAND headers the MoE sources include (a runtime-only CUDA install lacks them)."""
    missing = []
    if not (home / "bin" / "nvcc").is_file():
        missing.append(f"nvcc ({home / 'bin' / 'nvcc'})")
    includes = [home / "include", *sorted(home.glob("targets/*/include"))]
    if not any((d / "curand.h").is_file() for d in includes):
        missing.append(f"the cuRAND headers (curand.h in {home / 'include'})")
    return missing


def check_toolkit(home: Path | None = None) -> None:
    """Refuse, before compiling, a machine whose CUDA toolkit cannot build the modules."""
    home = home or cuda_home()
    missing = toolkit_problems(home)
    if missing:
        raise PrebuildError(
            fatal(AdapterCode.NO_CUDA_TOOLKIT, home=home, missing=" and ".join(missing))
        )


def _meminfo_available() -> int | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def default_jobs(
    cores: int | None = None,
    available_bytes: int | None = None,
    gib_per_job: float = GIB_PER_JOB,
    environ: dict[str, str] | os._Environ[str] = os.environ,
) -> int:
    """Parallel nvcc jobs: `MAX_JOBS` when set (FlashInfer's own knob), else
    min(cores, available memory / `gib_per_job` GiB), at least 1."""
    given = environ.get("MAX_JOBS", "").strip()
    if given.isdigit() and int(given) > 0:
        return int(given)
    cores = cores or os.cpu_count() or 1
    if available_bytes is None:
        available_bytes = _meminfo_available()
    if available_bytes is None:
        return max(1, cores)
    return max(1, min(cores, int(available_bytes // (gib_per_job * 2**30))))


def require_torch() -> None:
    """Refuse, with what to install, an environment without torch (`pip install .` alone:
    the converter needs none, the kernels do)."""
    import importlib.util

    if importlib.util.find_spec("torch") is None:
        raise PrebuildError(fatal(AdapterCode.NO_TORCH, install=INSTALL_SERVING))


def _gpu_arch() -> Arch | None:
    """The visible GPU's serving arch, None without a GPU; raises for other GPUs."""
    require_torch()  # before flashinfer_moe, which imports torch
    from .flashinfer_moe import arch_of

    require_torch()
    import torch

    if not torch.cuda.is_available():
        return None
    try:
        return arch_of()
    except ValueError as exc:
        raise PrebuildError(
            fatal(AdapterCode.PREBUILD_ARCH, rule="unsupported-gpu", error=exc)
        ) from exc


def target_flashinfer(arch: Arch, gpu: Arch | None) -> None:
    """Make FlashInfer, not yet imported, target `arch` on a machine without that GPU."""
    import sys

    if gpu is not None or "FLASHINFER_CUDA_ARCH_LIST" in os.environ:
        return
    if "flashinfer" in sys.modules:
        raise PrebuildError(
            fatal(AdapterCode.PREBUILD_FLASHINFER_IMPORTED, arch_list=_CUDA_ARCH[arch])
        )
    os.environ["FLASHINFER_CUDA_ARCH_LIST"] = _CUDA_ARCH[arch]


def _objects(build_dir: Path) -> int:
    return sum(1 for _ in build_dir.rglob("*.o")) if build_dir.is_dir() else 0


def _build(spec: Any, jobs: int, report: ProgressCallback, poll_s: float) -> float:
    """Run FlashInfer's ninja build of `spec` with `jobs`, reporting progress from here."""
    errors: list[BaseException] = []
    previous = os.environ.get("MAX_JOBS")
    os.environ["MAX_JOBS"] = str(jobs)  # FlashInfer's run_ninja reads it

    def build() -> None:
        try:
            spec.build()
        except BaseException as exc:  # re-raised in the caller's thread
            errors.append(exc)

    total = len(spec.sources)
    t0 = time.monotonic()
    worker = threading.Thread(target=build, name="kimi-w31-prebuild", daemon=True)
    report(BuildProgress("compile", min(_objects(spec.build_dir), total), total, 0.0, spec.name))
    try:
        worker.start()
        while worker.is_alive():
            worker.join(poll_s)
            done = min(_objects(spec.build_dir), total)
            report(BuildProgress("compile", done, total, time.monotonic() - t0, spec.name))
    finally:
        if previous is None:
            os.environ.pop("MAX_JOBS", None)
        else:
            os.environ["MAX_JOBS"] = previous
    if errors:
        raise build_refusal(spec.name, errors[0]) from errors[0]
    return time.monotonic() - t0


OUTPUT_LINES = 30  # of a failed compiler's output, kept in the refusal


def build_refusal(module: str, error: BaseException) -> PrebuildError:
    """A failed build as a refusal: a compiler that exited non-zero (FlashInfer raises its
    own error from ninja's `CalledProcessError`) is `prebuild-failed` with its exit status
    and the last lines it printed; anything else FlashInfer's build raised, `prebuild-build`."""
    cause: BaseException | None = error
    while cause is not None and not isinstance(cause, subprocess.CalledProcessError):
        cause = cause.__cause__ or cause.__context__
    if cause is None:
        return PrebuildError(
            fatal(AdapterCode.PREBUILD_BUILD, rule="compile", module=module, error=error)
        )
    command = cause.cmd[0] if isinstance(cause.cmd, (list, tuple)) and cause.cmd else cause.cmd
    output = cause.output if isinstance(cause.output, str) else ""
    return PrebuildError(
        fatal(
            AdapterCode.PREBUILD_FAILED,
            module=module,
            command=os.path.basename(str(command)),
            status=cause.returncode,
            output="\n".join(output.splitlines()[-OUTPUT_LINES:]),
        )
    )


# Publishing into `--out`: the lock file, the private staging folders, and how long a
# second publisher waits for the first (a publish renames files: seconds, not a build).
PUBLISH_LOCK = ".kimi-w31-prebuild.lock"
STAGE_PREFIX = ".kimi-w31-stage-"
PUBLISH_WAIT_S = 300.0


def _stage_library(source: Path, stage: Path, file: str) -> tuple[str, int]:
    """Copy a built library into the private staging folder (mode 0644: the bundle's rules),
    flushed to disk; (sha256, size) of the copy, read back from it."""

    dest = stage / file
    with source.open("rb") as src, open(dest, "xb") as dst:
        shutil.copyfileobj(src, dst, 1 << 20)
        dst.flush()
        os.fchmod(dst.fileno(), 0o644)
        os.fsync(dst.fileno())
    return sha256_file(dest), dest.stat().st_size


@contextmanager
def publish_lock(out: Path, wait_s: float = PUBLISH_WAIT_S, poll_s: float = 0.05):
    """Hold `out`'s publish lock: a second publisher waits for the first, then refuses
    (KERNEL_BUNDLE_BUSY). The converter's output lock, not a lock library: none is among
    the project's dependencies, and that lock already handles a dead holder, a link or FIFO
    planted in its place, and NFS (O_EXCL plus flock)."""
    from ..converter.output.lock import OutputLock
    from . import bundle as B

    lock = OutputLock(out / PUBLISH_LOCK)
    deadline = time.monotonic() + wait_s
    while True:
        refused = lock.attempt()
        if refused is None:
            break
        if refused.why not in ("busy", "vanished") or time.monotonic() >= deadline:
            owner = refused.owner or {}
            who = f"pid {owner.get('pid')} on {owner.get('host')}" if owner else refused.why
            raise B.BundleError(
                fatal(AdapterCode.KERNEL_BUNDLE_BUSY, file=out, who=who, seconds=int(wait_s))
            )
        time.sleep(poll_s)
    try:
        yield
    finally:
        lock.release()


def _kept_modules(out: Path, stack: Any) -> dict[str, Any]:
    """The modules of the bundle already at `out` built for the same stack (read under the
    publish lock, so a concurrent publisher's entries are kept, never lost)."""
    from . import bundle as B

    try:
        folder = B.open_root(out)
    except B.BundleError:
        return {}
    try:
        old = B.read_manifest(folder, out)
    except B.BundleError:
        return {}
    finally:
        os.close(folder)
    if old.stack != stack:
        return {}
    return {m.variant: m for m in old.modules if (out / m.file).is_file()}


def check_out(out: Path) -> None:
    """Before building: `out` must be a folder a serving node will accept (ours, not
    writable by others; made 0755 when missing). Raises bundle.BundleError."""
    from . import bundle as B

    if not os.path.lexists(out):
        out.mkdir(mode=0o755, parents=True, exist_ok=True)
    os.close(B.open_root(out))


def _bundle(out: Path, arch: Arch, results: list[ModuleResult], jobs: int) -> Path:
    """Publish the libraries into `out` with its manifest, atomically: each library is
    staged in a private folder inside `out` (same filesystem: a rename), then, under the
    publish lock, renamed into place and the manifest (the kept modules of an earlier
    bundle for the same stack, plus these) replaced last. A concurrent publish waits; a
    reader sees the old or the new files, never a mix of two builds' bytes."""
    import datetime as dt
    import tempfile

    from .. import __version__
    from . import bundle as B

    stack = B.current_stack(arch, build=True)
    check_out(out)
    stage = Path(tempfile.mkdtemp(prefix=STAGE_PREFIX, dir=out))  # 0700: ours alone
    try:
        staged: dict[str, Any] = {}
        for r in results:
            file = f"{r.module}.so"
            sha256, size = _stage_library(r.library, stage, file)
            staged[r.variant] = B.Module(
                variant=r.variant,
                name=r.module,
                file=file,
                sha256=sha256,
                size=size,
                source_hash=r.source_hash,
                units=r.sources,
                build_seconds=round(r.seconds, 1) if r.built else None,
                recipe_key=r.recipe_key,
            )
        with publish_lock(out):
            modules = _kept_modules(out, stack)
            for variant, module in staged.items():
                os.replace(stage / module.file, out / module.file)
                modules[variant] = module
            manifest = B.BundleManifest(
                stack=stack,
                modules=tuple(modules[k] for k in sorted(modules)),
                kimi_w31=__version__,
                created_utc=dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
                build={"jobs": jobs, "cpu_count": os.cpu_count()},
            )
            tmp = stage / B.MANIFEST
            with open(tmp, "x") as fh:
                fh.write(manifest.to_json())
                fh.flush()
                os.fchmod(fh.fileno(), 0o644)
                os.fsync(fh.fileno())
            os.replace(tmp, out / B.MANIFEST)
            _fsync_dir(out)
    finally:
        shutil.rmtree(stage, ignore_errors=True)
    return out / B.MANIFEST


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _check_out_or_refuse(out: Path) -> None:
    try:
        check_out(out)
    except OSError as exc:
        raise PrebuildError(
            fatal(AdapterCode.PREBUILD_BUILD, rule="folder", out=out, error=exc)
        ) from exc


def _build_cuda(arch: Arch) -> str:
    """The CUDA major.minor the bundle's stack records (recipe keys name it)."""
    from . import bundle as B

    return B.current_stack(arch, build=True).cuda


def prebuild(
    progress_cb: ProgressCallback | None = None,
    *,
    arch: Arch | None = None,
    variants: Sequence[str] | None = None,
    out: Path | None = None,
    jobs: int | None = None,
    poll_s: float = 5.0,
    plan_only: bool = False,
) -> PrebuildResult:
    """Compile the plugin's FlashInfer modules for `arch` (default: this GPU's).

    `variants`: kernels.VARIANTS keys (default: the architecture's default serving path,
    SM90 W4A16). `out`: also write a bundle there. `jobs`: parallel nvcc processes (default
    `default_jobs()`). `plan_only`: compute the recipes and hashes, build nothing.
    `progress_cb` gets `BuildProgress` reports from the calling thread. Idempotent: a module
    already in FlashInfer's cache is not rebuilt (`built=False`). Raises `PrebuildError`.
    """
    t_start = time.monotonic()
    if arch is not None and arch not in ARCHES:
        raise PrebuildError(
            fatal(AdapterCode.PREBUILD_ARCH, rule="unknown", arch=arch, arches=list(ARCHES))
        )
    gpu = _gpu_arch()
    if arch is None and gpu is None:
        raise PrebuildError(fatal(AdapterCode.NO_GPU, rule="prebuild"))
    if arch is not None and gpu is not None and arch != gpu:
        raise PrebuildError(fatal(AdapterCode.PREBUILD_ARCH, rule="other-gpu", gpu=gpu, arch=arch))
    target: Arch = arch or gpu  # type: ignore[assignment]
    from . import kernels

    keys = list(variants or kernels.DEFAULT_VARIANTS[target])
    unknown = [k for k in keys if k not in kernels.VARIANTS]
    wrong = [k for k in keys if k in kernels.VARIANTS and kernels.VARIANTS[k].arch != target]
    if unknown or wrong:
        raise PrebuildError(
            fatal(
                AdapterCode.PREBUILD_ARCH,
                rule="precision",
                precision=", ".join(unknown + wrong),
                arch=target,
                expected_keys=[k for k, v in kernels.VARIANTS.items() if v.arch == target],
            )
        )
    # Before anything imports FlashInfer (check_situ_support does).
    target_flashinfer(target, gpu)
    from .flashinfer_moe import check_humming_support, check_situ_support

    check_situ_support()  # a FlashInfer without CUTLASS SiTU is not worth building
    if "w4a8" in keys:
        check_humming_support()
    n_jobs = jobs if jobs is not None else default_jobs()
    report = progress_cb or (lambda _p: None)
    if out is not None and not plan_only:
        _check_out_or_refuse(out)  # before a build of minutes: a folder servers would refuse
    # The recipe keys a bundle records (kernels.recipe_key) name the stack's CUDA.
    cuda = _build_cuda(target) if out is not None and not plan_only else None
    results: list[ModuleResult] = []
    for key in keys:
        try:
            rec = kernels.recipe(kernels.VARIANTS[key])
            spec = kernels.jit_spec(rec, write=not plan_only)
            digest = kernels.source_hash(rec, spec)
            rkey = kernels.recipe_key(kernels.VARIANTS[key], cuda) if cuda else None
        except (RuntimeError, ValueError, OSError) as exc:
            raise PrebuildError(
                fatal(AdapterCode.PREBUILD_BUILD, rule="recipe", variant=key, error=exc)
            ) from exc
        total = len(spec.sources)
        library = spec.get_library_path()
        if not plan_only and not spec.is_compiled:
            check_toolkit()  # before nvcc's own error, 5 s into the build
        if plan_only or spec.is_compiled:
            if not plan_only:
                report(BuildProgress("cached", total, total, 0.0, spec.name))
            results.append(ModuleResult(key, spec.name, library, False, total, 0.0, digest, rkey))
            continue
        seconds = _build(spec, n_jobs, report, poll_s)
        report(BuildProgress("done", total, total, seconds, spec.name))
        results.append(ModuleResult(key, spec.name, library, True, total, seconds, digest, rkey))
    manifest = None
    if out is not None and not plan_only:
        try:
            manifest = _bundle(out, target, results, n_jobs)
        except OSError as exc:
            raise PrebuildError(
                fatal(AdapterCode.PREBUILD_BUILD, rule="write", out=out, error=exc)
            ) from exc
    return PrebuildResult(target, results, n_jobs, manifest, seconds=time.monotonic() - t_start)
