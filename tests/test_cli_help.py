"""Help that teaches: every command has examples, every option says what it does and what
it takes (no bare TEXT or INTEGER placeholders)."""

from __future__ import annotations

import random
import re

import click
import pytest
from cli_helpers import run_cli
from kimi_w31.converter.errors import reason
from kimi_w31.converter.reasons import Code

from kimi_w31.cli import main

COMMANDS = main.list_commands(click.Context(main))


def test_every_command_is_there():
    assert set(COMMANDS) >= {"convert", "verify", "synth", "serve"}


@pytest.mark.parametrize("name", COMMANDS)
def test_help_has_examples_and_every_option_is_described(name):
    command = main.get_command(click.Context(main), name)
    result = run_cli([name, "--help"], inprocess=True, terminal_width=100)
    assert result.returncode == 0, result.output
    assert "Examples:" in result.output
    for param in command.params:
        if isinstance(param, click.Option) and param.name != "help":
            assert param.help and len(param.help) > 10, f"{name} {param.opts} has no help"
    generic = re.findall(r"\b(TEXT|INTEGER|FLOAT|PATH|DIRECTORY|FILENAME)\b", result.output)
    assert generic == [], f"{name}: placeholders that say nothing: {generic}"


def test_the_group_help_lists_examples_and_exit_codes():
    result = run_cli(["--help"], inprocess=True, terminal_width=100)
    assert result.returncode == 0
    assert "Examples:" in result.output and "Exit codes" in result.output


def test_converting_never_imports_the_other_commands():
    import subprocess
    import sys

    code = "\n".join(
        [
            "import sys",
            "from kimi_w31.cli import main",
            "try:",
            "    main(['convert', '--help'])",
            "except SystemExit:",
            "    pass",
            "loaded = [m for m in sys.modules if m.startswith(('kimi_w31.adapter',",
            "                                                   'kimi_w31.converter.audit'))]",
            "print('loaded:', sorted(loaded))",
        ]
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip().splitlines()[-1] == "loaded: []"


# -- a typo is not a conversion -------------------------------------------------------------
def _one_edit_typos(word: str) -> set[str]:
    """Every word one deletion, one substitution or one swap of neighbours away."""
    letters = "abcdefghijklmnopqrstuvwxyz"
    typos = {word[:i] + word[i + 1 :] for i in range(len(word))}
    typos |= {word[:i] + c + word[i + 1 :] for i in range(len(word)) for c in letters}
    typos |= {word[:i] + word[i + 1] + word[i] + word[i + 2 :] for i in range(len(word) - 1)}
    return typos - set(COMMANDS)


@pytest.mark.parametrize("name", COMMANDS)
def test_a_typo_of_a_command_is_refused_and_names_the_command(name, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    typos = sorted(t for t in _one_edit_typos(name) if len(t) >= 4)
    for typo in random.Random(name).sample(typos, 12):
        result = run_cli([typo, "out", "--checksums"], inprocess=True)
        assert result.returncode == reason(Code.USAGE).exit, (typo, result.output)
        assert repr(name) in result.output, (typo, result.output)  # the command meant
        assert not (tmp_path / "out").exists()  # nothing converted, nothing written


def test_an_existing_directory_named_like_a_typo_is_a_source(tmp_path, monkeypatch):
    """A source may be called anything: a path that exists goes to convert, typo or not."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "verfy").mkdir()
    result = run_cli(["verfy", "out", "--json"], inprocess=True)
    doc = result.json  # convert read it: an empty directory has no config
    assert result.codes == [Code.FILE_MISSING.value]
    assert result.returncode == doc["exit_code"] == reason(Code.FILE_MISSING).exit


def test_a_word_unlike_any_command_is_convert_s_source(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    result = run_cli(["zzzzzz", "out", "--json"], inprocess=True)
    assert set(result.codes) == {Code.SOURCE_NOT_FOUND.value}
    assert result.returncode == reason(Code.SOURCE_NOT_FOUND).exit


def test_src_out_without_a_command_still_converts(small_source, tmp_path):
    result = run_cli(
        [str(small_source), str(tmp_path / "out"), "--manifest", "kimi-k3-any", "-q"],
        inprocess=True,
    )
    assert result.returncode == 0, result.output
    assert (tmp_path / "out" / "model.safetensors.index.json").is_file()
