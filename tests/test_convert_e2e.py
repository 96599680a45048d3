"""End to end on synthetic checkpoints: the output obeys the data contract byte for byte."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
from cli_helpers import run_cli
from kimi_w31.converter.contract import STATE_DIR, unwrap_config
from kimi_w31.converter.output import verified
from kimi_w31.converter.synth import EXTRA_FILES, SynthSpec
from safetensors import safe_open

SPEC = SynthSpec()  # what the session fixtures synthesize (tests/conftest.py)
FUSED = len(SPEC.moe_layers()) * SPEC.experts  # experts fused


def _raw_tensors(root) -> dict[str, bytes]:
    """Raw bytes per tensor, read with nothing but the file format's definition (an 8-byte
    length, a JSON header, the data), independent of the converter's own reader."""
    index = json.loads((root / "model.safetensors.index.json").read_text())
    raw = {}
    for shard in sorted(set(index["weight_map"].values())):
        data = (root / shard).read_bytes()
        n = int.from_bytes(data[:8], "little")
        for name, entry in json.loads(data[8 : 8 + n]).items():
            if name != "__metadata__":
                begin, end = entry["data_offsets"]
                raw[name] = data[8 + n + begin : 8 + n + end]
    return raw


def test_w31_is_up_then_gate_and_everything_else_identical(small_source, converted):
    src, out = _raw_tensors(small_source), _raw_tensors(converted)
    fused = 0
    for name, data in src.items():
        if ".experts." in name and (".w1." in name or ".w3." in name) and "shared" not in name:
            assert name not in out, f"{name} must not remain after conversion"
            if ".w3." in name:
                w31 = name.replace(".w3.", ".w31.")
                assert out[w31] == data + src[name.replace(".w3.", ".w1.")]
                fused += 1
        else:
            assert out[name] == data, name
    assert fused == FUSED * 2  # experts x (packed, scale)
    assert set(out) == {
        n
        for n in src
        if not (".experts." in n and (".w1." in n or ".w3." in n) and "shared" not in n)
    } | {
        n.replace(".w3.", ".w31.")
        for n in src
        if ".experts." in n and ".w3." in n and "shared" not in n
    }


def test_w31_shapes_and_dtypes(converted):
    count = 0
    for shard in converted.glob("*.safetensors"):
        with safe_open(str(shard), framework="np") as fh:
            for n in [n for n in fh.keys() if ".w31." in n]:  # noqa: SIM118
                s = fh.get_slice(n)
                assert s.get_dtype() == "U8"
                want = (
                    [128, 64] if n.endswith("weight_packed") else [128, 4]
                )  # [2N, K/2], [2N, K/32]
                assert s.get_shape() == want
                count += 1
    assert count == FUSED * 2


def test_index_covers_every_tensor_once_with_right_total_size(converted):
    index = json.loads((converted / "model.safetensors.index.json").read_text())
    seen: dict[str, str] = {}
    total = 0
    shards = sorted(p.name for p in converted.glob("*.safetensors"))
    assert shards == sorted(set(index["weight_map"].values()))
    for shard in shards:
        with safe_open(str(converted / shard), framework="np") as fh:
            for name in fh.keys():  # noqa: SIM118
                assert name not in seen, f"{name} in {shard} and {seen.get(name)}"
                seen[name] = shard
                sl = fh.get_slice(name)
                bits = {"U8": 8, "BF16": 16, "F32": 32}[sl.get_dtype()]
                total += int(np.prod(sl.get_shape())) * bits // 8
    assert seen == index["weight_map"]
    assert index["metadata"]["total_size"] == total


def test_config_changed_exactly_as_the_contract_says(small_source, converted):
    src = json.loads((small_source / "config.json").read_text())
    out = json.loads((converted / "config.json").read_text())
    block = out["kimi_w31"]
    # The contract's eight fields, spelled out here rather than taken from the code under test.
    for key, want in {
        "format_version": 1,
        "fc1_layout": "w31",
        "fc1_order": ["up", "gate"],
        "activation": "situ",
        "situ_beta": 4.0,
        "situ_linear_beta": 25.0,
        "weight_format": "mxfp4",
        "group_size": 32,
    }.items():
        assert block[key] == want, key
    # Published: the one quantization_config is inside text_config, and only there.
    assert "quantization_config" not in src and "quantization_config" not in out
    assert out["text_config"]["quantization_config"] == {
        "quant_method": "kimi_w31",
        "base": src["text_config"]["quantization_config"],
    }
    assert unwrap_config(out) == src  # nothing else changed


def test_extra_files_copied_unchanged(small_source, converted):
    for name in EXTRA_FILES:  # a file in a subfolder too (assets/kimi-logo.png)
        if name.startswith("."):  # a hidden path is not part of a checkpoint
            assert not (converted / name).exists()
            continue
        assert (converted / name).read_bytes() == (small_source / name).read_bytes()
    # no state left after a complete run (a later verify of it may leave only its record)
    left = [p.name for p in (converted / STATE_DIR).glob("*")]
    assert left in ([], [verified.RECORD_NAME])


def test_output_shards_respect_max_size_and_hf_names(converted):
    shards = sorted(converted.glob("*.safetensors"))
    n = len(shards)
    assert n > 2
    assert [p.name for p in shards] == [
        f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)
    ]
    # a shard may exceed the limit only when a single tensor does; none does here
    assert all(p.stat().st_size <= 600_000 + 20_000 for p in shards)
    assert all(oct(p.stat().st_mode & 0o777) == "0o644" for p in shards)


def test_single_file_source(tmp_path, small_source):
    from kimi_w31.converter.synth import synth_checkpoint

    src = tmp_path / "single"
    synth_checkpoint(src, SynthSpec(layers=2, experts=4, shards=1))
    # turn it into a plain model.safetensors repo (no index)
    (only,) = src.glob("*.safetensors")
    only.rename(src / "model.safetensors")
    (src / "model.safetensors.index.json").unlink()
    proc = run_cli([src, tmp_path / "out", "--manifest", "kimi-k3-any", "--json"])
    assert proc.returncode == 0, proc.stderr
    assert proc.json["experts_fused"] == 4


def test_dry_run_writes_nothing(small_source, tmp_path):
    proc = run_cli(
        [small_source, tmp_path / "out", "--manifest", "kimi-k3-any", "--dry-run", "--json"]
    )
    assert proc.returncode == 0, proc.stderr
    summary = proc.json
    assert summary["output_bytes"] > 0 and summary["experts_fused"] == FUSED
    assert summary["source"] == str(small_source.resolve())  # JSON paths are absolute
    assert summary["output"] == str((tmp_path / "out").resolve())
    assert not (tmp_path / "out").exists()


def test_repo_id_from_local_hf_cache(small_source, tmp_path, monkeypatch):
    cache = tmp_path / "hub"
    snap = cache / "models--org--tiny-k3" / "snapshots" / ("a" * 40)
    blobs = cache / "models--org--tiny-k3" / "blobs"
    blobs.mkdir(parents=True)
    snap.mkdir(parents=True)
    for f in (f for f in small_source.rglob("*") if f.is_file()):
        rel = f.relative_to(small_source)
        blob = blobs / str(rel).replace("/", "--")
        blob.write_bytes(f.read_bytes())
        (snap / rel).parent.mkdir(parents=True, exist_ok=True)
        os.symlink(os.path.relpath(blob, (snap / rel).parent), snap / rel)
    (cache / "models--org--tiny-k3" / "refs").mkdir()
    (cache / "models--org--tiny-k3" / "refs" / "main").write_text("a" * 40)
    env = {"HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "1"}
    proc = run_cli(["org/tiny-k3", tmp_path / "out", "--manifest", "kimi-k3-any", "-q"], env=env)
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "out" / "model.safetensors.index.json").exists()
    missing = run_cli(["org/not-there", tmp_path / "o2", "--json"], env=env)
    assert missing.returncode == 1
    assert missing.problems[0]["code"] == "source-not-in-cache"


@pytest.mark.parametrize("workers", [1, 3])
def test_output_independent_of_worker_count(small_source, converted, tmp_path, workers):
    out = tmp_path / "o"
    proc = run_cli(
        [
            small_source,
            out,
            "--manifest",
            "kimi-k3-any",
            "--max-shard-size",
            "600000",
            "--workers",
            workers,
            "-q",
        ],
    )
    assert proc.returncode == 0, proc.stderr
    for p in converted.iterdir():
        if p.is_file():
            assert (out / p.name).read_bytes() == p.read_bytes(), p.name


@pytest.mark.parametrize("gone", ["deleted", "dangling"])
def test_a_partial_hf_cache_names_the_snapshot_and_the_download(small_source, tmp_path, gone):
    """A download that did not finish leaves a snapshot without some shards (or links to
    blobs never written): said as that, with the snapshot and the command that finishes it."""
    cache = tmp_path / "hub"
    snap = cache / "models--org--tiny-k3" / "snapshots" / ("b" * 40)
    blobs = cache / "models--org--tiny-k3" / "blobs"
    blobs.mkdir(parents=True)
    snap.mkdir(parents=True)
    for f in small_source.iterdir():
        if not f.is_file():  # assets/: the test needs the top-level files only
            continue
        blob = blobs / f.name
        blob.write_bytes(f.read_bytes())
        os.symlink(os.path.relpath(blob, snap), snap / f.name)
    (cache / "models--org--tiny-k3" / "refs").mkdir()
    (cache / "models--org--tiny-k3" / "refs" / "main").write_text("b" * 40)
    shard = sorted(snap.glob("*.safetensors"))[-1]
    (shard if gone == "deleted" else blobs / shard.name).unlink()
    env = {"HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "1"}
    for args in (
        ["org/tiny-k3", tmp_path / "out"],
        ["verify", tmp_path / "x", "--source", "org/tiny-k3"],
    ):
        proc = run_cli([*args, "--manifest", "kimi-k3-any", "--json"], env=env)
        assert proc.returncode == 1, proc.stderr
        (problem,) = proc.problems
        assert problem["code"] == "shard-missing" and problem["file"] == shard.name
        assert str(snap) in problem["what"] and "hf download org/tiny-k3" in proc.json["hint"]
    assert not (tmp_path / "out").exists()
