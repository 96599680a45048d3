"""One cause, one message: a problem whose reason follows from another reason reported
beside it is counted, not listed (its record's `implies`), in text and in `--json`; a problem
renders only the facts it knows. Held by reason code over generated cases."""

from __future__ import annotations

import json
import shutil

import pytest
from cli_helpers import run_cli
from hypothesis import given
from hypothesis import strategies as st
from kimi_w31.converter.errors import (
    Fatal,
    Problem,
    reason,
    root_problems,
    suppressed_codes,
)
from kimi_w31.converter.reasons import Code
from reason_codes import ALL_CODES, implied

ANY = ["--manifest", "kimi-k3-any"]


def _json(args: list) -> tuple[int, dict, list[str]]:
    """(exit code, the `--json` report, its reason codes)."""
    result = run_cli([*args, "--json"], inprocess=True)
    return result.returncode, result.json, result.codes


def _text(args: list) -> str:
    return run_cli(args, inprocess=True).output


# -- the rule itself --------------------------------------------------------------------------
def test_the_consequence_table_is_acyclic():
    """A cycle would let two reasons hide each other and nothing be reported."""
    state: dict[Code, int] = {}

    def visit(code: Code) -> None:
        assert state.get(code) != 1, f"cycle through {code.value}"
        if state.get(code) == 2:
            return
        state[code] = 1
        for follower in implied(code):
            visit(follower)
        state[code] = 2

    for code in ALL_CODES:
        visit(code)


def test_what_a_reason_implies_is_a_reason():
    values = {c.value for c in ALL_CODES}
    for code in ALL_CODES:
        assert reason(code).implies <= values - {code.value}, code.value


problems = st.lists(
    st.builds(Problem, st.sampled_from(ALL_CODES), st.text(min_size=1, max_size=5)),
    max_size=30,
)


@given(problems)
def test_roots_explain_everything_and_are_never_empty(ps):
    roots, hidden = root_problems(ps)
    assert sorted(map(id, roots + hidden)) == sorted(map(id, ps))  # a partition
    assert bool(roots) == bool(ps)  # something is always reported
    root_codes = {p.code for p in roots}
    for p in hidden:  # every hidden problem follows from a reason that is present
        assert any(p.code in implied(c) for c in {q.code for q in ps} - {p.code})
    assert not suppressed_codes(root_codes) & root_codes - {p.code for p in hidden}
    fatal = Fatal(ps) if ps else None
    if fatal is not None:  # the exit code is the causes', from the one table
        assert fatal.exit_code == max(reason(c).exit for c in root_codes)


facts = st.one_of(st.none(), st.text(min_size=1, max_size=8))


@given(st.sampled_from(ALL_CODES), facts, facts)
def test_a_problem_renders_only_what_it_knows(code, expected, found):
    text = Problem(code, "what", expected=expected, found=found).render()
    assert ("expected " in text) == (expected is not None)
    assert ("found " in text) == (found is not None)
    if expected is None and found is None:
        assert text == "what"


# -- through the command line ------------------------------------------------------------------
LAYER_RULE_FIELDS = ["num_hidden_layers", "num_experts", "first_k_dense_replace", "moe_layer_freq"]


@pytest.mark.parametrize("field", LAYER_RULE_FIELDS)
@pytest.mark.parametrize("value", [None, "x", -1, 2.5, 8.0, True, [3]])
def test_a_wrong_layer_rule_field_is_one_cause(field, value, small_source, tmp_path):
    src = tmp_path / "src"
    shutil.copytree(small_source, src)
    config = json.loads((src / "config.json").read_text())
    holder = config.get("text_config", config)
    holder[field] = value
    (src / "config.json").write_text(json.dumps(config))
    code, doc, codes = _json([src, tmp_path / "out", *ANY])
    assert codes == [Code.CONFIG_FIELD.value], doc  # one field, one line (not one per reader)
    # Every layer with experts would be "not a MoE layer", and "no experts" would follow.
    assert doc["suppressed"] >= 1 and Code.LAYER_UNEXPECTED.value in doc["suppressed_codes"]
    assert code == doc["exit_code"] == reason(Code.CONFIG_FIELD).exit
    text = _text([src, tmp_path / "out2", *ANY])
    assert "expected None" not in text and Code.LAYER_UNEXPECTED.value in text  # counted
    assert not (tmp_path / "out").exists()


def test_converting_a_converted_output_is_one_cause(converted, tmp_path):
    code, doc, codes = _json([converted, tmp_path / "again", *ANY])
    assert codes == [Code.ALREADY_MARKED.value]
    assert doc["suppressed"] == sum(doc["suppressed_codes"].values()) > 0
    assert set(doc["suppressed_codes"]) <= reason(Code.ALREADY_MARKED).implies
    assert code == doc["exit_code"] == reason(Code.ALREADY_MARKED).exit


@pytest.mark.parametrize("level", [[], ["--checksums"]])
def test_verifying_an_unconverted_source_is_one_cause(level, small_source):
    code, doc, listed = _json(["verify", small_source, *level])
    assert doc["codes"] == [Code.BLOCK_MISSING.value]
    assert doc["suppressed"] > 0
    assert set(doc["suppressed_codes"]) <= reason(Code.BLOCK_MISSING).implies
    assert listed == [Code.BLOCK_MISSING.value]
    assert code == doc["exit_code"] == reason(Code.BLOCK_MISSING).exit


def test_independent_causes_are_all_listed(source_copy, tmp_path):
    """Suppression is by reason, not by count: two unrelated causes both show."""
    config = json.loads((source_copy / "config.json").read_text())
    holder = config.get("text_config", config)
    holder["hidden_act"] = "silu"
    holder["moe_layer_freq"] = 0
    (source_copy / "config.json").write_text(json.dumps(config))
    _, _, codes = _json([source_copy, tmp_path / "out", *ANY])
    assert set(codes) == {Code.SITU_MISMATCH.value, Code.CONFIG_FIELD.value}
