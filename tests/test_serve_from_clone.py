"""A Python started inside a clone (the server `kimi-convert serve` runs is one: `python -m
sglang.launch_server` puts the working directory first on sys.path) finds the tree's
`kimi_w31/` before the installed package; the plugin's entry point must still import."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# -S: no site-packages, so no installed or editable kimi_w31 can help; only the tree.
PROBE = "import kimi_w31.adapter.sglang.plugin as p, kimi_w31.manifests; print(p.__file__)"


def _run(cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-S", "-c", PROBE], cwd=cwd, capture_output=True, text=True, timeout=60
    )


def test_the_plugin_entry_point_imports_from_the_clones_root():
    got = _run(ROOT)
    assert got.returncode == 0, got.stderr
    assert Path(got.stdout.strip()) == ROOT / "adapter" / "sglang" / "plugin.py"


def test_a_lone_kimi_w31_folder_does_not_borrow_a_tree(tmp_path):
    """Negative control: the rule engages only beside the tree's own folders."""
    shutil.copytree(ROOT / "kimi_w31", tmp_path / "kimi_w31")
    got = _run(tmp_path)
    assert got.returncode != 0 and "kimi_w31.adapter" in got.stderr
