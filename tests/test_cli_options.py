"""Options declared once: every option two commands take comes from its one declaration
(converter/cli/arguments.py), so its spelling, destination, type and help cannot drift
apart between commands."""

from __future__ import annotations

from collections import defaultdict

import click
import pytest
from kimi_w31.converter.cli import arguments

from kimi_w31.cli import main

# Spelled alike, meaning different things: synth's --experts is how many routed experts a
# layer has, verify's how many of them --numerics samples (each command's own declaration).
DIFFERENT_MEANINGS = {"--experts"}


def _commands(group: click.Group) -> dict[str, click.Command]:
    ctx = click.Context(group)
    return {name: group.get_command(ctx, name) for name in group.list_commands(ctx)}


def hand_declared_repeats(commands: dict[str, click.Command]) -> list[str]:
    """`command option` for each option two or more commands take that one of them declares
    itself rather than through the shared declaration."""
    takers: dict[str, list[tuple[str, click.Option]]] = defaultdict(list)
    for name, command in commands.items():
        for param in command.params:
            if isinstance(param, click.Option) and param.name != "help":
                for opt in param.opts:
                    takers[opt].append((name, param))
    return sorted(
        f"{name} {opt}"
        for opt, found in takers.items()
        if len(found) > 1 and opt not in DIFFERENT_MEANINGS
        for name, param in found
        if not isinstance(param, arguments.SharedOption)
    )


def test_every_option_two_commands_take_is_declared_once():
    commands = _commands(main)
    assert hand_declared_repeats(commands) == []
    shared = {o for c in commands.values() for p in c.params for o in p.opts}
    assert {"--json", "--quiet", "--workers", "--progress", "--manifest", "--seed"} <= shared


def test_the_rule_sees_an_option_declared_twice_by_hand():
    """Negative control: two commands each declaring --json themselves are both named; one
    of them using the shared declaration leaves the other."""

    def command(name: str, shared: bool) -> click.Command:
        declare = arguments.json_option("x") if shared else click.option("--json", is_flag=True)
        return declare(click.Command(name, callback=lambda **_: None))

    assert hand_declared_repeats({"a": command("a", False), "b": command("b", False)}) == [
        "a --json",
        "b --json",
    ]
    assert hand_declared_repeats({"a": command("a", True), "b": command("b", False)}) == [
        "b --json"
    ]
    assert hand_declared_repeats({"a": command("a", True), "b": command("b", True)}) == []


@pytest.mark.parametrize(("name", "default"), sorted(arguments.WORKERS.items()))
def test_workers_defaults_are_the_declarations(name, default):
    (workers,) = [p for p in _commands(main)[name].params if p.name == "workers"]
    assert workers.default == default and isinstance(workers, arguments.SharedOption)
