"""A kernel bundle: the plugin's FlashInfer modules built once, loaded on every serving node.

    DIR/manifest.json
    DIR/<module>.so ...

`kimi-convert prebuild --out DIR` writes one (on a build machine; no GPU needed); serving
nodes name it with `kimi-convert serve --kernels DIR` or `KIMI_W31_KERNELS=DIR`, which the
plugin reads in every SGLang process. A bundle is loaded only when it matches the running
stack field by field (architecture, FlashInfer, CUDA, torch, Python), holds the module the
serving path needs, that module's sources and flags hash to what this FlashInfer and this
plugin would build, and its library has the recorded sha256; anything else is refused with
a reason code (`converter.errors.Code.KERNEL_BUNDLE_*`), never loaded.

Importing this module needs neither torch nor FlashInfer.
"""

from __future__ import annotations

import hashlib
import json
import platform
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from ..converter.errors import Code, Problem, problem

FORMAT = "kimi-w31-kernels/1"
MANIFEST = "manifest.json"
STACK_FIELDS = ("arch", "flashinfer", "cuda", "torch", "python")
_FIELD_CODE = {
    "arch": Code.KERNEL_BUNDLE_ARCH,
    "flashinfer": Code.KERNEL_BUNDLE_FLASHINFER,
    "cuda": Code.KERNEL_BUNDLE_CUDA,
    "torch": Code.KERNEL_BUNDLE_TORCH,
    "python": Code.KERNEL_BUNDLE_PYTHON,
}


@dataclass(frozen=True)
class Stack:
    """What a library built here is bound to (compared field by field)."""

    arch: str  # sm90 | sm120
    flashinfer: str  # flashinfer.__version__
    cuda: str  # CUDA major.minor (torch's runtime; nvcc's where torch has none)
    torch: str  # torch's public version (no local "+cu130" tag)
    python: str  # major.minor


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


@dataclass(frozen=True)
class Manifest:
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
    def from_json(cls, text: str, where: str = MANIFEST) -> Manifest:
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
            refused = problem(
                Code.KERNEL_BUNDLE_INVALID, rule="not-manifest", file=where, error=exc
            )
            raise BundleError([refused]) from None

    def module(self, variant: str) -> Module | None:
        return next((m for m in self.modules if m.variant == variant), None)


class BundleError(RuntimeError):
    """A bundle that must not be loaded; `problems` carry the reason codes."""

    def __init__(self, problems: list[Problem]) -> None:
        self.problems = problems
        super().__init__(
            "kernel bundle refused:\n  - "
            + "\n  - ".join(f"[{p.code.value}] {p.render()}" for p in problems)
            + "\nRebuild it with `kimi-convert prebuild --out DIR` in this stack, or unset "
            "KIMI_W31_KERNELS to build into FlashInfer's cache on first use."
        )

    @property
    def codes(self) -> list[Code]:
        return [p.code for p in self.problems]


def _public(version: str) -> str:
    return version.split("+", 1)[0]


def _major_minor(version: str) -> str:
    return ".".join(version.split(".")[:2])


def current_stack(arch: str) -> Stack:
    """This process's stack (imports torch and FlashInfer)."""
    import flashinfer
    import torch

    cuda = torch.version.cuda
    if not cuda:  # a CPU torch on a build machine: the toolkit FlashInfer compiles with
        from flashinfer.jit.cpp_ext import get_cuda_version

        cuda = str(get_cuda_version())
    return Stack(
        arch=arch,
        flashinfer=str(flashinfer.__version__),
        cuda=_major_minor(str(cuda)),
        torch=_public(str(torch.__version__)),
        python=_major_minor(platform.python_version()),
    )


def stack_problems(manifest: Manifest, running: Stack, where: str = MANIFEST) -> list[Problem]:
    """One problem per stack field that differs (each with its own code)."""
    return [
        problem(
            _FIELD_CODE[name],
            file=where,
            running=getattr(running, name),
            built=getattr(manifest.stack, name),
        )
        for name in STACK_FIELDS
        if getattr(manifest.stack, name) != getattr(running, name)
    ]


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def check(
    root: Path, variant: str, running: Stack, source_hash: str | None
) -> tuple[Manifest, Path]:
    """The library of `variant` in the bundle at `root`, if the bundle may be loaded here;
    raises BundleError with every reason it may not. `source_hash` None skips that check
    (it needs FlashInfer's generator; the caller passes it whenever it can)."""
    where = str(root / MANIFEST)
    try:
        text = (root / MANIFEST).read_text()
    except OSError as exc:
        error = exc.strerror
        raise BundleError(
            [problem(Code.KERNEL_BUNDLE_INVALID, rule="unreadable", file=where, error=error)]
        ) from None
    manifest = Manifest.from_json(text, where)
    problems = stack_problems(manifest, running, where)
    module = manifest.module(variant)
    if module is None:
        have = ", ".join(m.variant for m in manifest.modules) or "none"
        problems.append(
            problem(Code.KERNEL_BUNDLE_NO_MODULE, file=where, variant=variant, have=have)
        )
    if problems or module is None:
        raise BundleError(problems)
    if source_hash is not None and module.source_hash != source_hash:
        problems.append(
            problem(
                Code.KERNEL_BUNDLE_SOURCES,
                file=where,
                module=module.name,
                want=source_hash[:16],
                built=module.source_hash[:16],
            )
        )
    library = root / module.file
    try:
        digest = sha256_file(library)
    except OSError as exc:
        digest = f"unreadable ({exc.strerror})"
    if digest != module.sha256:
        problems.append(
            problem(
                Code.KERNEL_BUNDLE_LIBRARY,
                file=library,
                want=module.sha256[:16],
                digest=digest[:16],
            )
        )
    if problems:
        raise BundleError(problems)
    return manifest, library


def write(root: Path, manifest: Manifest) -> Path:
    """Write the manifest last, atomically: a bundle without one is never loaded."""
    root.mkdir(parents=True, exist_ok=True)
    tmp = root / f".{MANIFEST}.tmp"
    tmp.write_text(manifest.to_json())
    tmp.replace(root / MANIFEST)
    return root / MANIFEST
