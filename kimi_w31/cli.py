"""`kimi-convert`: the one command line, registered here because it spans both packages.

The converter's commands (convert, verify, synth) never import the adapter; `serve` and
`prebuild` come from the adapter, which looks at the serving stack through package metadata
only (SGLang is imported by the server it starts). A subcommand's module is imported when
the subcommand runs: converting never pays for verify's or serve's imports.
"""

from __future__ import annotations

import importlib

import click

from . import __version__

# name -> "module:attribute" of the click command
COMMANDS = {
    "convert": "kimi_w31.converter.cli:convert_cmd",
    "verify": "kimi_w31.converter.verify.command:verify",
    "synth": "kimi_w31.converter.cli:synth",
    "serve": "kimi_w31.adapter.launch:serve",
    "prebuild": "kimi_w31.adapter.launch:prebuild_command",
}


class KimiConvert(click.Group):
    """Subcommands imported on use; `kimi-convert SRC OUT` means `kimi-convert convert SRC
    OUT`."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(COMMANDS)

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        if name not in self.commands and name in COMMANDS:
            module, attribute = COMMANDS[name].split(":")
            self.add_command(getattr(importlib.import_module(module), attribute), name)
        return super().get_command(ctx, name)

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        if args and args[0] not in COMMANDS and args[0] not in ("--help", "-h", "--version"):
            args = ["convert", *args]
        return super().parse_args(ctx, args)


@click.group(cls=KimiConvert, context_settings={"help_option_names": ["-h", "--help"]})
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
      kimi-convert serve out/ --tp 8                    check, then run SGLang on it
      kimi-convert prebuild                             FlashInfer's JIT build, once

    Exit codes: 0 ok, 1 invalid input or failed check, 2 usage error, 130 interrupted,
    143 terminated.
    """
