"""Hub streaming through the real `huggingface_hub` client against a loopback fake Hub.

The server (tests/hub_server.py) serves a synthetic six-shard repo the way the Hub's file
endpoints do; `HF_ENDPOINT` points the client at it and the cache lives in tmp. Every run is
the real CLI in a subprocess. The reference is a plain local conversion of the same files.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from cli_helpers import run_cli
from hub_server import FakeHub
from kimi_w31.converter.convert import ConvertOptions, convert
from kimi_w31.converter.hub import download_order, estimate
from kimi_w31.converter.manifest import load_manifest
from kimi_w31.converter.plan import plan_conversion
from kimi_w31.converter.source import read_source
from kimi_w31.converter.synth import SynthSpec, synth_checkpoint

REPO = "org/kimi-synth"
SHARD_SIZE = "600000"
ARGS = ["--manifest", "kimi-k3-any", "--max-shard-size", SHARD_SIZE]
SHARDS = [f"model-0000{i}-of-00006.safetensors" for i in range(1, 7)]


@pytest.fixture(scope="module")
def hub_source(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("hubsrc") / "repo"
    synth_checkpoint(root, SynthSpec(layers=3, experts=8, shards=6))
    assert sorted(p.name for p in root.glob("*.safetensors")) == SHARDS
    return root


@pytest.fixture(scope="module")
def reference(hub_source, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("hubref") / "out"
    convert(ConvertOptions(str(hub_source), out, manifest="kimi-k3-any",
                           max_shard_size=int(SHARD_SIZE)))  # fmt: skip
    return out


@pytest.fixture
def hub(hub_source):
    with FakeHub({REPO: hub_source}) as server:
        yield server


def _env(hub: FakeHub, tmp: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("HF_")}
    env.update(HF_ENDPOINT=hub.endpoint, HF_HOME=str(tmp / "hf_home"),
               HF_HUB_CACHE=str(tmp / "hf_cache"), HF_HUB_DISABLE_TELEMETRY="1",
               **extra)  # fmt: skip
    return env


def _convert(hub: FakeHub, tmp: Path, out: Path, *args: str, **env: str):
    return run_cli(REPO, out, "--download", *ARGS, *args, env=_env(hub, tmp, **env))


def _files(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in root.rglob("*") if p.is_file()}


def _assert_same_as_reference(out: Path, reference: Path) -> None:
    """Byte-identical, except that config.json names its source as the user typed it."""
    got, want = _files(out), _files(reference)
    assert sorted(got) == sorted(want)
    for name in want:
        if name not in ("config.json", "kimi_w31.checksums.json"):
            assert got[name] == want[name], name
    sums_got, sums_want = (
        json.loads(got["kimi_w31.checksums.json"]),
        json.loads(want["kimi_w31.checksums.json"]),
    )
    assert sums_got["files"].pop("config.json") != sums_want["files"].pop("config.json")
    assert sums_got == sums_want  # per-tensor checksums and the plan fingerprint agree
    cfg_got, cfg_want = json.loads(got["config.json"]), json.loads(want["config.json"])
    assert cfg_got["kimi_w31"]["source"]["path"] == REPO
    cfg_got["kimi_w31"]["source"].pop("path")
    cfg_want["kimi_w31"]["source"].pop("path")
    assert cfg_got == cfg_want


def _cached_shards(tmp: Path) -> list[Path]:
    """Source shard bytes still on disk in the HF cache (blobs larger than any small file)."""
    blobs = tmp / "hf_cache" / "models--org--kimi-synth" / "blobs"
    return [p for p in blobs.iterdir() if p.stat().st_size > 100_000] if blobs.exists() else []


def test_streamed_conversion_with_deletion_matches_local_and_bounds_disk(
    hub, hub_source, reference, tmp_path
):
    out = tmp_path / "out"
    r = _convert(hub, tmp_path, out, "--delete-source-shards", "--max-source-window", "3",
                 "--json")  # fmt: skip
    assert r.returncode == 0, r.stderr
    _assert_same_as_reference(out, reference)
    assert _cached_shards(tmp_path) == []  # every source shard deleted once consumed
    for shard in SHARDS:
        assert len(hub.downloads(shard)) == 1, shard  # each fetched exactly once
    h = json.loads(r.stdout)["hub"]
    source = sum(p.stat().st_size for p in hub_source.iterdir())
    output = sum(p.stat().st_size for p in out.iterdir())
    # The measured high-water mark of cache + output stays under the plan's bound and well
    # under keeping everything (source + output).
    assert 0 < h["peak_disk_measured"] <= h["peak_disk_bound"]
    assert h["peak_disk_measured"] < 0.8 * (source + output)
    print(
        f"peak disk {h['peak_disk_measured']} B vs source+output {source + output} B "
        f"(bound {h['peak_disk_bound']} B)"
    )


def test_without_deletion_the_cache_is_a_normal_snapshot_and_converts_identically(
    hub, reference, tmp_path
):
    out = tmp_path / "out"
    r = _convert(hub, tmp_path, out, "--json")
    assert r.returncode == 0, r.stderr
    _assert_same_as_reference(out, reference)
    assert len(_cached_shards(tmp_path)) == 6
    # The snapshot huggingface_hub left behind converts offline to the very same bytes,
    # config.json included (both runs name the source "org/kimi-synth").
    offline = tmp_path / "offline"
    r2 = run_cli(REPO, offline, *ARGS, env=_env(hub, tmp_path, HF_HUB_OFFLINE="1"))
    assert r2.returncode == 0, r2.stderr
    assert _files(offline) == _files(out)
    # Rerunning the download command on a complete output downloads nothing.
    before = len(hub.downloads())
    r3 = _convert(hub, tmp_path, out, "--json")
    assert r3.returncode == 0, r3.stderr
    assert json.loads(r3.stdout)["already_complete"] is True
    assert len(hub.downloads()) == before


def test_download_dir_instead_of_cache(hub, reference, tmp_path):
    out, dl = tmp_path / "out", tmp_path / "dl"
    r = _convert(hub, tmp_path, out, "--download-dir", str(dl), "--delete-source-shards")
    assert r.returncode == 0, r.stderr
    _assert_same_as_reference(out, reference)
    assert (dl / "config.json").is_file() and not list(dl.glob("*.safetensors"))
    meta = dl / ".cache" / "huggingface" / "download"
    assert not list(meta.glob("*.safetensors.metadata"))
    assert not (tmp_path / "hf_cache" / "models--org--kimi-synth").exists()


def test_manifest_check_happens_before_any_shard_is_downloaded(hub, tmp_path):
    out = tmp_path / "out"
    # The pinned official manifest rejects the scaled-down checkpoint, from headers alone.
    r = run_cli(REPO, out, "--download", "--max-shard-size", SHARD_SIZE,
                env=_env(hub, tmp_path))  # fmt: skip
    assert r.returncode == 1
    assert "kimi-k3-any" in r.stderr
    assert hub.downloads(None) and all(d.file not in SHARDS for d in hub.downloads())
    assert not out.exists()


def test_dry_run_prints_the_peak_and_downloads_nothing(hub, tmp_path):
    out = tmp_path / "out"
    r = _convert(hub, tmp_path, out, "--dry-run", "--delete-source-shards",
                 "--max-source-window", "3")  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert "peak disk (at most)" in r.stdout and "at least 3 needed" in r.stdout
    assert all(d.file not in SHARDS for d in hub.downloads())
    assert not out.exists()


def test_window_smaller_than_the_layout_needs_is_refused_before_downloading(hub, tmp_path):
    r = _convert(hub, tmp_path, tmp_path / "out", "--delete-source-shards",
                 "--max-source-window", "2")  # fmt: skip
    assert r.returncode == 2
    assert "--max-source-window is too small" in r.stderr and "at least 3" in r.stderr
    assert all(d.file not in SHARDS for d in hub.downloads())


def test_unknown_repo_and_revision_are_clear_errors(hub, tmp_path):
    r = run_cli("org/missing", tmp_path / "o1", "--download", *ARGS, env=_env(hub, tmp_path))
    assert r.returncode == 1 and "repository not found" in r.stderr
    r = _convert(hub, tmp_path, tmp_path / "o2", "--revision", "nope")
    assert r.returncode == 1 and "revision not found" in r.stderr
    r = run_cli(REPO, tmp_path / "o3", "--delete-source-shards", *ARGS,
                env=_env(hub, tmp_path))  # fmt: skip
    assert r.returncode == 2 and "only apply with --download" in r.stderr


def _completed(hub: FakeHub) -> set[str]:
    """Source shards whose download finished (the whole body was sent)."""
    sizes = {name: f.size for name, f in hub.files[REPO].items()}
    return {d.file for d in hub.downloads() if d.range is None and d.sent == sizes[d.file]}


def test_failed_download_midway_then_resume_completes_without_refetching(hub, reference,
                                                                         tmp_path):  # fmt: skip
    out = tmp_path / "out"
    hub.fail_download.add(SHARDS[3])  # HTTP 500 for every download of shard 4
    r = _convert(hub, tmp_path, out, "--delete-source-shards", "--max-source-window", "3",
                 "--workers", "1")  # fmt: skip
    assert r.returncode == 1
    assert SHARDS[3] in r.stderr and "download failed" in r.stderr and "rerun" in r.stderr
    assert "Traceback" not in r.stderr
    assert not (out / "model.safetensors.index.json").exists()
    first = _completed(hub)
    assert first and SHARDS[3] not in first
    hub.log.clear()
    hub.fail_download.clear()
    r = _convert(hub, tmp_path, out, "--delete-source-shards", "--max-source-window", "3",
                 "--json")  # fmt: skip
    assert r.returncode == 0, r.stderr
    summary = json.loads(r.stdout)
    assert summary["shards_reused"] >= 1
    _assert_same_as_reference(out, reference)
    assert not (first & _completed(hub)), "a finished source shard was downloaded again"
    assert _cached_shards(tmp_path) == []


def test_dropped_connection_is_retried_by_the_client(hub, reference, tmp_path):
    out = tmp_path / "out"
    hub.drop_once[SHARDS[4]] = 10_000
    r = _convert(hub, tmp_path, out, "--delete-source-shards", "--max-source-window", "3")
    assert r.returncode == 0, r.stderr
    _assert_same_as_reference(out, reference)
    # huggingface_hub retried the cut transfer (from the last whole 10 MB chunk it had kept:
    # byte 0 for a file this small) and the short body never reached the cache.
    sent = [d.sent for d in hub.downloads(SHARDS[4])]
    assert sent == [10_000, hub.files[REPO][SHARDS[4]].size]


def test_killed_run_resumes_without_downloading_finished_shards_again(hub, reference,
                                                                      tmp_path):  # fmt: skip
    out = tmp_path / "out"
    held = hub.hold[SHARDS[4]] = threading.Event()  # the run stalls on shard 5
    args = [sys.executable, "-m", "kimi_w31.converter", REPO, str(out), "--download", *ARGS,
            "--delete-source-shards", "--max-source-window", "3", "--workers", "1"]  # fmt: skip
    proc = subprocess.Popen(args, env=_env(hub, tmp_path), stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)  # fmt: skip
    ledger = out / ".kimi_w31" / "ledger.jsonl"
    deadline = time.monotonic() + 60
    try:
        while time.monotonic() < deadline:
            lines = ledger.read_text().splitlines() if ledger.exists() else []
            if len(lines) >= 3:  # the fingerprint and two finished shards
                break
            time.sleep(0.05)
        else:
            pytest.fail("the run did not get to two finished shards")
        time.sleep(0.3)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    held.set()
    del hub.hold[SHARDS[4]]
    assert not (out / "model.safetensors.index.json").exists()
    first = _completed(hub)
    assert len(first) >= 2
    hub.log.clear()
    r = _convert(hub, tmp_path, out, "--delete-source-shards", "--max-source-window", "3",
                 "--json")  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["shards_reused"] >= 2
    _assert_same_as_reference(out, reference)
    assert not (first & _completed(hub)), "a finished source shard was downloaded again"


# -- the schedule, on the plan alone ------------------------------------------------------------


def test_schedule_follows_the_plan_and_finds_the_smallest_window(hub_source):
    source = read_source(hub_source)
    plan = plan_conversion(source, load_manifest("kimi-k3-any"), int(SHARD_SIZE))
    order = download_order(plan.shards, source.shard_files)
    # synth moves one w3 into the last shard, so output shard 2 (which holds that w31) needs
    # source shard 6 right after 2 and 3; the rest follow in file order.
    assert set(plan.shards[1].source_files) == {SHARDS[1], SHARDS[2], SHARDS[5]}
    assert order == [SHARDS[0], SHARDS[1], SHARDS[2], SHARDS[5], SHARDS[3], SHARDS[4]]
    sizes = {f: source.headers[f].file_size for f in SHARDS}
    est = estimate(plan.shards, source.shard_files, sizes, 0, 3, delete=True)
    assert est.min_window == 3  # 2, 3 and 6 must be present together for output shard 2
    largest3 = sum(sorted(sizes.values())[-3:])
    assert est.peak_bound == plan.output_bytes + largest3
    keep = estimate(plan.shards, source.shard_files, sizes, 10, 3, delete=False)
    assert keep.peak_bound == plan.output_bytes + sum(sizes.values()) + 10
