"""kimi-w31: Kimi-K3 MXFP4 checkpoints in the fused [up; gate] expert layout."""

from pathlib import Path

__version__ = "0.1.0"

# Installed, kimi_w31's subpackages (converter, adapter, manifests) live inside this folder.
# In a clone they are the tree's top-level folders (pyproject's package-dir), and a Python
# started in the clone (`python -m sglang.launch_server`, which `kimi-convert serve` runs)
# finds this folder first on sys.path, shadowing the installed package: without this, its
# `kimi_w31.adapter` would not exist there. The tree's own subpackages are then used.
_here = Path(__file__).resolve().parent
if not (_here / "adapter").is_dir() and (_here.parent / "adapter" / "sglang").is_dir():
    __path__.append(str(_here.parent))  # noqa: F821 (a package's __path__)
