"""A long job says before it starts whether it can succeed and how long it will take, and
a scripted run keeps its progress: --dry-run's space check and estimate, --json's progress."""

from __future__ import annotations

import json

import pytest
from cli_helpers import run_cli
from hypothesis import given
from hypothesis import strategies as st
from kimi_w31.converter.cli import console
from kimi_w31.converter.execute.estimate import estimate

ANY = ["--manifest", "kimi-k3-any", "--max-shard-size", "600000"]


def test_dry_run_json_says_the_space_it_checked_and_the_estimate(small_source, tmp_path):
    got = run_cli([small_source, tmp_path / "out", *ANY, "--dry-run", "--json"])
    assert got.returncode == 0, got.stderr
    report = json.loads(got.stdout)
    assert report["space_ok"] is True
    assert 0 < report["space_needed_bytes"] == report["output_bytes"] <= report["free_bytes"]
    assert report["estimate_seconds"] > 0 and report["estimate_rate_bytes_s"] > 0
    assert "measured" in report["estimate_basis"]
    assert not (tmp_path / "out").exists()  # a dry run writes nothing


def test_the_estimate_is_the_bytes_over_the_measured_rate(small_source):
    shards = sorted(p.name for p in small_source.glob("*.safetensors"))
    got = estimate(10**9, small_source, shards)
    assert got.rate and got.seconds == pytest.approx(10**9 / got.rate)
    assert estimate(0, small_source, shards).seconds == 0


def test_without_a_shard_on_disk_nothing_is_estimated(tmp_path):
    got = estimate(10**12, tmp_path, ["model-00001-of-00002.safetensors"])
    assert got.seconds is None and got.rate is None and "not measured" in got.basis


@given(
    mode=st.sampled_from(console.PROGRESS_MODES),
    quiet=st.booleans(),
    as_json=st.booleans(),
    shared=st.booleans(),
)
def test_progress_mode_with_json(mode, quiet, as_json, shared):
    got = console.resolve_mode(mode, quiet, as_json, shared=lambda: shared)
    if quiet:
        assert got == "none"
    elif mode != "auto":
        assert got == mode  # asked for: kept, --json or not (it is on stderr)
    elif as_json and shared:
        assert got == "none"  # would interleave with the JSON
    else:
        assert got in ("bar", "lines")


@pytest.mark.parametrize("asked", [["--progress", "lines"], []])
def test_json_keeps_progress_on_stderr(small_source, tmp_path, asked):
    got = run_cli(
        [small_source, tmp_path / "out", *ANY, "--json", *asked],
        env={console.LINE_INTERVAL_ENV: "0.05"},
    )
    assert got.returncode == 0, got.stderr
    assert json.loads(got.stdout)["ok"] is True  # stdout: the JSON alone
    assert any(line.startswith("convert: ") for line in got.stderr.splitlines())


def test_json_on_the_same_stream_shows_no_progress_by_default(small_source, tmp_path):
    import subprocess

    from cli_helpers import cli_argv, cli_env

    proc = subprocess.run(
        cli_argv([str(small_source), str(tmp_path / "out"), *ANY, "--json"], None),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        env=cli_env({console.LINE_INTERVAL_ENV: "0.05"}),
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stdout
    assert json.loads(proc.stdout)["ok"] is True  # nothing interleaved


def test_the_summary_throughput_is_the_progress_lines(small_source, tmp_path):
    got = run_cli(
        [small_source, tmp_path / "out", *ANY, "--json", "--progress", "lines"],
        env={console.LINE_INTERVAL_ENV: "0.05"},
    )
    assert got.returncode == 0, got.stderr
    rate = json.loads(got.stdout)["throughput_bytes_s"]
    last = [x for x in got.stderr.splitlines() if x.startswith("convert: ")][-1]
    assert f", {console.human(rate)}/s," in last
