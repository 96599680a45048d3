"""`kimi-convert serve` reads SGLang's flags as SGLang 0.5.23's own ServerArgs parser does.

The consumer is the judge: launch.SGLANG_FLAGS restates option names, types and argparse's
forms (`--x=y`, unambiguous prefixes, last wins); SGLang's real parser decides here, on
generated argument lists.
"""

from __future__ import annotations

import argparse
import random

import harness  # noqa: F401  (the import stand-ins)
import pytest
from kimi_w31.adapter.sglang import launch

pytestmark = pytest.mark.sglang


def _parser() -> argparse.ArgumentParser:
    from sglang.srt.server_args import ServerArgs

    p = argparse.ArgumentParser(exit_on_error=False)
    ServerArgs.add_cli_args(p)
    return p


PARSER = _parser()
LONG = sorted(s for a in PARSER._actions for s in a.option_strings if s.startswith("--"))
DEST = {s: a.dest for a in PARSER._actions for s in a.option_strings}


def test_the_table_is_sglangs_option_strings_and_types():
    for dest, (names, kind) in launch.SGLANG_FLAGS.items():
        action = next(a for a in PARSER._actions if a.dest == dest)
        assert set(names) == set(action.option_strings), dest
        assert action.type is kind, dest


def test_no_other_sglang_option_is_a_prefix_of_ours():
    """Else argparse's exact match on that option would beat our reading of a prefix."""
    ours = {n: d for d, (names, _) in launch.SGLANG_FLAGS.items() for n in names}
    for s in LONG:
        if DEST[s] in launch.SGLANG_FLAGS:
            continue
        assert not any(n.startswith(s) for n in ours), s


def _argparse_reads(args: list[str]) -> dict | None:
    """SGLang's parse of `args`, restricted to the dests serve reads; None if it refuses."""
    try:
        ns, _ = PARSER.parse_known_args(["--model-path", "m", *args])
    except (argparse.ArgumentError, SystemExit, ValueError, TypeError):
        return None
    given = {a.dest for a in PARSER._actions for s in a.option_strings}
    out = {}
    for dest in launch.SGLANG_FLAGS:
        if dest in given and getattr(ns, dest) != PARSER.get_default(dest):
            out[dest] = getattr(ns, dest)
    return out


# Every prefix of our option strings (argparse decides which ones it takes).
PREFIXES = sorted(
    {n[:k] for names, _ in launch.SGLANG_FLAGS.values() for n in names for k in range(3, len(n))}
    | {n for names, _ in launch.SGLANG_FLAGS.values() for n in names}
)
VALUES = {int: ["2", "8", "16"], float: ["0.5", "0.77"], str: ["marlin", "triton"]}


def _value(name: str, rng: random.Random) -> str:
    try:
        dest = launch._dest_of(name)
    except launch.ServeError:
        dest = None
    return rng.choice(VALUES[launch.SGLANG_FLAGS[dest][1] if dest else int])


def _check(args: list[str]) -> None:
    """Whenever SGLang accepts the line, serve reads the same values for the same dests;
    where serve refuses (an ambiguous prefix), SGLang refuses too."""
    theirs = _argparse_reads(args)
    try:
        ours = launch.sglang_flags(args)
    except launch.ServeError:
        assert theirs is None, args
        return
    if theirs is None:
        return  # SGLang refuses (e.g. a prefix ambiguous with its other options): no launch
    assert {d: v for d, v in ours.items() if v != PARSER.get_default(d)} == theirs, args


@pytest.mark.parametrize("name", PREFIXES)
def test_every_prefix_in_both_forms(name):
    rng = random.Random(name)
    value = _value(name, rng)
    _check([name, value])
    _check([f"{name}={value}"])


@pytest.mark.parametrize("seed", range(40))
def test_generated_command_lines(seed):
    rng = random.Random(seed)
    for _ in range(10):
        args: list[str] = []
        for _ in range(rng.randint(1, 6)):
            if rng.random() < 0.25:
                args += rng.choice([["--port", "30000"], ["--trust-remote-code"]])
                continue
            name = rng.choice(PREFIXES)
            value = _value(name, rng)
            args += [f"{name}={value}"] if rng.random() < 0.5 else [name, value]
        _check(args)
