"""`kimi-convert`: the one command line, registered here because it spans both packages.

The converter's commands (convert, verify, synth) never import the adapter; `serve` and
`prebuild` come from the adapter, which looks at the serving stack through package metadata
only (SGLang is imported by the server it starts). A subcommand's module is imported when
the subcommand runs: converting never pays for verify's or serve's imports.
"""

from __future__ import annotations

import difflib
import importlib
import re
from pathlib import Path

import click
from click_default_group import DefaultGroup

from . import __version__

# name -> "module:attribute" of the click command
COMMANDS = {
    "convert": "kimi_w31.converter.cli.convert:convert_cmd",
    "verify": "kimi_w31.converter.cli.verify:verify",
    "synth": "kimi_w31.converter.cli.synth:synth",
    "serve": "kimi_w31.adapter.sglang.launch:serve",
    "prebuild": "kimi_w31.adapter.sglang.launch:prebuild_command",
    "smoke": "kimi_w31.adapter.sglang.smoke:smoke_command",
}


def _looks_like_a_command(word: str) -> str | None:
    """The command `word` is a typo of, when it is one: a bare lowercase word close to a
    command name that names no existing path (a source directory may be called anything;
    a Hub repo id has a slash). Else None: the word is convert's SRC."""
    if not re.fullmatch(r"[a-z][a-z-]*", word) or _names_a_path(word):
        return None
    close = difflib.get_close_matches(word, [*COMMANDS, "help"], n=1, cutoff=0.75)
    return close[0] if close else None


def _names_a_path(word: str) -> bool:
    """Whether `word` names something there; one the OS refuses to look up (too long) is
    taken as a path too: convert's SRC, which its path resolver refuses by name."""
    try:
        return Path(word).expanduser().exists()
    except OSError:
        return True


class KimiConvert(DefaultGroup):
    """Subcommands imported on use; `kimi-convert SRC OUT` means `kimi-convert convert SRC
    OUT` (click-default-group: a first word that is no command goes to the default)."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted([*COMMANDS, "help"])

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        if name == "help":  # a command, never convert's SRC (a folder named help: ./help)
            return help_command
        if name not in COMMANDS:
            meant = _looks_like_a_command(name)
            if meant is not None:  # `verfy out/` is a typo, not a conversion of ./verfy
                raise click.UsageError(f"no such command {name!r}; did you mean {meant!r}?", ctx)
        wanted = name if name in COMMANDS else self.default_cmd_name
        if wanted in COMMANDS and wanted not in self.commands:
            module, attribute = COMMANDS[wanted].split(":")
            self.add_command(getattr(importlib.import_module(module), attribute), wanted)
        return super().get_command(ctx, name)


@click.group(
    cls=KimiConvert, default="convert", context_settings={"help_option_names": ["-h", "--help"]}
)
@click.version_option(__version__, prog_name="kimi-convert")
def main() -> None:
    """Convert Kimi-K3 MXFP4 checkpoints to the fused [up; gate] (w31) expert layout,
    prove the result, and serve it with SGLang.

    \b
    Examples:
      kimi-convert /data/hf_models/Kimi-K3 out/         convert a local checkpoint
      kimi-convert moonshotai/Kimi-K3 out/              a repo already in the HF cache
      kimi-convert moonshotai/Kimi-K3 out/ --download   stream it from the Hub
      kimi-convert SRC out/ --dry-run                   check and plan only, write nothing
      kimi-convert verify out/ --checksums              prove an output intact
      kimi-convert synth src/                           make a small checkpoint to try
      kimi-convert serve out/ --tp 16 --ep 2 -- --nnodes 2 ...  check, then run SGLang
      kimi-convert prebuild                             FlashInfer's JIT build, once

    Exit codes: 0 ok, 1 invalid input or failed check, 2 usage error, 130 interrupted,
    143 terminated.
    """


@click.command("help")
@click.argument("command", required=False, metavar="[COMMAND]")
@click.pass_context
def help_command(ctx: click.Context, command: str | None) -> None:
    """Show the help of kimi-convert, or of COMMAND.

    \b
    Examples:
      kimi-convert help
      kimi-convert help verify
    """
    group = ctx.parent.command if ctx.parent is not None else main
    parent = ctx.parent or ctx
    if command is None:
        click.echo(group.get_help(parent))
        return
    if command not in COMMANDS:
        raise click.UsageError(
            f"no such command {command!r}; the commands are {', '.join(sorted(COMMANDS))}",
            ctx,
        )
    cmd = group.get_command(parent, command)
    with click.Context(cmd, info_name=command, parent=parent) as sub:
        click.echo(cmd.get_help(sub))
