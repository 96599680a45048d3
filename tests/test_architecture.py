"""The folder layout is the architecture: imports go one way, and there is no cycle.

Read from the source with `ast` (nothing is imported): every `import` and `from ... import`
of a package module, module-level or inside a function alike, is an edge.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = {
    "kimi_w31": ROOT / "kimi_w31",
    "kimi_w31.converter": ROOT / "converter",
    "kimi_w31.adapter": ROOT / "adapter",
    "kimi_w31.manifests": ROOT / "manifests",
}


def _modules() -> dict[str, Path]:
    found = {}
    for package, folder in PACKAGES.items():
        for path in folder.rglob("*.py"):
            parts = path.relative_to(folder).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            found[".".join((package, *parts))] = path
    return found


MODULES = _modules()


def _imports(name: str, path: Path) -> list[tuple[str, int, bool]]:
    """(imported module, line, relative?) for every import of a package module."""
    is_package = path.name == "__init__.py"
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(a.name, node.lineno, False) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".")
                base = base[: len(base) - node.level + (1 if is_package else 0)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            for alias in node.names:
                sub = f"{target}.{alias.name}"  # `from . import contract` imports a module
                out.append((sub if sub in MODULES else target, node.lineno, bool(node.level)))
    return [(t, line, rel) for t, line, rel in out if t in MODULES and t != name]


GRAPH = {name: sorted({t for t, _, _ in _imports(name, path)}) for name, path in MODULES.items()}


def test_the_package_import_graph_has_no_cycle():
    state: dict[str, int] = {}  # 1: on the stack, 2: done
    stack: list[str] = []

    def visit(node: str) -> None:
        state[node] = 1
        stack.append(node)
        for nxt in GRAPH[node]:
            if state.get(nxt) == 1:
                cycle = stack[stack.index(nxt) :] + [nxt]
                pytest.fail("import cycle: " + " -> ".join(cycle))
            if nxt not in state:
                visit(nxt)
        stack.pop()
        state[node] = 2

    for node in sorted(GRAPH):
        if node not in state:
            visit(node)


def test_the_converter_never_imports_the_adapter():
    bad = [
        f"{m} -> {t}"
        for m, ts in GRAPH.items()
        if m.startswith("kimi_w31.converter")
        for t in ts
        if t.startswith("kimi_w31.adapter")
    ]
    assert bad == []


# Each serving engine's folder under the adapter, and the top-level packages that are that
# engine: a module outside every engine folder is engine-neutral and imports none of them.
ENGINES = {"kimi_w31.adapter.sglang": ("sglang",)}


def _engine_of(module: str) -> str | None:
    return next((e for e in ENGINES if module == e or module.startswith(e + ".")), None)


def _absolute_imports(path: Path) -> set[str]:
    """Every module named by a non-relative import, package modules or not."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            found.add(node.module)
    return found


def test_engine_neutral_adapter_modules_never_import_an_engine():
    bad = []
    for name, path in MODULES.items():
        if not name.startswith("kimi_w31.adapter") or _engine_of(name):
            continue
        for target in GRAPH[name]:
            if _engine_of(target):
                bad.append(f"{name} -> {target}")
        for target in _absolute_imports(path):
            for engine, tops in ENGINES.items():
                if target.split(".")[0] in tops:
                    bad.append(f"{name} -> {target} (that is {engine})")
    assert bad == []


def test_one_engine_folder_never_imports_another():
    bad = [
        f"{m} -> {t}"
        for m, ts in GRAPH.items()
        if _engine_of(m)
        for t in ts
        if _engine_of(t) not in (None, _engine_of(m))
    ]
    assert bad == []


def test_imports_inside_a_package_are_relative():
    bad = []
    for name, path in MODULES.items():
        package = ".".join(name.split(".")[:2])
        for target, line, relative in _imports(name, path):
            if not relative and target.startswith(package + ".") and package != "kimi_w31":
                bad.append(f"{path.relative_to(ROOT)}:{line} imports {target}")
    assert bad == []


def test_the_graph_is_read_at_all():
    # A parser that saw nothing would pass the tests above: it must see known edges.
    assert "kimi_w31.converter.contract" in GRAPH["kimi_w31.adapter.layout"]
    assert "kimi_w31.converter.output.directory" in GRAPH["kimi_w31.converter.execute.shard"]
    # ...and the engine rule must see an engine's imports where they are.
    assert "kimi_w31.adapter.flashinfer_moe" in GRAPH["kimi_w31.adapter.sglang.moe_method"]
    sglang_bound = MODULES["kimi_w31.adapter.sglang.moe_method"]
    assert any(t.split(".")[0] == "sglang" for t in _absolute_imports(sglang_bound))
    assert any(_engine_of(m) for m in MODULES) and not _engine_of("kimi_w31.adapter.layout")
