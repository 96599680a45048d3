"""Help that teaches: every command has examples, every option says what it does and what
it takes (no bare TEXT or INTEGER placeholders)."""

from __future__ import annotations

import re

import click
import pytest
from click.testing import CliRunner

from kimi_w31.cli import main

COMMANDS = main.list_commands(click.Context(main))


def test_every_command_is_there():
    assert set(COMMANDS) >= {"convert", "verify", "synth", "serve"}


@pytest.mark.parametrize("name", COMMANDS)
def test_help_has_examples_and_every_option_is_described(name):
    command = main.get_command(click.Context(main), name)
    result = CliRunner().invoke(main, [name, "--help"], terminal_width=100)
    assert result.exit_code == 0, result.output
    assert "Examples:" in result.output
    for param in command.params:
        if isinstance(param, click.Option) and param.name != "help":
            assert param.help and len(param.help) > 10, f"{name} {param.opts} has no help"
    generic = re.findall(r"\b(TEXT|INTEGER|FLOAT|PATH|DIRECTORY|FILENAME)\b", result.output)
    assert generic == [], f"{name}: placeholders that say nothing: {generic}"


def test_the_group_help_lists_examples_and_exit_codes():
    result = CliRunner().invoke(main, ["--help"], terminal_width=100)
    assert result.exit_code == 0
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
            "                                                   'kimi_w31.converter.verify'))]",
            "print('loaded:', sorted(loaded))",
        ]
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip().splitlines()[-1] == "loaded: []"
