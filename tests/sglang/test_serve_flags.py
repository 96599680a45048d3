"""`kimi-convert serve` reads SGLang's flags as SGLang 0.5.23's own ServerArgs parser does.

The consumer is the judge: launch.SGLANG_FLAGS restates option names, types and argparse's
forms (`--x=y`, unambiguous prefixes, last wins); SGLang's real parser decides here, on
generated argument lists.
"""

from __future__ import annotations

import argparse
import json
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


# -- what serve adds for Kimi-K3, and how it reads MoE-DP -------------------------------------


def test_the_parsers_serve_passes_are_in_sglangs_registries():
    from sglang.srt.function_call.function_call_parser import FunctionCallParser
    from sglang.srt.parser.reasoning_parser import ReasoningParser

    assert launch.KIMI_PARSERS["reasoning_parser"] in ReasoningParser.DetectorMap
    assert launch.KIMI_PARSERS["tool_call_parser"] in FunctionCallParser.ToolCallParserEnum
    # negative control: a name that is not there is not found
    assert "kimi_k9" not in ReasoningParser.DetectorMap


def test_the_switches_serve_adds_or_reads_are_sglangs():
    for switch in [*launch.SGLANG_SWITCHES]:
        action = next(a for a in PARSER._actions if switch in a.option_strings)
        assert action.nargs == 0, switch  # a switch: it takes no value


def test_the_plan_parses_with_sglangs_parser(tmp_path):
    from kimi_w31.converter import contract
    from kimi_w31.converter.synth import SynthSpec, make_config

    cfg = contract.converted_config(
        make_config(SynthSpec(k=3584, n=3072, experts=896)), contract.make_block(4.0, 25.0)
    )
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    plan = launch.plan_serve(tmp_path, ["--skip-tokenizer-init"], tp=8, python="py")
    ns = PARSER.parse_args(plan.argv[3:])
    assert ns.trust_remote_code and ns.reasoning_parser == ns.tool_call_parser == "kimi_k3"
    assert json.loads(ns.json_model_override_args) == {"language_model_only": True}


def _sglang_moe_dp_rules():
    """SGLang 0.5.23's own checks of a MoE-DP layout (parallel_hook.py's `if cfg.moe_dp_size
    > 1:` block), taken from its source and run on a layout."""
    import ast
    import inspect
    import textwrap

    from sglang.srt.arg_groups import parallel_hook

    tree = ast.parse(textwrap.dedent(inspect.getsource(parallel_hook)))
    (block,) = [
        n
        for n in ast.walk(tree)
        if isinstance(n, ast.If) and ast.unparse(n.test) == "cfg.moe_dp_size > 1"
    ]
    code = compile(ast.Module(body=[block], type_ignores=[]), "parallel_hook", "exec")

    def accepts(tp: int, ep: int, dp: int) -> bool:
        from types import SimpleNamespace

        cfg = SimpleNamespace(
            tp_size=tp, moe_dp_size=dp, pp_size=1, enable_aiter_allreduce_fusion=False
        )
        try:
            exec(code, {"cfg": cfg, "view": SimpleNamespace(ep_size=ep)})
        except AssertionError:
            return False
        return True

    return accepts


def test_moe_tp_is_sglangs_on_every_layout():
    from sglang.srt.runtime_context import derive_parallel_widths

    accepts = _sglang_moe_dp_rules()
    for tp in (1, 2, 4, 6, 8, 12, 16, 24, 32):
        for ep in (1, 2, 3, 4, 8, 16, 32):
            if tp % ep:
                continue  # ours refuses it before SGLang is asked
            for dp in (1, 2, 3, 4, 8, 16):
                try:
                    ours = launch.moe_tp_size(tp, ep, dp)
                except launch.ServeError:
                    ours = None
                assert (ours is not None) == accepts(tp, ep, dp), (tp, ep, dp)
                if ours is not None:
                    theirs = derive_parallel_widths(
                        tp_size=tp,
                        attn_cp_size=1,
                        attn_dp_size=1,
                        moe_ep_size=ep,
                        moe_dp_size=dp,
                        dcp_size=1,
                        dcp_enabled=False,
                    )["moe_tp_size"]
                    assert ours == theirs, (tp, ep, dp)
