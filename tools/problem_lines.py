"""Count the source lines spent constructing problems, per package.

A line counts when it lies inside a call that builds a `Problem` (`Problem(...)`, `problem`,
`fatal`, `fail`, `usage`) or a call of a local wrapper of one (a function whose one
statement returns, raises or appends a constructor's result), or inside such a wrapper's
definition. `converter/errors/` (where the reasons' records and the mechanism live) is
counted on its own lines, per module.

    python tools/problem_lines.py [ROOT]
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

CONSTRUCTORS = {"Problem", "problem", "fatal", "fail", "usage"}
PACKAGES = ("converter", "adapter")


def _name(call: ast.Call) -> str | None:
    f = call.func
    return f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else None


def _helpers(tree: ast.AST) -> dict[str, ast.AST]:
    """Wrappers of this file: functions whose one statement (a docstring aside) returns,
    raises or appends a constructor's result."""
    found = {}
    for node in ast.walk(tree):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        body = [
            s
            for s in node.body
            if not isinstance(s, ast.Expr) or not isinstance(s.value, ast.Constant)
        ]
        if len(body) != 1:
            continue
        stmt = body[0]
        value = getattr(stmt, "value", None) or getattr(stmt, "exc", None)
        if isinstance(value, ast.Call) and _name(value) == "append" and value.args:
            value = value.args[0]
        if isinstance(value, ast.Call) and _name(value) in CONSTRUCTORS:
            found[node.name] = node
    return found


def problem_lines(path: Path) -> set[int]:
    tree = ast.parse(path.read_text(), str(path))
    helpers = _helpers(tree)
    lines: set[int] = set()
    for node in helpers.values():
        lines.update(range(node.lineno, node.end_lineno + 1))
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and _name(node) in CONSTRUCTORS | helpers.keys():
            lines.update(range(node.lineno, node.end_lineno + 1))
    return lines


def main(root: Path) -> None:
    errors = root / "converter" / "errors"
    for package in PACKAGES:
        files = sorted(p for p in (root / package).rglob("*.py") if errors not in p.parents)
        spent = sum(len(problem_lines(p)) for p in files)
        total = sum(len(p.read_text().splitlines()) for p in files)
        print(f"{package}/: {spent} lines constructing problems, {total} lines in all")
    for p in sorted(errors.glob("*.py")):
        print(f"converter/errors/{p.name}: {len(p.read_text().splitlines())} lines")


if __name__ == "__main__":
    main(Path(sys.argv[1] if len(sys.argv) > 1 else "."))
