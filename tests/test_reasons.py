"""One reason, one record: every member of the converter's `Code` and the adapter's
`AdapterCode` is exactly one `Reason` (code string, exit code, message or per-rule messages,
what follows from it, together), so a reason cannot lack an exit code or words, and its words
name only facts `problem()` can take. The enums are built from the records, so most of this
holds by construction; these tests hold the construction (and its refusals)."""

from __future__ import annotations

import inspect
import pickle
from enum import Enum

import pytest
from kimi_w31.adapter import reasons as adapter_reasons
from kimi_w31.converter import reasons as converter_reasons
from kimi_w31.converter.errors import (
    EXIT_PROBLEMS,
    EXIT_USAGE,
    RECORDS,
    Message,
    Reason,
    facts_of,
    fatal,
    message,
    problem,
    reason,
    rules,
    template_names,
)
from kimi_w31.converter.errors.registry import code_enum
from kimi_w31.converter.reasons import Code
from reason_codes import ALL_CODES

PACKAGES = (converter_reasons, adapter_reasons)
ALL_RECORDS = [r for package in PACKAGES for area in package.AREAS for r in area.REASONS]
# What a template may not name: problem()'s own parameters that are not facts, and fatal()'s
# hint (its own argument, so a fact of that name would be taken as the call site's hint).
NOT_FACTS = {"code", "rule", "hint"}


@pytest.mark.parametrize("code", ALL_CODES, ids=lambda c: c.value)
def test_every_member_has_exactly_one_record(code):
    assert [r.code for r in ALL_RECORDS].count(code.value) == 1
    assert reason(code).code == code.value
    assert isinstance(code, str) and code == code.value


def test_every_record_is_a_member_in_declaration_order():
    enums = (converter_reasons.Code, adapter_reasons.AdapterCode)
    for package, enum in zip(PACKAGES, enums, strict=True):
        assert [c.value for c in enum] == [r.code for a in package.AREAS for r in a.REASONS]
    assert set(RECORDS) == {c.value for c in ALL_CODES}


@pytest.mark.parametrize("code", ALL_CODES, ids=lambda c: c.value)
def test_every_record_has_an_exit_code_and_words_over_facts_problem_accepts(code):
    record = reason(code)
    assert record.exit in {EXIT_PROBLEMS, EXIT_USAGE}
    accepts = inspect.signature(problem)
    for rule in rules(code):
        m = message(code, rule)
        assert m.what.strip()
        names = set().union(*(template_names(t) for t in (m.what, m.expected, m.found, m.hint)))
        assert all(n.isidentifier() for n in names), (code.value, rule, names)
        assert not names & NOT_FACTS, (code.value, rule, names & NOT_FACTS)
        facts = dict.fromkeys(facts_of(code, rule), 1.5)  # a number: some specs are numeric
        accepts.bind(code, rule=rule, file="F", tensor="T", **facts)  # no TypeError
        p = problem(code, rule=rule, file="F", tensor="T", **facts)
        hint = fatal(code, rule=rule, file="F", tensor="T", **facts).hint
        text = " ".join(filter(None, (p.what, p.expected, p.found, hint)))
        assert not any("{" + n + "}" in text for n in names), (code.value, rule)


def test_the_code_enum_is_a_stable_str_enum():
    assert issubclass(Code, str) and issubclass(Code, Enum)
    assert Code.HEADER_TOO_LARGE.value == "header-too-large"
    assert Code("header-too-large") is Code.HEADER_TOO_LARGE
    # problems travel between processes (the Ray executor): members pickle as themselves
    assert all(pickle.loads(pickle.dumps(c)) is c for c in ALL_CODES)


# -- negative controls: the construction refuses what the old table caught by a test --------
@pytest.mark.parametrize(
    "records",
    [
        [Reason("some-reason", "one"), Reason("some-reason", "two")],
        [Reason("another-reason", "new"), Reason(Code.HEADER_TOO_LARGE.value, "again")],
    ],
    ids=["within-one-enum", "across-enums"],
)
def test_a_code_declared_twice_is_refused_and_nothing_is_registered(records):
    before = dict(RECORDS)
    with pytest.raises(ValueError, match="twice"):
        code_enum("Twice", records, __name__, "")
    assert dict(RECORDS) == before


@pytest.mark.parametrize(
    "make",
    [
        lambda: Reason("r", "text", exit=3),
        lambda: Reason("r", "text", exit=0),
        lambda: Reason("r"),
        lambda: Reason("r", "text", rules={"a": Message("x")}),
        lambda: Reason("r", rules={"a": Message("x")}, hint="h"),
        lambda: Reason("r", rules={}),
    ],
    ids=["exit-3", "exit-0", "no-words", "text-and-rules", "rules-and-hint", "empty-rules"],
)
def test_a_malformed_record_is_refused(make):
    with pytest.raises(ValueError):
        make()


def test_a_rule_is_looked_up_only_where_the_reason_has_rules():
    plain = Reason("r", "text")
    with pytest.raises(KeyError):
        plain.message("a-rule")
    ruled = Reason("r", rules={"a": Message("x")})
    assert ruled.message("a") == Message("x") and ruled.situations() == ["a"]
    with pytest.raises(KeyError):
        ruled.message(None)
