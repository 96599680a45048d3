"""Resume: an interrupted run, rerun, gives byte-identical output; corrupt shards are redone.

These interrupt the converter in-process at chosen points; the SIGKILL-at-any-moment harness
with many kill points lives in the fault suite.
"""

from __future__ import annotations

import json

import pytest
from cli_helpers import run_cli
from kimi_w31.converter import convert as convert_mod
from kimi_w31.converter import execute
from kimi_w31.converter.convert import ConvertOptions, convert

ARGS = ["--manifest", "kimi-k3-any", "--max-shard-size", "600000", "--workers", "1"]


def _opts(src, out):
    return ConvertOptions(str(src), out, manifest="kimi-k3-any", max_shard_size=600_000, workers=1)


def _files(root):
    return {p.name: p.read_bytes() for p in root.iterdir() if p.is_file()}


def test_interrupt_midway_then_resume_is_byte_identical(small_source, converted, tmp_path,
                                                        monkeypatch):  # fmt: skip
    out = tmp_path / "out"
    real = execute.write_shard
    calls = {"n": 0}

    def interrupted_after_two(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 3:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(execute, "write_shard", interrupted_after_two)
    with pytest.raises(KeyboardInterrupt):
        convert(_opts(small_source, out))
    monkeypatch.undo()
    assert not (out / "model.safetensors.index.json").exists()  # interrupted never looks done
    assert len(list(out.glob("*.safetensors"))) == 2

    result = run_cli(small_source, out, *ARGS, "--json")
    assert result.returncode == 0, result.stderr
    summary = json.loads(result.stdout)
    assert summary["shards_reused"] == 2 and summary["shards_written"] == 4
    assert _files(out) == _files(converted)


def test_corrupted_finished_shard_is_detected_and_redone(small_source, converted, tmp_path,
                                                         monkeypatch):  # fmt: skip
    out = tmp_path / "out"

    def crash(*args, **kwargs):
        raise KeyboardInterrupt  # as if killed right before the index was written

    monkeypatch.setattr(convert_mod, "_finalize", crash)
    with pytest.raises(KeyboardInterrupt):
        convert(_opts(small_source, out))
    monkeypatch.undo()
    shard = out / "model-00002-of-00006.safetensors"
    data = bytearray(shard.read_bytes())
    data[-10] ^= 0xFF
    shard.write_bytes(bytes(data))
    (out / "model-00004-of-00006.safetensors").unlink()

    result = run_cli(small_source, out, *ARGS, "--json")
    assert result.returncode == 0, result.stderr
    summary = json.loads(result.stdout)
    assert summary["shards_written"] == 2 and summary["shards_reused"] == 4
    assert _files(out) == _files(converted)


def test_rerun_on_complete_output_is_a_no_op(small_source, converted):
    result = run_cli(small_source, converted, *ARGS, "--json")
    assert result.returncode == 0
    assert json.loads(result.stdout)["already_complete"] is True
