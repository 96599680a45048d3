"""Without Ray installed, --executor ray stops at once with how to install it."""

from __future__ import annotations

from cli_helpers import run_cli

ARGS = ["--manifest", "kimi-k3-any", "--max-shard-size", "600000"]


def test_without_ray_the_message_says_how_to_install_it(small_source, tmp_path):
    # A Python that cannot import ray: a stub package that fails to import shadows it.
    stub = tmp_path / "stub" / "ray"
    stub.mkdir(parents=True)
    (stub / "__init__.py").write_text("raise ModuleNotFoundError('No module named ray')\n")
    env = {"PYTHONPATH": str(tmp_path / "stub")}
    r = run_cli([small_source, tmp_path / "out", *ARGS, "--executor", "ray", "--json"], env=env)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert r.codes == ["usage"]
    assert not (tmp_path / "out").exists()  # refused before any work started
