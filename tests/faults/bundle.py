"""A hostile kernel bundle, for the fault table and the tests: what a serving process does
with it (`bundle.check`, the plugin's pre-flight). Every case must be refused with its
reason code, quickly (a FIFO or a device never blocks the check), or, for a library swapped
after the check, load the bytes that were checked.
"""

from __future__ import annotations

import dataclasses
import os
import stat
import threading
from collections.abc import Callable
from pathlib import Path

from kimi_w31.adapter import bundle as B
from kimi_w31.adapter.reasons import AdapterCode
from kimi_w31.converter.reasons import Code

from .core import CLEAN, CORRECT, CRASH, WRONG, Case

FAULT = "kernel bundle (serving)"
STACK = B.Stack(
    arch="sm90",
    flashinfer="0.7.2.post1",
    cuda="13.0",
    torch="2.11.0",
    python="3.12",
    machine="x86_64",
    libc="glibc 2.35",
    abi="cpython-312-x86_64-linux-gnu",
)
LIB = "fused_moe_90_kimi_w31_w4a16.so"
TIMEOUT_S = 10.0


def make_bundle(root: Path, stack: B.Stack = STACK) -> Path:
    root.mkdir(parents=True)
    root.chmod(0o755)
    lib = root / LIB
    lib.write_bytes(b"\x7fELF" + b"w4a16" * 200)
    lib.chmod(0o644)
    module = B.Module("w4a16", lib.stem, LIB, B.sha256_file(lib), lib.stat().st_size, "h", 1)
    B.write(root, B.BundleManifest(stack, (module,), "0.1.0", ""))
    return root


def _replace(path: Path, make: Callable[[Path], None]) -> None:
    path.unlink()
    make(path)


def _other_stack(field: str, value: str) -> Callable[[Path], None]:
    def mutate(root: Path) -> None:
        B.write(root, dataclasses.replace(_manifest(root), stack=_stack(root, field, value)))

    return mutate


def _manifest(root: Path) -> B.BundleManifest:
    return B.BundleManifest.from_json((root / B.MANIFEST).read_text())


def _stack(root: Path, field: str, value: str) -> B.Stack:
    return dataclasses.replace(_manifest(root).stack, **{field: value})


def _chown(which: str) -> Callable[[Path], None]:
    return lambda root: os.chown(root if which == "." else root / which, 4242, 4242)


# (name, mutation of a good bundle, the code that must refuse it)
CASES: list[tuple[str, Callable[[Path], None], Code]] = [
    (
        "built on another CPU (aarch64)",
        _other_stack("machine", "aarch64"),
        AdapterCode.KERNEL_BUNDLE_CPU,
    ),
    (
        "built against a newer glibc",
        _other_stack("libc", "glibc 2.39"),
        AdapterCode.KERNEL_BUNDLE_LIBC,
    ),
    (
        "another Python ABI",
        _other_stack("abi", "cpython-313-x86_64-linux-gnu"),
        AdapterCode.KERNEL_BUNDLE_PYTHON_ABI,
    ),
    (
        "another FlashInfer",
        _other_stack("flashinfer", "0.6.18"),
        AdapterCode.KERNEL_BUNDLE_FLASHINFER,
    ),
    ("another CUDA", _other_stack("cuda", "12.8"), AdapterCode.KERNEL_BUNDLE_CUDA),
    (
        "directory missing",
        lambda root: root.rename(root.with_name("moved")),
        AdapterCode.KERNEL_BUNDLE_MISSING,
    ),
    (
        "manifest FIFO",
        lambda r: _replace(r / B.MANIFEST, os.mkfifo),
        AdapterCode.KERNEL_BUNDLE_NOT_REGULAR,
    ),
    ("library FIFO", lambda r: _replace(r / LIB, os.mkfifo), AdapterCode.KERNEL_BUNDLE_NOT_REGULAR),
    (
        "library -> /dev/zero",
        lambda r: _replace(r / LIB, lambda p: p.symlink_to("/dev/zero")),
        AdapterCode.KERNEL_BUNDLE_LINK,
    ),
    (
        "manifest -> a valid one outside",
        lambda r: _link_out(r, B.MANIFEST),
        AdapterCode.KERNEL_BUNDLE_LINK,
    ),
    ("library -> a valid one outside", lambda r: _link_out(r, LIB), AdapterCode.KERNEL_BUNDLE_LINK),
    ("directory group-writable", lambda r: r.chmod(0o775), AdapterCode.KERNEL_BUNDLE_WRITABLE),
    (
        "manifest writable by others",
        lambda r: (r / B.MANIFEST).chmod(0o646),
        AdapterCode.KERNEL_BUNDLE_WRITABLE,
    ),
    (
        "library group-writable",
        lambda r: (r / LIB).chmod(0o664),
        AdapterCode.KERNEL_BUNDLE_WRITABLE,
    ),
    (
        "library damaged",
        lambda r: (r / LIB).write_bytes(b"\x7fELF other"),
        AdapterCode.KERNEL_BUNDLE_LIBRARY,
    ),
    ("manifest of the first format", lambda r: _old_format(r), AdapterCode.KERNEL_BUNDLE_INVALID),
]
ROOT_CASES: list[tuple[str, Callable[[Path], None], Code]] = [
    ("directory owned by another user", _chown("."), AdapterCode.KERNEL_BUNDLE_OWNER),
    ("manifest owned by another user", _chown(B.MANIFEST), AdapterCode.KERNEL_BUNDLE_OWNER),
    ("library owned by another user", _chown(LIB), AdapterCode.KERNEL_BUNDLE_OWNER),
    (
        "library a device node (1,5: /dev/zero)",
        lambda r: _replace(r / LIB, lambda p: os.mknod(p, 0o644 | stat.S_IFCHR, os.makedev(1, 5))),
        AdapterCode.KERNEL_BUNDLE_NOT_REGULAR,
    ),
]


def _link_out(root: Path, name: str) -> None:
    elsewhere = make_bundle(root.parent / f"elsewhere-{name}")
    _replace(root / name, lambda p: p.symlink_to(elsewhere / name))


def _old_format(root: Path) -> None:
    text = (root / B.MANIFEST).read_text().replace(B.FORMAT, "kimi-w31-kernels/1")
    (root / B.MANIFEST).write_text(text)


def _judge(root: Path, want: Code) -> tuple[str, str]:
    """Run the serving process's check in a thread: refused with `want`, quickly?"""
    result: list = []

    def run() -> None:
        try:
            B.check(root, "w4a16", STACK, "h")[1].close()
            result.append(None)
        except BaseException as exc:  # judged below: a BundleError or a crash
            result.append(exc)

    worker = threading.Thread(target=run, daemon=True)
    worker.start()
    worker.join(TIMEOUT_S)
    if worker.is_alive():
        return CRASH, f"the check blocked for {TIMEOUT_S:.0f} s"
    (exc,) = result
    if exc is None:
        return WRONG, "accepted"
    if not isinstance(exc, B.BundleError):
        return CRASH, f"{type(exc).__name__}: {exc}"
    if want not in exc.error.codes:
        return CRASH, f"refused, but with {[c.value for c in exc.error.codes]}, not {want.value}"
    return CLEAN, f"[{want.value}] {exc.problems[exc.error.codes.index(want)].what}"


def _swapped_after_check(root: Path) -> tuple[str, str]:
    """The library replaced at its path between check and load: the load reads the bytes
    that were checked."""
    checked = (root / LIB).read_bytes()
    _, lib = B.check(root, "w4a16", STACK, "h")
    (root / "evil").write_bytes(b"\x7fELF evil")
    os.replace(root / "evil", root / LIB)
    try:
        with lib.loadable() as path:
            loaded = Path(path).read_bytes()
    finally:
        lib.close()
    if loaded != checked:
        return WRONG, "the swapped-in library would be loaded"
    return CORRECT, "the loader reads the checked descriptor's bytes"


def bundle_cases(_template: Path, tmp: Path) -> list[Case]:
    """Every case in its own bundle under `tmp` (the table's signature: no source used)."""
    cases: list[Case] = []
    table = CASES + (ROOT_CASES if os.geteuid() == 0 else [])
    for i, (name, mutate, want) in enumerate(table):
        root = make_bundle(tmp / f"b{i}")
        mutate(root)
        cases.append(Case(FAULT, name, *_judge(root, want)))
    cases.append(
        Case(
            FAULT,
            "library swapped after the check",
            *_swapped_after_check(make_bundle(tmp / "swap")),
        )
    )
    return cases
