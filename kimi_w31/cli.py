"""`kimi-convert`: the one command line, registered here because it spans both packages.

The converter's commands (convert, verify, synth) never import the adapter; `serve` comes
from the adapter, which checks the serving stack through package metadata only (importing
SGLang happens in the server it starts).
"""

from __future__ import annotations

from .adapter.launch import prebuild_command, serve
from .converter.cli import main, synth
from .converter.verify.command import verify

main.add_command(verify)
main.add_command(synth)
main.add_command(serve)
main.add_command(prebuild_command)

__all__ = ["main"]
