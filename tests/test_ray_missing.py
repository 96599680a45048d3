"""Without Ray installed, --executor ray stops at once with how to install it."""

from __future__ import annotations

import os

from cli_helpers import run_cli

ARGS = ["--manifest", "kimi-k3-any", "--max-shard-size", "600000"]


def test_without_ray_the_message_says_how_to_install_it(small_source, tmp_path):
    # A Python that cannot import ray: a stub package that fails to import shadows it.
    stub = tmp_path / "stub" / "ray"
    stub.mkdir(parents=True)
    (stub / "__init__.py").write_text("raise ModuleNotFoundError('No module named ray')\n")
    env = {**os.environ, "PYTHONPATH": str(tmp_path / "stub")}
    r = run_cli(small_source, tmp_path / "out", *ARGS, "--executor", "ray", env=env)
    assert r.returncode == 2
    assert "needs Ray" in r.stderr and "pip install ray" in r.stderr
    assert "shards" not in r.stderr  # refused before any work started
    assert "Traceback" not in r.stderr
