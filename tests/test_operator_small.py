"""The small things an operator meets: `help` is a command, counts read as English, sizes
in people's units, and a synth that cannot write says why with a code."""

from __future__ import annotations

import errno

import pytest
from cli_helpers import run_cli
from hypothesis import given
from hypothesis import strategies as st
from kimi_w31.converter.reasons import Code
from kimi_w31.converter.text import Size, human_size, plural


@pytest.mark.parametrize("args", [["help"], ["help", "verify"], ["help", "serve"]])
def test_help_is_a_command_not_a_source(args, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "help").mkdir()  # even beside a folder named help
    got = run_cli(args, inprocess=True)
    assert got.returncode == 0, got.output
    want = f" {args[1]} [OPTIONS]" if len(args) == 2 else "COMMAND [ARGS]"
    assert want in got.stdout


def test_help_of_no_such_command_is_a_usage_error():
    assert run_cli(["help", "nope"], inprocess=True).returncode == 2


@given(n=st.integers(0, 10**6))
def test_plural(n):
    text = plural(n, "shard")
    assert text.split()[0] == str(n) and text.endswith("shard" if n == 1 else "shards")


@given(n=st.integers(0, 10**16))
def test_a_size_fact_shows_people_units_and_the_exact_bytes(n):
    shown = str(Size(n))
    assert shown.startswith(human_size(n)) and f"{n:,} bytes" in shown
    assert Size(n) == n and f"{Size(n):d}" == str(n)  # still the number for code


@pytest.mark.parametrize(
    ("err", "code"),
    [
        (errno.EACCES, Code.PERMISSION_DENIED),
        (errno.EROFS, Code.PERMISSION_DENIED),
        (errno.ENOSPC, Code.NO_SPACE),
        (errno.EIO, Code.IO_ERROR),
    ],
)
def test_synth_that_cannot_write_gets_a_coded_error(tmp_path, monkeypatch, err, code):
    import kimi_w31.converter.synth as synth

    def fail(out, spec):
        raise OSError(err, "refused", str(out / "model-00001-of-00003.safetensors"))

    monkeypatch.setattr(synth, "synth_checkpoint", fail)
    got = run_cli(["synth", tmp_path / "x"], inprocess=True)
    assert got.returncode == 1 and got.exception is None
    assert "KIMI_W31_DEBUG" not in got.stderr  # not the catch-all for bugs
    from kimi_w31.converter.cli.synth import _os_refusal

    assert _os_refusal(OSError(err, "x", "f"), tmp_path).codes == [code]
