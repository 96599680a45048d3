"""Interim placeholder for the `verify` command while the verification package is rebuilt."""

from __future__ import annotations

import click


@click.command()
@click.argument("output")
def verify(output: str) -> None:
    """Not available in this interim revision."""
    raise click.UsageError("verify is being rebuilt in this revision")
