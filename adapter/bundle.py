"""A kernel bundle: the plugin's FlashInfer modules built once, loaded on every serving node.

    DIR/manifest.json
    DIR/<module>.so ...

`kimi-convert prebuild --out DIR` writes one (on a build machine; no GPU needed); serving
nodes name it with `kimi-convert serve --kernels DIR` or `KIMI_W31_KERNELS=DIR`, which the
plugin reads in every SGLang process. A bundle is loaded only when it matches the running
stack field by field (GPU architecture, FlashInfer, CUDA, torch, Python, CPU architecture,
C library, Python ABI), holds the module the serving path needs, that module's recipe is the
one this FlashInfer and this plugin would build, and its library has the recorded sha256;
anything else is refused with a reason code (`converter.errors.Code.KERNEL_BUNDLE_*`), never
loaded.

A bundle is native code every serving process runs, so it is read as hostile input:
- the directory, the manifest and the libraries must be owned by this user or root and not
  writable by group or others; no file of it may be a link (a link could lead anywhere, and
  be re-pointed after the check);
- each file is opened once without following a link and without blocking (a FIFO or a
  device never hangs the check), must be a regular file (`fstat` on the descriptor), and is
  read up to a size limit;
- the library is hashed from that descriptor and loaded from the same descriptor
  (`Library.loadable`): a file swapped in at its path after the check is never loaded.

Importing this module needs neither torch nor FlashInfer.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import platform
import shutil
import stat
import sys
import sysconfig
import tempfile
from collections.abc import Callable, Iterator, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from ..converter.errors import Fatal, Problem, fatal, problem, reason, root_problems
from ..converter.hashing import sha256_file  # noqa: F401  (the bundle's name for it)
from .reasons import AdapterCode
from .refused import Refused

FORMAT = "kimi-w31-kernels/2"  # 2: platform tags (CPU, C library, Python ABI), recipe keys
MANIFEST = "manifest.json"
# Each stack field (a `Stack` attribute) and the code a bundle built for another value of it
# is refused with.
FIELD_CODES = {
    "arch": AdapterCode.KERNEL_BUNDLE_ARCH,
    "flashinfer": AdapterCode.KERNEL_BUNDLE_FLASHINFER,
    "cuda": AdapterCode.KERNEL_BUNDLE_CUDA,
    "torch": AdapterCode.KERNEL_BUNDLE_TORCH,
    "python": AdapterCode.KERNEL_BUNDLE_PYTHON,
    "machine": AdapterCode.KERNEL_BUNDLE_CPU,
    "libc": AdapterCode.KERNEL_BUNDLE_LIBC,
    "abi": AdapterCode.KERNEL_BUNDLE_PYTHON_ABI,
}
STACK_FIELDS = tuple(FIELD_CODES)
# A manifest is a few KiB; the largest module (SM120, FlashInfer's whole set) is well under
# 2 GiB. Anything bigger is not a bundle's, and is never read to the end.
MAX_MANIFEST_BYTES = 1 << 20
MAX_LIBRARY_BYTES = 8 << 30
_LIMITS = {"manifest": MAX_MANIFEST_BYTES, "library": MAX_LIBRARY_BYTES}
_CHUNK = 1 << 20

_DIR_FLAGS = (
    os.O_RDONLY
    | getattr(os, "O_DIRECTORY", 0)
    | getattr(os, "O_NOFOLLOW", 0)
    | getattr(os, "O_NONBLOCK", 0)
    | getattr(os, "O_CLOEXEC", 0)
)
_FILE_FLAGS = (
    os.O_RDONLY
    | getattr(os, "O_NOFOLLOW", 0)
    | getattr(os, "O_NONBLOCK", 0)
    | getattr(os, "O_CLOEXEC", 0)
)


@dataclass(frozen=True)
class Stack:
    """What a library built here is bound to (compared field by field; an empty running
    field is one this process cannot know yet and is not compared)."""

    arch: str  # sm90 | sm120
    flashinfer: str  # FlashInfer's version
    cuda: str  # CUDA major.minor (torch's runtime; nvcc's where torch has none)
    torch: str  # torch's public version (no local "+cu130" tag)
    python: str  # major.minor
    machine: str  # CPU architecture (platform.machine(): x86_64, aarch64)
    libc: str  # "glibc 2.35": the C library and the version built against
    abi: str  # the interpreter's extension ABI tag (SOABI)


@dataclass(frozen=True)
class Module:
    variant: str  # kernels.Variant.key
    name: str  # FlashInfer module name
    file: str  # library file name inside the bundle
    sha256: str
    size: int
    source_hash: str  # kernels.source_hash of the recipe it was built from
    units: int  # translation units compiled
    build_seconds: float | None = None
    # kernels.recipe_key when it was built: what the recipe was made from (this plugin's
    # recipe code, FlashInfer's installed files, flags' inputs); equal at start-up, the
    # recipe is the same without regenerating it (None: always regenerate)
    recipe_key: str | None = None


@dataclass(frozen=True)
class BundleManifest:
    stack: Stack
    modules: tuple[Module, ...]
    kimi_w31: str
    created_utc: str
    build: Mapping[str, Any] = field(default_factory=dict)  # how (jobs, nvcc), for the record
    format: str = FORMAT

    def to_json(self) -> str:
        data = asdict(self)
        data["modules"] = [asdict(m) for m in self.modules]
        return json.dumps(data, indent=2, sort_keys=True) + "\n"

    @classmethod
    def from_json(cls, text: str, where: str = MANIFEST) -> BundleManifest:
        """Parse a manifest; raises BundleError(KERNEL_BUNDLE_INVALID) on anything off."""
        try:
            data = json.loads(text)
            if not isinstance(data, dict) or data.get("format") != FORMAT:
                raise ValueError(f"format is {data.get('format')!r}, not {FORMAT!r}")
            stack = Stack(**{k: str(data["stack"][k]) for k in STACK_FIELDS})
            modules = tuple(Module(**m) for m in data["modules"])
            for m in modules:
                if Path(m.file).name != m.file or not m.file.endswith(".so"):
                    raise ValueError(f"module file {m.file!r} is not a plain .so name")
            return cls(
                stack=stack,
                modules=modules,
                kimi_w31=str(data["kimi_w31"]),
                created_utc=str(data["created_utc"]),
                build=dict(data.get("build") or {}),
            )
        except BundleError:
            raise
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            refused = fatal(
                AdapterCode.KERNEL_BUNDLE_INVALID, rule="not-manifest", file=where, error=exc
            )
            raise BundleError(refused) from None

    def module(self, variant: str) -> Module | None:
        return next((m for m in self.modules if m.variant == variant), None)


class BundleError(Refused, RuntimeError):
    """A bundle that must not be loaded: a `Fatal` whose words and hint are its reasons'
    records (adapter/reasons/bundle.py). Built from a `Fatal` (one reason, its rule
    picking the message) or from a list of problems found together (a stack compared field
    by field), whose hint is its first cause's."""

    def __init__(self, error: Fatal | list[Problem]) -> None:
        super().__init__(error if isinstance(error, Fatal) else Fatal(error, hint=_hint(error)))

    @property
    def problems(self) -> list[Problem]:
        return self.error.problems


def _hint(problems: list[Problem]) -> str | None:
    """The record's hint of the first cause that has one (a list is built from reasons of
    one message each: their hints name no facts)."""
    for p in root_problems(problems)[0]:
        record = reason(p.code)
        if record.rules is None and record.hint is not None:
            return record.hint
    return None


def _public(version: str) -> str:
    return version.split("+", 1)[0]


def _major_minor(version: str) -> str:
    return ".".join(version.split(".")[:2])


def platform_tags() -> dict[str, str]:
    """This interpreter's platform: CPU architecture, C library, Python ABI."""
    name, version = platform.libc_ver()
    abi = sysconfig.get_config_var("SOABI") or sys.implementation.cache_tag or ""
    return {
        "machine": platform.machine(),
        "libc": f"{name} {version}".strip() or "unknown",
        "abi": str(abi),
    }


def _flashinfer_version() -> str:
    # The installed distribution's version, without importing FlashInfer (its import fixes
    # the target architecture and cache directory: too early in a launcher process).
    from importlib import metadata

    try:
        return metadata.version("flashinfer-python")
    except metadata.PackageNotFoundError:
        import flashinfer

        return str(flashinfer.__version__)


def current_stack(arch: str, *, build: bool = False) -> Stack:
    """This process's stack (imports torch). `arch` "" where the GPU is not known yet.
    `build`: a build machine, where a CPU torch takes CUDA from the toolkit FlashInfer
    compiles with; a serving process without CUDA in torch has CUDA "none"."""
    import torch

    cuda = torch.version.cuda
    if not cuda and build:
        from flashinfer.jit.cpp_ext import get_cuda_version

        cuda = str(get_cuda_version())
    return Stack(
        arch=arch,
        flashinfer=_flashinfer_version(),
        cuda=_major_minor(str(cuda)) if cuda else "none",
        torch=_public(str(torch.__version__)),
        python=_major_minor(platform.python_version()),
        **platform_tags(),
    )


def _version_key(version: str) -> tuple[int, ...]:
    return tuple(int(x) for x in version.split(".") if x.isdigit())


def _field_matches(name: str, built: str, running: str) -> bool:
    if not running:  # not known in this process yet (the GPU, before CUDA is up)
        return True
    if name == "libc":  # a library built against glibc 2.35 runs on 2.35 and later
        b_name, _, b_ver = built.partition(" ")
        r_name, _, r_ver = running.partition(" ")
        return b_name == r_name and _version_key(b_ver) <= _version_key(r_ver)
    return built == running


def stack_problems(
    manifest: BundleManifest, running: Stack, where: str = MANIFEST
) -> list[Problem]:
    """One problem per stack field that differs (each with its own code)."""
    return [
        problem(
            FIELD_CODES[name],
            file=where,
            running=getattr(running, name),
            built=getattr(manifest.stack, name),
        )
        for name in STACK_FIELDS
        if not _field_matches(name, getattr(manifest.stack, name), getattr(running, name))
    ]


# --------------------------------------------------------------------------------------
# Reading a bundle: every file opened once, never through a link, never blocking
# --------------------------------------------------------------------------------------


def _trust_problems(st: os.stat_result, where: object) -> list[Problem]:
    """Owner and mode of an opened bundle file or directory (its own fstat)."""
    found: list[Problem] = []
    me = os.geteuid()
    if st.st_uid not in (me, 0):
        found.append(problem(AdapterCode.KERNEL_BUNDLE_OWNER, file=where, uid=st.st_uid, me=me))
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        mode = oct(stat.S_IMODE(st.st_mode))
        found.append(problem(AdapterCode.KERNEL_BUNDLE_WRITABLE, file=where, mode=mode))
    return found


def _kind(mode: int) -> str:
    from ..converter.fsio import kind

    return kind(mode)


def open_root(root: Path) -> int:
    """The bundle directory's descriptor (the path given may be a link: it names the
    bundle; nothing inside it may be one). Raises BundleError."""
    real = Path(os.path.realpath(root))
    try:
        fd = os.open(real, _DIR_FLAGS)
    except FileNotFoundError:
        raise BundleError(
            fatal(AdapterCode.KERNEL_BUNDLE_MISSING, rule="missing", file=root)
        ) from None
    except OSError as exc:
        if exc.errno in (errno.ENOTDIR, errno.ELOOP):
            try:
                what = _kind(os.stat(real).st_mode)
            except OSError:
                what = "unreadable"
            raise BundleError(
                fatal(AdapterCode.KERNEL_BUNDLE_MISSING, rule="not-directory", file=root, kind=what)
            ) from None
        raise BundleError(
            fatal(
                AdapterCode.KERNEL_BUNDLE_INVALID, rule="unreadable", file=root, error=exc.strerror
            )
        ) from None
    problems = _trust_problems(os.fstat(fd), root)
    if problems:
        os.close(fd)
        raise BundleError(problems)
    return fd


def open_member(folder: int, name: str, where: Path, what: str) -> tuple[int, int]:
    """(descriptor, size) of bundle file `name` in the directory open on `folder`: a
    regular file of ours within its size limit (`what`: "manifest" or "library"); raises
    BundleError, or FileNotFoundError when nothing is there (the caller words it)."""
    limit = _LIMITS[what]
    try:
        fd = os.open(name, _FILE_FLAGS, dir_fd=folder)
    except FileNotFoundError:
        raise
    except OSError as exc:
        if exc.errno == errno.ELOOP:  # O_NOFOLLOW met a link
            try:
                target = os.readlink(name, dir_fd=folder)
            except OSError:
                target = "?"
            raise BundleError(
                fatal(AdapterCode.KERNEL_BUNDLE_LINK, file=where, target=target)
            ) from None
        if exc.errno in (errno.ENXIO, errno.EOPNOTSUPP):  # a socket
            raise BundleError(
                fatal(AdapterCode.KERNEL_BUNDLE_NOT_REGULAR, file=where, kind="socket")
            ) from None
        raise BundleError(
            fatal(
                AdapterCode.KERNEL_BUNDLE_INVALID, rule="unreadable", file=where, error=exc.strerror
            )
        ) from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise BundleError(
                fatal(AdapterCode.KERNEL_BUNDLE_NOT_REGULAR, file=where, kind=_kind(st.st_mode))
            )
        problems = _trust_problems(st, where)
        if st.st_size > limit:
            problems.append(
                problem(
                    AdapterCode.KERNEL_BUNDLE_TOO_LARGE,
                    file=where,
                    what=what,
                    size=st.st_size,
                    limit=limit,
                )
            )
        if problems:
            raise BundleError(problems)
        os.set_blocking(fd, True)  # a regular file: reads must not see EAGAIN
    except BaseException:
        os.close(fd)
        raise
    return fd, st.st_size


def _read_bounded(fd: int, what: str, where: Path, sink: Callable[[bytes], None]) -> int:
    """Feed the descriptor's bytes from offset 0 to `sink`; refuses past the size limit of
    `what` (a file that grows while read)."""
    limit = _LIMITS[what]
    done = 0
    while True:
        block = os.pread(fd, _CHUNK, done)
        if not block:
            return done
        done += len(block)
        if done > limit:
            raise BundleError(
                fatal(
                    AdapterCode.KERNEL_BUNDLE_TOO_LARGE,
                    file=where,
                    what=what,
                    size=done,
                    limit=limit,
                )
            )
        sink(block)


def read_manifest(folder: int, root: Path) -> BundleManifest:
    """The manifest of the bundle open on `folder` (read bounded, from one descriptor)."""
    where = root / MANIFEST
    try:
        fd, _ = open_member(folder, MANIFEST, where, "manifest")
    except FileNotFoundError:
        raise BundleError(
            fatal(
                AdapterCode.KERNEL_BUNDLE_INVALID,
                rule="unreadable",
                file=where,
                error=os.strerror(errno.ENOENT),
            )
        ) from None
    try:
        parts: list[bytes] = []
        _read_bounded(fd, "manifest", where, parts.append)
    finally:
        os.close(fd)
    try:
        text = b"".join(parts).decode()
    except UnicodeDecodeError as exc:
        raise BundleError(
            fatal(AdapterCode.KERNEL_BUNDLE_INVALID, rule="not-manifest", file=where, error=exc)
        ) from None
    return BundleManifest.from_json(text, str(where))


@dataclass
class Library:
    """A bundle library checked and held open: what is loaded is these very bytes."""

    path: Path  # where it lies in the bundle (for messages)
    fd: int  # open on the bytes that were hashed
    sha256: str

    @contextlib.contextmanager
    def loadable(self) -> Iterator[str]:
        """A path the dynamic loader opens this descriptor's file through: a link named
        like the library (loaders pick the format by suffix) to `/proc/self/fd/N`, in a
        folder only this user can enter, removed after the load. Whatever the bundle path
        names by then, the loader reads the file that was hashed."""
        private = tempfile.mkdtemp(prefix="kimi-w31-load-")  # 0700
        link = os.path.join(private, self.path.name)
        try:
            os.symlink(f"/proc/self/fd/{self.fd}", link)
            yield link
        finally:
            shutil.rmtree(private, ignore_errors=True)

    def close(self) -> None:
        with contextlib.suppress(OSError):
            os.close(self.fd)


def open_library(folder: int, root: Path, module: Module) -> Library:
    """The module's library opened once and hashed from that descriptor; refused (with the
    library's own code) when its digest is not the manifest's."""
    where = root / module.file
    try:
        fd, _ = open_member(folder, module.file, where, "library")
    except FileNotFoundError:
        raise BundleError(
            fatal(
                AdapterCode.KERNEL_BUNDLE_LIBRARY,
                file=where,
                want=module.sha256[:16],
                digest="missing",
            )
        ) from None
    try:
        h = hashlib.sha256()
        _read_bounded(fd, "library", where, h.update)
    except BaseException:
        os.close(fd)
        raise
    digest = h.hexdigest()
    if digest != module.sha256:
        os.close(fd)
        raise BundleError(
            fatal(
                AdapterCode.KERNEL_BUNDLE_LIBRARY,
                file=where,
                want=module.sha256[:16],
                digest=digest[:16],
            )
        )
    return Library(where, fd, digest)


SourceHash = str | Callable[[], str] | None


def preflight(root: Path, running: Stack) -> BundleManifest:
    """What a process can check before any weight loads: the bundle is there, safe to read,
    and built for this stack (fields of `running` left empty are not compared). Raises
    BundleError with every reason."""
    folder = open_root(root)
    try:
        manifest = read_manifest(folder, root)
    finally:
        os.close(folder)
    problems = stack_problems(manifest, running, str(root / MANIFEST))
    if problems:
        raise BundleError(problems)
    return manifest


def check(
    root: Path,
    variant: str,
    running: Stack,
    source_hash: SourceHash,
    recipe_key: str | None = None,
) -> tuple[BundleManifest, Library]:
    """The library of `variant` in the bundle at `root`, opened and hashed, if it may be
    loaded here; raises BundleError with every reason it may not.

    The recipe: when the module's recorded `recipe_key` equals `recipe_key` (what this
    FlashInfer and this plugin would build from), the recipe is the one built and is not
    regenerated; otherwise `source_hash` (a digest, or a function computing it: FlashInfer's
    generator run and every source hashed) must equal the recorded one. `source_hash` None
    with no key match skips that check (the caller has no FlashInfer generator)."""
    folder = open_root(root)
    try:
        where = str(root / MANIFEST)
        manifest = read_manifest(folder, root)
        problems = stack_problems(manifest, running, where)
        module = manifest.module(variant)
        if module is None:
            have = ", ".join(m.variant for m in manifest.modules) or "none"
            problems.append(
                problem(AdapterCode.KERNEL_BUNDLE_NO_MODULE, file=where, variant=variant, have=have)
            )
        if problems or module is None:
            raise BundleError(problems)
        same_recipe = recipe_key is not None and module.recipe_key == recipe_key
        if not same_recipe and source_hash is not None:
            digest = source_hash() if callable(source_hash) else source_hash
            if module.source_hash != digest:
                problems.append(
                    problem(
                        AdapterCode.KERNEL_BUNDLE_SOURCES,
                        file=where,
                        module=module.name,
                        want=digest[:16],
                        built=module.source_hash[:16],
                    )
                )
        try:
            library = open_library(folder, root, module)
        except BundleError as exc:
            if not problems:
                raise
            raise BundleError(problems + exc.problems) from None
        if problems:
            library.close()
            raise BundleError(problems)
        return manifest, library
    finally:
        os.close(folder)


def write(root: Path, manifest: BundleManifest) -> Path:
    """Write the manifest last, atomically: a bundle without one is never loaded."""
    root.mkdir(parents=True, exist_ok=True)
    tmp = root / f".{MANIFEST}.tmp"
    tmp.write_text(manifest.to_json())
    os.chmod(tmp, 0o644)
    tmp.replace(root / MANIFEST)
    return root / MANIFEST
