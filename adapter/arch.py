"""The GPU architectures the plugin's SiTU CUTLASS MoE serves, in one place: their names,
the compute capabilities they are, and the CUDA arch list a build for each one uses."""

from __future__ import annotations

from typing import Literal

Arch = Literal["sm90", "sm120"]
ARCHES: tuple[Arch, ...] = ("sm90", "sm120")
# What prebuild passes as TORCH_CUDA_ARCH_LIST, and what a GPU of that arch picks by itself.
CUDA_ARCH_LIST: dict[str, str] = {"sm90": "9.0a", "sm120": "12.0"}


def arch_name(major: int, minor: int) -> str:
    """A compute capability's arch name: one of ARCHES where it is one (SM90 is 9.0 only;
    every 12.x is SM120), else "smXY" for what the plugin does not serve."""
    if (major, minor) == (9, 0):
        return "sm90"
    return "sm120" if major == 12 else f"sm{major}{minor}"


def is_served(arch: str) -> bool:
    return arch in ARCHES
