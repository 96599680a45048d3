"""What is served is what was verified: `verify` records what it proved, a server compares.

A passing `verify --checksums` records the identity of every file of the checkpoint; the
load-time check (`verified.served_refusal`, stat calls only) refuses a checkpoint never
verified where it stands, or any file changed, added or removed since; a failing verify
removes the record. Each kind of change is generated over the checkpoint's own files.
"""

from __future__ import annotations

import json
import os
import shutil

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kimi_w31.converter.audit import verify
from kimi_w31.converter.contract import STATE_DIR
from kimi_w31.converter.output import records, verified
from kimi_w31.converter.pipeline import ConvertOptions, convert
from kimi_w31.converter.reasons import Code


def _codes(refusal) -> set[Code]:
    return set() if refusal is None else set(refusal.codes)


def _files(root) -> list[str]:
    return sorted(verified.identities(root))


def test_a_passing_checksums_verify_is_what_a_server_accepts(output_copy):
    assert _codes(verified.served_refusal(output_copy)) == {Code.NOT_VERIFIED}  # negative control
    report = verify(output_copy, checksums=True)
    assert report.ok and report.record == "recorded"
    assert verified.served_refusal(output_copy) is None
    proof = verified.read_proofs(output_copy)[0]
    assert set(proof.files) == set(_files(output_copy))  # every file of the checkpoint
    assert "checksums" in proof.levels
    for name, ident in proof.files.items():
        assert ident == records.file_identity(output_copy / name)


def test_a_structure_only_verify_records_nothing(output_copy):
    report = verify(output_copy)
    assert report.ok and report.record == ""
    assert not verified.record_path(output_copy).exists()
    assert _codes(verified.served_refusal(output_copy)) == {Code.NOT_VERIFIED}


def test_a_record_without_the_checksums_level_is_refused(output_copy):
    verify(output_copy, checksums=True)
    path = verified.record_path(output_copy)
    doc = json.loads(path.read_text())
    doc["proofs"][0]["levels"] = ["structure"]
    path.write_text(json.dumps(doc))
    refusal = verified.served_refusal(output_copy)
    assert _codes(refusal) == {Code.NOT_VERIFIED}


def _touch(path):
    st_ = path.stat()
    os.utime(path, ns=(st_.st_atime_ns, st_.st_mtime_ns + 1_000_000))


def _append(path):
    with open(path, "ab") as fh:
        fh.write(b"\0")


def _replace_same_bytes(path):
    # Same bytes, same size, same mtime: only the inode differs (a copy put in its place).
    tmp = path.with_name(path.name + ".tmp")
    shutil.copy2(path, tmp)
    os.replace(tmp, path)


def _edit_in_place_keep_mtime(path):
    # Same inode, same size, mtime set back: the ctime (no user can set it) still moves.
    st_ = path.stat()
    with open(path, "r+b") as fh:
        first = fh.read(1)
        fh.seek(0)
        fh.write(bytes([first[0] ^ 0xFF]) if first else b"")
    os.utime(path, ns=(st_.st_atime_ns, st_.st_mtime_ns))


CHANGES = {
    "edited in place, mtime set back": (_edit_in_place_keep_mtime, "changed"),
    "touched": (_touch, "changed"),
    "grown": (_append, "changed"),
    "replaced by a copy": (_replace_same_bytes, "changed"),
    "removed": (lambda p: p.unlink(), "removed"),
}


@settings(
    max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(data=st.data())
def test_any_change_to_any_file_is_refused(verified_output, data):
    root = verified_output
    name = data.draw(st.sampled_from(_files(root)), label="file")
    change = data.draw(st.sampled_from(sorted(CHANGES)), label="change")
    saved = root.parent / "saved"
    shutil.rmtree(saved, ignore_errors=True)
    shutil.copytree(root, saved, symlinks=True, copy_function=shutil.copy2)
    try:
        mutate, rule = CHANGES[change]
        mutate(root / name)
        refusal = verified.served_refusal(root)
        assert _codes(refusal) == {Code.VERIFIED_FILES_CHANGED}
        assert [p.file for p in refusal.problems] == [name]
        assert "kimi-convert verify" in (refusal.hint or "")
    finally:
        shutil.rmtree(root)
        os.replace(saved, root)
        verify(root, checksums=True)


@pytest.fixture
def verified_output(output_copy):
    assert verify(output_copy, checksums=True).record == "recorded"
    return output_copy


def test_an_added_file_is_refused(verified_output):
    (verified_output / "extra.safetensors").write_bytes(b"x")
    refusal = verified.served_refusal(verified_output)
    assert _codes(refusal) == {Code.VERIFIED_FILES_CHANGED}
    assert [p.file for p in refusal.problems] == ["extra.safetensors"]


def test_hidden_files_are_not_part_of_the_checkpoint(verified_output):
    (verified_output / ".notes").write_text("x")
    assert verified.served_refusal(verified_output) is None


def test_a_copy_needs_its_own_verify(verified_output, tmp_path):
    copy = tmp_path / "copy"
    shutil.copytree(verified_output, copy, copy_function=shutil.copy2)  # record copied too
    assert _codes(verified.served_refusal(copy)) == {Code.VERIFIED_FILES_CHANGED}
    assert verify(copy, checksums=True).ok
    assert verified.served_refusal(copy) is None


def test_a_failing_verify_removes_the_record(verified_output):
    shard = next(p for p in sorted(verified_output.glob("*.safetensors")))
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0xFF
    shard.write_bytes(bytes(data))
    report = verify(verified_output, checksums=True)
    assert not report.ok and report.record == "removed"
    assert not verified.record_path(verified_output).exists()
    assert _codes(verified.served_refusal(verified_output)) == {Code.NOT_VERIFIED}


def test_files_changed_during_the_verify_are_not_recorded(output_copy, monkeypatch):
    real = verified.identities
    calls = []

    def changing(root):
        calls.append(root)
        if len(calls) == 2:  # after every byte was read: a shard is touched
            _touch(next(iter(sorted(root.glob("*.safetensors")))))
        return real(root)

    monkeypatch.setattr(verified, "identities", changing)
    report = verify(output_copy, checksums=True)
    assert report.ok and report.record.startswith("not recorded")
    assert not verified.record_path(output_copy).exists()


def test_a_torn_record_proves_nothing(verified_output):
    path = verified.record_path(verified_output)
    path.write_bytes(path.read_bytes()[:-20])
    assert _codes(verified.served_refusal(verified_output)) == {Code.NOT_VERIFIED}


def test_a_state_folder_that_is_a_link_is_never_written_through(output_copy, tmp_path):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    os.symlink(elsewhere, output_copy / STATE_DIR)
    report = verify(output_copy, checksums=True)
    assert report.record.startswith("not recorded")
    assert list(elsewhere.iterdir()) == []


def test_proofs_of_other_filesystem_views_are_kept(verified_output):
    path = verified.record_path(verified_output)
    doc = json.loads(path.read_text())
    other = dict(doc["proofs"][0], device=doc["proofs"][0]["device"] + 1)
    doc["proofs"].insert(0, other)
    path.write_text(json.dumps(doc))
    verify(verified_output, checksums=True)
    devices = [p.device for p in verified.read_proofs(verified_output)]
    assert len(devices) == 2 and len(set(devices)) == 2
    assert verified.served_refusal(verified_output) is None


def test_a_converter_rerun_leaves_no_record(verified_output, small_source):
    opts = ConvertOptions(
        str(small_source), verified_output, manifest="kimi-k3-any", max_shard_size=600_000
    )
    convert(opts)
    assert not (verified_output / STATE_DIR).exists()
    assert _codes(verified.served_refusal(verified_output)) == {Code.NOT_VERIFIED}


def test_a_model_path_that_is_no_local_folder_is_not_verified(tmp_path):
    refusal = verified.served_refusal(tmp_path / "org" / "repo")
    assert _codes(refusal) == {Code.NOT_VERIFIED}
    assert verified.SKIP_ENV in (refusal.hint or "")


def test_the_opt_out_is_exactly_one():
    assert verified.skipped({verified.SKIP_ENV: "1"})
    assert not any(verified.skipped({verified.SKIP_ENV: v}) for v in ("", "0", "true", "yes"))
    assert not verified.skipped({})


def test_one_function_reads_identities_for_verify_and_the_server():
    """`records.file_identity` is the only reader: verify's record and the load-time check
    cannot disagree on what an identity is."""
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    sides = [
        root / "converter" / "output" / "verified.py",
        *(root / "converter" / "audit").glob("*.py"),
    ]
    sides += list((root / "adapter").rglob("*.py"))
    readers = [p.name for p in sides if any(f in p.read_text() for f in ("st_ino", "st_dev"))]
    assert readers == []
    assert "file_identity" in (root / "converter" / "output" / "verified.py").read_text()
