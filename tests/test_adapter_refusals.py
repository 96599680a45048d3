"""The adapter's user-facing refusals are the converter's error values.

Rule (read from the adapter's source, every module): a `raise` whose exception is built
from text written at the raise site (a string literal, an f-string, or text joined from
them) is allowed only for Python's built-in exceptions that signal a programming error
inside the adapter (`ValueError`, `TypeError`, `KeyError`, `IndexError`, `AssertionError`,
`NotImplementedError`, `RuntimeError`, `AttributeError`) and for click's own option-parsing
errors (`click.BadParameter`, as the converter's CLI uses it). Every other exception, the
ones users see (`PrebuildError`, `SplitError`, `LayoutError`, `W31LoadError`,
`SituUnsupportedError`, `SmokeError`, `ServeError`, `BundleError`, ...), is built from a
`Fatal`: a reason code and facts, its words (and its hint) in the reason's record; nor may
such a class word itself (text given to its base's `__init__`). A programming-error
exception that reaches a user is wrapped into a coded refusal where it is caught
(prebuild's GPU check).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
from kimi_w31.adapter.reasons import AdapterCode
from kimi_w31.adapter.refused import Refused
from kimi_w31.converter.errors import Fatal, fatal

ADAPTER = Path(__file__).resolve().parent.parent / "adapter"
PROGRAMMING = {
    "ValueError",
    "TypeError",
    "KeyError",
    "IndexError",
    "AssertionError",
    "NotImplementedError",
    "RuntimeError",
    "AttributeError",
    "BadParameter",
}


def _is_text(node: ast.AST) -> bool:
    """Text written here: a str literal, an f-string, or text joined with them."""
    if isinstance(node, ast.Constant):
        return isinstance(node.value, str)
    if isinstance(node, ast.JoinedStr):
        return True
    if isinstance(node, ast.BinOp):
        return _is_text(node.left) or _is_text(node.right)
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
        return node.func.attr in ("join", "format") and _is_text(node.func.value)
    return False


def _name(func: ast.AST) -> str:
    if isinstance(func, ast.Attribute):
        return func.attr
    return func.id if isinstance(func, ast.Name) else ""


def _has_text(call: ast.Call) -> bool:
    return any(_is_text(a) for a in [*call.args, *(k.value for k in call.keywords)])


def _is_super_init(call: ast.Call) -> bool:
    """`super().__init__(...)`: where an exception class words itself."""
    func = call.func
    return (
        isinstance(func, ast.Attribute)
        and func.attr == "__init__"
        and isinstance(func.value, ast.Call)
        and _name(func.value.func) == "super"
    )


def hand_written_raises(source: str, where: str) -> list[str]:
    """`where:line: Name` for each raise of a non-programming exception built from text,
    and for each exception class that words itself (text passed to its base's `__init__`:
    every raise of it would carry words of no record; a class the adapter declares is never
    one of Python's built-in exceptions, whatever its base)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Raise) and isinstance(node.exc, ast.Call):
            name = _name(node.exc.func)
            if name not in PROGRAMMING and _has_text(node.exc):
                found.append(f"{where}:{node.lineno}: {name}")
        elif isinstance(node, ast.ClassDef):
            found += [
                f"{where}:{call.lineno}: {node.name}"
                for call in ast.walk(node)
                if isinstance(call, ast.Call) and _is_super_init(call) and _has_text(call)
            ]
    return found


def test_no_adapter_refusal_is_written_at_its_raise_site():
    found = [
        hit
        for path in sorted(ADAPTER.rglob("*.py"))
        for hit in hand_written_raises(path.read_text(), str(path.relative_to(ADAPTER)))
    ]
    assert found == []


@pytest.mark.parametrize(
    "source",
    [
        'raise SplitError("bad tensor")',
        'raise PrebuildError(f"building {x} failed")',
        'raise LayoutError("a" + b)',
        'raise click.ClickException(f"smoke: {exc}")',
        'raise W31LoadError(message="no")',
        'raise SmokeError(", ".join(parts))',
    ],
)
def test_the_rule_sees_hand_written_text(source):
    """Negative control: each of these spellings is caught."""
    assert hand_written_raises(source, "x.py") == [
        "x.py:1: " + source.split("(")[0].split(".")[-1].split()[-1]
    ]


@pytest.mark.parametrize(
    "source",
    [
        "raise SplitError(fatal(AdapterCode.W31_UNSPLITTABLE, rule='grammar', tensor=name))",
        'raise ValueError(f"chunk must be positive, got {chunk}")',
        "raise LayoutError(Fatal([exc.problem])) from None",
        "raise click.ClickException(str(exc))",
    ],
)
def test_the_rule_lets_coded_and_programming_errors_pass(source):
    assert hand_written_raises(source, "x.py") == []


WORDS_ITSELF = """
class BundleError(RuntimeError):
    def __init__(self, problems):
        super().__init__(
            "kernel bundle refused:\\n  - "
            + "\\n  - ".join(p.render() for p in problems)
        )
"""


def test_the_rule_sees_a_class_that_words_itself():
    """Negative control: text given to the base's `__init__` by a refusal class is caught,
    wherever its raises are (they pass only problems)."""
    assert hand_written_raises(WORDS_ITSELF, "x.py") == ["x.py:4: BundleError"]
    coded = WORDS_ITSELF.split("super().__init__(")[0] + "super().__init__(words(problems))\n"
    assert hand_written_raises(coded, "x.py") == []


def test_every_adapter_refusal_class_is_built_from_a_fatal():
    from kimi_w31.adapter.bundle import BundleError
    from kimi_w31.adapter.flashinfer_moe import SituUnsupportedError
    from kimi_w31.adapter.layout import LayoutError
    from kimi_w31.adapter.prebuild import PrebuildError
    from kimi_w31.adapter.sglang.hooks import W31LoadError
    from kimi_w31.adapter.sglang.smoke import SmokeError
    from kimi_w31.adapter.split import SplitError

    for cls in (
        BundleError,
        SituUnsupportedError,
        LayoutError,
        PrebuildError,
        W31LoadError,
        SmokeError,
        SplitError,
    ):
        assert issubclass(cls, Refused)
        err = cls(fatal(AdapterCode.NO_TOKEN))
        assert err.reason == AdapterCode.NO_TOKEN.value and err.codes == (
            AdapterCode.NO_TOKEN.value,
        )
        assert f"[{AdapterCode.NO_TOKEN.value}]" in str(err) and err.exit_code == 1


def test_a_refusal_keeps_every_problem_and_the_records_exit_code():
    error = Fatal(
        [
            *fatal(AdapterCode.BAD_STREAM, payload="x").problems,
            *fatal(AdapterCode.BAD_FLAG, rule="no-value", flag="--tp").problems,
        ]
    )
    err = Refused(error)
    assert err.codes == (AdapterCode.BAD_STREAM.value, AdapterCode.BAD_FLAG.value)
    assert err.exit_code == 2  # bad-flag is a usage reason: it wins
