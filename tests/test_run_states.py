"""Every message is true in the state it describes, and nothing else gets in the way.

SIGTERM is handled like Ctrl-C; a full disk during finalization names the file; a file
that appears in the output during a run is never finalized into it; extra files of any size
are streamed; our own artefacts in a source are not carried into an output; synth never
mixes two checkpoints.
"""

from __future__ import annotations

import json
import os
import resource
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from cli_helpers import ENTRY, json_problems, run_cli, start_cli
from kimi_w31.converter.contract import STATE_DIR
from kimi_w31.converter.errors import reason
from kimi_w31.converter.output.directory import OutputDir
from kimi_w31.converter.reasons import Code

ARGS = ["--manifest", "kimi-k3-any", "--max-shard-size", "600000", "--workers", "1"]
INDEX = "model.safetensors.index.json"


def _files(root):
    return {str(p.relative_to(root)): p.read_bytes() for p in root.rglob("*") if p.is_file()}


def _codes(proc) -> list[str]:
    return proc.codes


def test_sigterm_is_an_interruption_with_a_message_and_resumes(small_source, converted, tmp_path):
    out = tmp_path / "out"
    proc = start_cli([small_source, out, *ARGS], stop_at="shard.piece:5")
    os.kill(proc.pid, signal.SIGTERM)
    os.kill(proc.pid, signal.SIGCONT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 143
    assert err.strip() and "Traceback" not in err
    assert not (out / INDEX).exists()
    assert not OutputDir(out).lock_path.exists()  # released on the way out
    assert run_cli([small_source, out, *ARGS, "-q"]).returncode == 0  # "rerun to resume": true
    assert _files(out) == _files(converted)


def _with_big_extra(source_copy, size: int):
    big = source_copy / "assets" / "big.bin"
    big.parent.mkdir(exist_ok=True)  # the published layout has assets/ already
    with open(big, "wb") as fh:  # sparse: instant to make, read back as zeros
        fh.truncate(size)
    return big


def test_a_full_disk_while_finalizing_names_the_file_then_resumes(source_copy, tmp_path):
    _with_big_extra(source_copy, 3_000_000)  # larger than any shard
    out = tmp_path / "out"

    def limit():
        resource.setrlimit(resource.RLIMIT_FSIZE, (2_000_000, 2_000_000))

    proc = run_cli([source_copy, out, *ARGS, "--json"], preexec_fn=limit)
    assert proc.returncode == 1, proc.stderr
    (problem,) = proc.problems
    assert problem["code"] == Code.NO_SPACE.value
    assert problem["file"] == str(out / "assets" / "big.bin")
    assert not (out / INDEX).exists()
    summary = run_cli([source_copy, out, *ARGS, "--json"]).json
    assert summary["mode"] == "resume" and summary["shards_written"] == 0
    assert (out / "assets" / "big.bin").stat().st_size == 3_000_000


def test_extra_files_are_streamed_whatever_their_size(source_copy, tmp_path):
    _with_big_extra(source_copy, 300_000_000)
    code = (
        "import resource, subprocess, sys; "
        "rc = subprocess.call(sys.argv[1:]); "
        "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss); sys.exit(rc)"
    )
    proc = subprocess.run(
        [
            sys.executable,
            "-c",
            code,
            *ENTRY,
            str(source_copy),
            str(tmp_path / "out"),
            *ARGS,
            "-q",
        ],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stderr
    peak_mib = int(proc.stdout.split()[-1]) / 1024
    assert peak_mib < 150, f"peak RSS {peak_mib:.0f} MiB for a 300 MB extra file"


def test_a_file_appearing_in_the_output_is_never_finalized_into_it(small_source, tmp_path):
    out = tmp_path / "out"
    proc = start_cli([small_source, out, *ARGS, "--json"], stop_at="shard.renamed:2")
    (out / "README-of-another-model.md").write_text("not from this conversion\n")
    os.kill(proc.pid, signal.SIGCONT)
    stdout, _ = proc.communicate(timeout=60)
    assert proc.returncode == 1
    assert [p["code"] for p in json_problems(stdout)] == [Code.FOREIGN_OUTPUT.value]
    assert not (out / INDEX).exists()
    assert (out / "README-of-another-model.md").exists()  # nothing deleted
    (out / "README-of-another-model.md").unlink()
    summary = run_cli([small_source, out, *ARGS, "--json"]).json
    assert summary["mode"] == "resume" and summary["shards_kept"] >= 2


def test_our_own_artefacts_in_a_source_are_not_carried_over(source_copy, tmp_path):
    (source_copy / "kimi_w31.checksums.json").write_text('{"format_version": 1, "files": {}}')
    (source_copy / STATE_DIR).mkdir()
    OutputDir(source_copy).ledger_path.write_text("{}\n")
    out = tmp_path / "out"
    assert run_cli([source_copy, out, *ARGS, "-q"]).returncode == 0
    ours = json.loads((out / "kimi_w31.checksums.json").read_text())
    assert ours["plan_fingerprint"] and "kimi_w31.checksums.json" not in ours["files"]
    assert not (out / STATE_DIR).exists()


@pytest.mark.parametrize("content", ["file", "dir"])
def test_synth_never_mixes_two_checkpoints(tmp_path, content):
    target = tmp_path / "target"
    target.mkdir()
    (target / ("old.txt" if content == "file" else "sub")).mkdir() if content == "dir" else (
        target / "old.txt"
    ).write_text("x")
    proc = run_cli(["synth", target])
    assert proc.returncode == reason(Code.OUTPUT_NOT_EMPTY).exit  # as in convert
    assert sorted(p.name for p in target.iterdir()) == (
        ["old.txt"] if content == "file" else ["sub"]
    )


@pytest.mark.parametrize(
    "make, code",
    [
        (lambda p: p.mkdir(), Code.NOT_A_REGULAR_FILE),  # not a file, even for root
        (lambda p: p.symlink_to(p.name), Code.FILE_UNREADABLE),  # a link loop: ELOOP
    ],
    ids=["directory", "link-loop"],
)
def test_an_unreadable_source_file_is_named(source_copy, tmp_path, make, code):
    (source_copy / "config.json").unlink()
    make(source_copy / "config.json")
    proc = run_cli([source_copy, tmp_path / "out", *ARGS, "--json"])
    assert proc.returncode == 1
    (problem,) = proc.problems
    assert problem["code"] == code.value
    assert problem["file"] == str(source_copy / "config.json")


def test_another_os_error_names_the_file_and_keeps_its_promise(tmp_path):
    import errno

    from kimi_w31.converter.output.directory import OutputDir

    out = OutputDir(tmp_path / "out")
    out.claim("f" * 64, force=False)
    try:
        error = out.io_error(OSError(errno.EIO, "Input/output error", str(out.root / "x")))
    finally:
        out.release(finished=False)
    assert error.codes == [Code.IO_ERROR]
    assert error.problems[0].file == str(out.root / "x")
    assert out.state.is_dir()  # "rerun the same command" is true: the run's state is there


@pytest.mark.parametrize("dry_run", [[], ["--dry-run"]])
@pytest.mark.parametrize("depth", [0, 1, 2])
def test_an_output_path_through_a_file_is_named_not_a_directory(
    small_source, tmp_path, dry_run, depth
):
    """A file where a folder of the output path would be: refused for what it is, by a
    dry run too, and nothing is created."""
    (tmp_path / "a-file").write_text("the user's\n")
    out = tmp_path / "a-file" / Path(*["x"] * depth) / "out" if depth else tmp_path / "a-file"
    before = sorted(p.name for p in tmp_path.iterdir())
    proc = run_cli([small_source, out, *ARGS, "--json", *dry_run])
    assert proc.returncode == 1
    assert proc.codes == [Code.OUTPUT_NOT_DIRECTORY.value]
    assert sorted(p.name for p in tmp_path.iterdir()) == before
    assert (tmp_path / "a-file").read_text() == "the user's\n"
