"""Resume and rerun: "complete" is proven, never remembered.

An interrupted run, rerun, gives a byte-identical output; finished shards are kept only
once proven (file, size, header, source identity; data with --rehash); a rerun on a
finished output proves it again and repairs what fails. These stop the converter
in-process at chosen points; the SIGKILL-at-any-moment harness lives in the fault suite.
"""

from __future__ import annotations

import os
import shutil

import pytest
from cli_helpers import run_cli
from kimi_w31.converter.contract import STATE_DIR
from kimi_w31.converter.execute import shard as shard_mod
from kimi_w31.converter.output.directory import OutputDir
from kimi_w31.converter.pipeline import ConvertOptions, convert

ARGS = ["--manifest", "kimi-k3-any", "--max-shard-size", "600000", "--workers", "1"]
INDEX = "model.safetensors.index.json"


def _opts(src, out, **kw):
    return ConvertOptions(str(src), out, manifest="kimi-k3-any", max_shard_size=600_000, **kw)


def _files(root):
    return {p.name: p.read_bytes() for p in root.iterdir() if p.is_file()}


def _rerun(src, out, *extra) -> dict:
    result = run_cli([src, out, *ARGS, "--json", *extra])
    assert result.returncode == 0, result.stderr
    return result.json


def _shards(out) -> list:
    return sorted(out.glob("model-*.safetensors"))


def test_interrupt_midway_then_resume_is_byte_identical(
    small_source, converted, tmp_path, monkeypatch
):
    out = tmp_path / "out"
    real = shard_mod.write_shard
    calls = {"n": 0}

    def interrupted_after_two(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 3:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(shard_mod, "write_shard", interrupted_after_two)
    with pytest.raises(KeyboardInterrupt):
        convert(_opts(small_source, out))
    monkeypatch.undo()
    assert not (out / INDEX).exists()  # interrupted never looks done
    kept = _shards(out)
    assert len(kept) == 2

    summary = _rerun(small_source, out)
    total = len(_shards(converted))
    assert (summary["mode"], summary["shards_kept"], summary["shards_written"]) == (
        "resume",
        2,
        total - 2,
    )
    # Honest figures: what this run wrote, what it kept, and a speed of this run's bytes only.
    assert summary["bytes_kept"] == sum(p.stat().st_size for p in kept)
    assert summary["bytes_written"] == summary["output_bytes"] - summary["bytes_kept"]
    # The progress lines' figure: bytes this run moved over the time it moved them (the
    # shard phase, without finalizing), so at least the run's bytes over its whole time.
    rate = summary["throughput_bytes_s"]
    assert summary["throughput_mb_s"] == pytest.approx(rate / 1e6, abs=0.05)
    assert rate >= summary["bytes_written"] / summary["seconds"] * 0.95
    assert _files(out) == _files(converted)


def _interrupted_before_finalize(src, out, monkeypatch):
    def crash(self, files, before_index=None):
        raise KeyboardInterrupt  # as if killed right before the final files

    monkeypatch.setattr(OutputDir, "finalize", crash)
    with pytest.raises(KeyboardInterrupt):
        convert(_opts(src, out))
    monkeypatch.undo()


def test_a_deleted_finished_shard_is_redone(small_source, converted, tmp_path, monkeypatch):
    out = tmp_path / "out"
    _interrupted_before_finalize(small_source, out, monkeypatch)
    victim = _shards(out)[1]
    victim.unlink()
    summary = _rerun(small_source, out)
    assert list(summary["redone"]) == [victim.name]
    assert _files(out) == _files(converted)


def test_corrupt_data_is_found_with_rehash(small_source, converted, tmp_path, monkeypatch):
    out = tmp_path / "out"
    _interrupted_before_finalize(small_source, out, monkeypatch)
    victim = _shards(out)[1]
    data = bytearray(victim.read_bytes())
    data[-10] ^= 0xFF
    victim.write_bytes(bytes(data))
    dry = run_cli([small_source, out, *ARGS, "--json", "--dry-run", "--rehash"]).json
    assert dry["would_write"] == [victim.name]  # the dry run proves the same way
    summary = _rerun(small_source, out, "--rehash")
    assert list(summary["redone"]) == [victim.name]
    assert _files(out) == _files(converted)


def test_rerun_on_complete_output_proves_it_and_changes_nothing(small_source, converted):
    # (the state folder aside: a rerun removes any record a verify of it left there)
    before = {p.name: p.stat().st_mtime_ns for p in converted.iterdir() if p.name != STATE_DIR}
    summary = _rerun(small_source, converted)
    assert summary["already_complete"] is True and summary["mode"] == "recheck"
    assert summary["bytes_written"] == 0 and summary["files_rewritten"] == 0
    assert {p.name: p.stat().st_mtime_ns for p in converted.iterdir()} == before


@pytest.mark.parametrize("force", [[], ["--force"]])
def test_rerun_repairs_a_complete_output_missing_a_shard(
    small_source, converted, output_copy, force
):
    victim = _shards(output_copy)[2]
    victim.unlink()
    summary = _rerun(small_source, output_copy, *force)
    assert summary["already_complete"] is False
    assert victim.name in summary["redone"] or summary["shards_written"] == len(_shards(converted))
    assert _files(output_copy) == _files(converted)


@pytest.mark.parametrize("force", [[], ["--force"]])
def test_rerun_repairs_a_complete_output_missing_other_files(
    small_source, converted, output_copy, force
):
    (output_copy / "tokenizer_config.json").unlink()
    (output_copy / "config.json").write_text("{}")
    summary = _rerun(small_source, output_copy, *force)
    assert summary["already_complete"] is False and summary["files_rewritten"] >= 2
    assert _files(output_copy) == _files(converted)


def _rewrite_in_place_keeping_mtime(path, flip_at: int) -> None:
    """Change data bytes (not the header) through the same inode, then put the mtime back."""
    st = os.stat(path)
    with open(path, "r+b") as fh:
        fh.seek(flip_at)
        byte = fh.read(1)
        fh.seek(flip_at)
        fh.write(bytes([byte[0] ^ 0xFF]))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert os.stat(path).st_ino == st.st_ino and os.stat(path).st_mtime_ns == st.st_mtime_ns


def test_source_rewritten_in_place_under_a_complete_output(source_copy, tmp_path):
    out = tmp_path / "out"
    assert run_cli([source_copy, out, *ARGS, "-q"]).returncode == 0
    victim = sorted(source_copy.glob("*.safetensors"))[0]
    _rewrite_in_place_keeping_mtime(victim, victim.stat().st_size - 5)
    summary = _rerun(source_copy, out)
    assert summary["already_complete"] is False and summary["shards_written"] >= 1
    fresh = tmp_path / "fresh"
    assert run_cli([source_copy, fresh, *ARGS, "-q"]).returncode == 0
    assert _files(out) == _files(fresh)  # no old bytes mixed with new


def test_source_rewritten_in_place_between_interrupt_and_resume(source_copy, tmp_path, monkeypatch):
    out = tmp_path / "out"
    _interrupted_before_finalize(source_copy, out, monkeypatch)
    victim = sorted(source_copy.glob("*.safetensors"))[0]
    _rewrite_in_place_keeping_mtime(victim, victim.stat().st_size - 5)
    summary = _rerun(source_copy, out)
    assert summary["mode"] == "resume" and summary["redone"]
    assert all("source" in why for why in summary["redone"].values())
    fresh = tmp_path / "fresh"
    assert run_cli([source_copy, fresh, *ARGS, "-q"]).returncode == 0
    assert _files(out) == _files(fresh)


def test_dry_run_on_a_half_finished_output_says_what_would_be_kept(
    small_source, tmp_path, monkeypatch
):
    out = tmp_path / "out"
    _interrupted_before_finalize(small_source, out, monkeypatch)
    shards = _shards(out)
    shards[0].unlink()
    before = {p.name for p in out.rglob("*")}
    dry = run_cli([small_source, out, *ARGS, "--json", "--dry-run"]).json
    assert dry["would_write"] == [shards[0].name]
    assert sorted(dry["would_keep"]) == sorted(p.name for p in shards[1:])
    assert {p.name for p in out.rglob("*")} == before  # nothing written


def test_state_folder_removed_mid_run_gives_a_true_message(small_source, tmp_path, monkeypatch):
    out = tmp_path / "out"
    real = shard_mod.write_shard
    calls = {"n": 0}

    def lose_state(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 2:
            shutil.rmtree(OutputDir(out).state)
        return real(*args, **kwargs)

    monkeypatch.setattr(shard_mod, "write_shard", lose_state)
    from kimi_w31.converter.errors import Fatal
    from kimi_w31.converter.reasons import Code

    with pytest.raises(Fatal) as exc:
        convert(_opts(small_source, out))
    assert exc.value.codes == [Code.STATE_LOST]
    assert "rerun the same command" not in exc.value.hint
