"""Each reason's message lives in its record (converter/reasons/, adapter/reasons/), and call
sites pass facts.

Three properties, over every code and every situation (`rule`) a code has:
- every code has a message, and it renders with any facts: each fact given shows in the
  problem, nothing is left unfilled;
- every call site in the packages names a code and a known rule literally and passes
  exactly the facts its message names (read from the source, so a site on an error path no
  test reaches is held too);
- no call site writes message text: problems are built only by `problem`/`fatal`.
"""

from __future__ import annotations

import ast
import string
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from kimi_w31.adapter import reasons as adapter_reasons
from kimi_w31.converter import errors
from kimi_w31.converter import reasons as converter_reasons
from kimi_w31.converter.errors import RECORDS, facts_of, message, problem, rules
from kimi_w31.converter.reasons import Code
from reason_codes import ALL_CODES

# The mechanism and the records are not call sites.
OWN = [Path(m.__file__).resolve().parent for m in (errors, converter_reasons, adapter_reasons)]
ROOT = OWN[0].parents[1]
ENUMS = {"Code": Code, "AdapterCode": adapter_reasons.AdapterCode}
PACKAGES = ("converter", "adapter")
SITUATIONS = [(code, rule) for code in ALL_CODES for rule in rules(code)]


def _ids(situation: tuple[Code, str | None]) -> str:
    code, rule = situation
    return code.value + (f"/{rule}" if rule else "")


def test_every_code_has_a_message():
    assert set(RECORDS) == {c.value for c in ALL_CODES}
    for code, rule in SITUATIONS:
        assert message(code, rule).what.strip(), _ids((code, rule))


def test_rules_are_kebab_case():
    for code, rule in SITUATIONS:
        if rule is not None:
            assert rule == rule.lower() and " " not in rule, _ids((code, rule))


def test_unknown_rule_is_refused():
    for code in ALL_CODES:
        with pytest.raises(KeyError):
            message(code, "no-such-rule")


def _specs(code: Code, rule: str | None) -> dict[str, str]:
    """Each fact's format spec in the templates ('' where it has none)."""
    m = message(code, rule)
    specs: dict[str, str] = {}
    for template in (m.what, m.expected, m.found, m.hint):
        for _, name, spec, _ in string.Formatter().parse(template or ""):
            if name:
                specs[name] = spec or specs.get(name, "")
    return specs


# A marker no template contains, so each fact's value can be found in the rendered text.
_token = st.integers(0, 10**6).map(lambda n: f"Q{n}Z")


@settings(max_examples=30, deadline=None)
@pytest.mark.parametrize("situation", SITUATIONS, ids=_ids)
@given(data=st.data())
def test_every_message_renders_every_fact(situation, data):
    code, rule = situation
    specs = _specs(code, rule)
    facts: dict[str, object] = {}
    for name in sorted(facts_of(code, rule)):
        spec = specs.get(name, "")
        facts[name] = (
            data.draw(st.floats(0.001, 1e6), label=name) if spec else data.draw(_token, label=name)
        )
    where = {"file": data.draw(_token, label="file"), "tensor": data.draw(_token, label="tensor")}
    p = problem(code, rule=rule, **where, **facts)
    assert p.code is code
    hint = errors.fatal(code, rule=rule, **where, **facts).hint
    text = " ".join(filter(None, (p.what, p.expected, p.found, hint)))
    for name, value in facts.items():
        assert "{" + name + "}" not in text, f"{_ids(situation)}: fact {name} left unfilled"
        if isinstance(value, str):
            assert value in text, f"{_ids(situation)}: fact {name} does not show"
    assert p.file == where["file"] and p.tensor == where["tensor"]
    assert p.as_dict()["code"] == code.value


def test_expected_and_found_pass_through_where_the_message_has_no_template():
    for code, rule in SITUATIONS:
        m = message(code, rule)
        facts = dict.fromkeys(facts_of(code, rule), 1.0)
        p = problem(code, rule=rule, expected="E9", found="F9", **facts)
        if m.expected is None:
            assert p.expected == "E9"
        if m.found is None:
            assert p.found == "F9"


# -- call sites, read from the source -------------------------------------------------------
def _sources() -> list[Path]:
    return sorted(
        p
        for pkg in PACKAGES
        for p in (ROOT / pkg).rglob("*.py")
        if not set(OWN) & set(p.resolve().parents)
    )


def _callee(call: ast.Call) -> str | None:
    f = call.func
    return f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else None


def _tables(tree: ast.Module) -> dict[str, list[Code]]:
    """Module-level tables {key: Code.X, ...} (or AdapterCode.X): a site may pick its code
    from one."""
    tables = {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Dict):
            codes = [_codes(v, {}) for v in node.value.values]
            if codes and all(c is not None for c in codes):
                for target in node.targets:
                    if isinstance(target, ast.Name):
                        tables[target.id] = [c for cs in codes for c in cs]  # type: ignore[union-attr]
    return tables


def _codes(node: ast.expr, tables: dict[str, list[Code]]) -> list[Code] | None:
    """The codes a call site's first argument can be: `Code.X`, `A if c else B`, or
    `TABLE[key]` for a module-level table of codes."""
    if (
        isinstance(node, ast.Attribute)
        and isinstance(node.value, ast.Name)
        and node.value.id in ENUMS
        and node.attr in ENUMS[node.value.id].__members__
    ):
        return [ENUMS[node.value.id][node.attr]]
    if isinstance(node, ast.IfExp):
        a, b = _codes(node.body, tables), _codes(node.orelse, tables)
        return a + b if a is not None and b is not None else None
    if isinstance(node, ast.Subscript) and isinstance(node.value, ast.Name):
        return tables.get(node.value.id)
    return None


def _site_faults(path: Path, call: ast.Call, tables: dict[str, list[Code]]) -> list[str]:
    at = f"{path.relative_to(ROOT)}:{call.lineno}"
    if not call.args:
        return [f"{at}: no code"]
    codes = _codes(call.args[0], tables)
    if codes is None or len(call.args) != 1:
        return [f"{at}: the code must be written Code.X, and the rest passed as facts"]
    if any(k.arg is None for k in call.keywords):
        return [f"{at}: **facts cannot be checked; pass each fact by name"]
    given = {k.arg: k.value for k in call.keywords}
    rule_node = given.pop("rule", None)
    if rule_node is not None and not isinstance(rule_node, ast.Constant):
        return [f"{at}: rule must be a literal"]
    rule = rule_node.value if rule_node is not None else None
    faults = [
        f"{at}: {name}= is prose written at the call site; words belong in its record"
        for name, value in given.items()
        if _prose(value)
    ]
    for code in codes:
        if rule not in rules(code):
            faults.append(f"{at}: {code.value} has no rule {rule!r} (it has {rules(code)})")
            continue
        m = message(code, rule)
        need = facts_of(code, rule)
        allowed = need | {"file", "tensor", "hint"}
        allowed |= {name for name in ("expected", "found") if getattr(m, name) is None}
        if missing := need - given.keys():
            faults.append(f"{at}: {code.value}/{rule} needs facts {sorted(missing)}")
        if extra := given.keys() - allowed:
            faults.append(f"{at}: {code.value}/{rule} has no use for {sorted(extra)}")
    return faults


def _prose(node: ast.expr) -> bool:
    """A string literal (or an f-string's literal text) of two words or more: a message
    written where a fact belongs. Facts are values: names, numbers, paths, an OS's error."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return len(node.value.split()) >= 2
    if isinstance(node, ast.JoinedStr):
        text = "".join(v.value if isinstance(v, ast.Constant) else "x" for v in node.values)
        return len(text.split()) >= 2
    return False


def test_every_call_site_passes_the_facts_its_message_names():
    faults = []
    for path in _sources():
        tree = ast.parse(path.read_text(), str(path))
        tables = _tables(tree)
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and _callee(node) in {"problem", "fatal"}:
                faults += _site_faults(path, node, tables)
    assert faults == []


def test_the_checker_catches_free_text_a_missing_fact_and_an_unknown_rule():
    # any code with one message and a fact; named by member so this test asserts no code
    code = next(c for c in Code if rules(c) == [None] and facts_of(c))
    fact = sorted(facts_of(code))[0]
    here = ROOT / "converter" / "x.py"

    def faults(src: str) -> list[str]:
        site = ast.parse(src.replace("CODE", f"Code.{code.name}")).body[0].value
        return _site_faults(here, site, {})

    assert faults('problem(CODE, "some words", file=f)')
    assert any(fact in f for f in faults("problem(CODE, file=f)"))
    full = ", ".join(f"{n}=1" for n in facts_of(code))
    assert faults(f"problem(CODE, {full})") == []
    assert any("what" in f for f in faults(f"problem(CODE, {full}, what=w)"))
    assert faults(f"problem(CODE, rule='x', {full})")
    assert faults("problem(CODE, **facts)")
    assert any("prose" in f for f in faults(f"problem(CODE, {full}, hint='do this first')"))
    assert any("prose" in f for f in faults(f"problem(CODE, {full}, hint=f'rerun {{x}} now')"))


def test_no_call_site_writes_message_text():
    """Problems are built by `problem`/`fatal` only: a `Problem(code, "words")`, or the old
    `fail`/`usage` with free text, would put the message back at the call site."""
    written = []
    for path in _sources():
        rel = path.relative_to(ROOT).as_posix()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Call) and _callee(node) in {"Problem", "fail", "usage"}:
                written.append(f"{rel}:{node.lineno}")
    assert written == []


def _raised() -> set[tuple[Code, str | None]]:
    """Every (code, rule) some call site in the packages raises."""
    raised = set()
    for path in _sources():
        tree = ast.parse(path.read_text(), str(path))
        tables = _tables(tree)
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and _callee(node) in {"problem", "fatal"}:
                rule = next((k.value for k in node.keywords if k.arg == "rule"), None)
                name = rule.value if isinstance(rule, ast.Constant) else None
                raised |= {(code, name) for code in _codes(node.args[0], tables) or []}
    return raised


def test_every_message_is_raised_somewhere():
    """A message no call site raises is a situation nobody can meet: dead words, or a call
    site that lost its rule."""
    raised = _raised()
    unused = [_ids(s) for s in SITUATIONS if s not in raised]
    assert unused == []
