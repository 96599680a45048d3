"""A slim `sgl_kernel` for the H200 machine: what SGLang's Marlin MoE route and server need.

The machine's torch is 2.11; SGLang 0.5.23 pins `sglang-kernel` 0.4.10 (torch 2.14). The
0.4.6 wheel declares torch 2.11.0 and loads there. Its 377 MB are almost all FlashAttention
3 (`flash_ops`, imported only lazily by SGLang), so the copy keeps the Python files, the
SM90 `common_ops` and `spatial_ops`, and leaves out every other compiled library and the
wheel's top-level `triton_kernels/` (SGLang carries its own).

    python -m gpu.slim_kernel WHEEL OUT.tar.xz
"""

from __future__ import annotations

import io
import sys
import tarfile
import zipfile
from pathlib import PurePosixPath

KEEP_LIBRARIES = frozenset({"sgl_kernel/sm90/common_ops.abi3.so", "sgl_kernel/spatial_ops.abi3.so"})


def keep(name: str) -> bool:
    """Whether the wheel member `name` goes into the slim copy."""
    path = PurePosixPath(name)
    top = path.parts[0] if path.parts else ""
    if name.endswith("/"):
        return False
    if top.endswith(".dist-info"):
        return True
    if top != "sgl_kernel":
        return False  # triton_kernels/ and anything else at the top level
    if path.suffix == ".so" or ".so." in path.name:
        return name in KEEP_LIBRARIES
    return True


def pack(wheel: str, out: str) -> list[str]:
    """Write the kept members of `wheel` to the tar.xz `out`; returns their names."""
    kept: list[str] = []
    with zipfile.ZipFile(wheel) as zf, tarfile.open(out, "w:xz") as tf:
        for info in zf.infolist():
            if not keep(info.filename):
                continue
            data = zf.read(info)
            member = tarfile.TarInfo(info.filename)
            member.size = len(data)
            member.mode = 0o644
            tf.addfile(member, io.BytesIO(data))
            kept.append(info.filename)
    missing = KEEP_LIBRARIES - set(kept)
    if missing:
        raise SystemExit(f"{wheel}: lacks {sorted(missing)}")
    return kept


if __name__ == "__main__":
    if len(sys.argv) != 3:
        raise SystemExit("usage: python -m gpu.slim_kernel WHEEL OUT.tar.xz")
    names = pack(sys.argv[1], sys.argv[2])
    print(f"{len(names)} files -> {sys.argv[2]}")
