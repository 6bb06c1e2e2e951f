"""Layers point one way (docs/design.md, "The map"): no import circle among hetplan/planner/ modules
or among hetplan/runtime/ modules (imports inside functions count), and no package of the planner
imports one above it: files, then hardware and workload, then cost, sim, search (so hetplan/planner/cost
imports nothing from hetplan/planner/sim). Functions are short: at most LONGEST lines outside the reference loop."""
from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PLANNER, RUNTIME = "hetplan/planner", "hetplan/runtime"


def _modules(package: str) -> dict[str, Path]:
    out = {}
    for path in sorted((ROOT / package).rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def imports(package: str) -> dict[str, set[str]]:
    """Per module of `package`, the modules of `package` it imports anywhere in its file
    (`from a import b` names a.b where that is a module, else a)."""
    mods = _modules(package)
    out = {}
    for name, path in mods.items():
        here = name if path.name == "__init__.py" else name.rpartition(".")[0]
        found = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                found |= {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = here.split(".")[:len(here.split(".")) - node.level + 1]
                    base = ".".join(up + ([base] if base else []))
                found |= {f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base for a in node.names}
        out[name] = {m for m in found if m in mods and m != name}
    return out


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))
    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_no_import_circle_among_planner_modules():
    assert circles(imports(PLANNER)) == []


def test_no_import_circle_among_runtime_modules():
    assert circles(imports(RUNTIME)) == []


def test_cost_imports_nothing_from_sim():
    got = {m: sorted(x for x in deps if x.startswith("hetplan.planner.sim"))
           for m, deps in imports(PLANNER).items() if m.startswith("hetplan.planner.cost")}
    assert {m: d for m, d in got.items() if d} == {}


LAYERS = {"files": 0, "hardware": 1, "workload": 1, "cost": 2, "sim": 3, "search": 4}


def test_no_planner_package_imports_one_above_it():
    def layer(m: str) -> int | None:
        parts = m.split(".")
        return LAYERS.get(parts[2]) if len(parts) > 2 else None
    up = [(m, x) for m, deps in imports(PLANNER).items() for x in deps
          if layer(m) is not None and layer(x) is not None
          and (layer(x) > layer(m) or (layer(x) == layer(m) and m.split(".")[2] != x.split(".")[2]))]
    assert up == []
    assert set(LAYERS) == {p.name for p in (ROOT / PLANNER).iterdir() if (p / "__init__.py").exists()}


def test_design_names_every_planner_module():
    # docs/design.md's map: a newcomer finds every module there (`sim/engines.py` and the like)
    design = (ROOT / "docs" / "design.md").read_text()
    missing = [str(p.relative_to(ROOT / PLANNER)) for p in sorted((ROOT / PLANNER).rglob("*.py"))
               if p.name != "__init__.py" and str(p.relative_to(ROOT / PLANNER)) not in design]
    assert missing == []


def test_the_checks_see_a_circle_through_a_function_level_import(tmp_path, monkeypatch):
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from pkg import b\n")
    (pkg / "b.py").write_text("def f():\n    from pkg.c import g\n")
    (pkg / "c.py").write_text("import pkg.a\n")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    assert circles(imports("pkg")) == [["pkg.a", "pkg.b", "pkg.c"]]


LONGEST = 80   # a function's lines, its decorators and docstring included
LONG_ALLOWED = {
    "hetplan/planner/sim/reference.py",          # the specification reads top to bottom in one loop
}


def long_functions(packages=("hetplan",)) -> list[str]:
    """`path:name (lines)` of each function (methods and nested functions too) over LONGEST lines."""
    out = []
    for package in packages:
        for path in sorted((ROOT / package).rglob("*.py")):
            rel = str(path.relative_to(ROOT))
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    lines = node.end_lineno - min([node.lineno] + [d.lineno for d in node.decorator_list]) + 1
                    if lines > LONGEST and rel not in LONG_ALLOWED and f"{rel}:{node.name}" not in LONG_ALLOWED:
                        out.append(f"{rel}:{node.name} ({lines})")
    return out


def test_no_function_over_80_lines():
    assert long_functions() == []


def test_the_length_check_sees_a_long_method(tmp_path, monkeypatch):
    (tmp_path / "pkg").mkdir()
    body = "".join(f"        x = {i}\n" for i in range(LONGEST - 1))
    (tmp_path / "pkg" / "m.py").write_text(f"class A:\n    def short(self):\n        pass\n\n    def f(self):\n{body}")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    assert long_functions(("pkg",)) == []                 # 80 lines: allowed
    (tmp_path / "pkg" / "m.py").write_text(f"class A:\n    def f(self):\n{body}        y = 0\n")
    assert long_functions(("pkg",)) == ["pkg/m.py:f (81)"]


def _above(name: str, allowed: tuple[str, ...]) -> bool:
    """A module of hetplan outside `allowed`, or a benchmark."""
    return name.split(".")[0] == "benchmarks" or (
        name.split(".")[0] == "hetplan" and not any(name == a or name.startswith(a + ".") for a in allowed))


@pytest.mark.parametrize("package,allowed", [(PLANNER, ("hetplan.planner",)),
                                             (RUNTIME, ("hetplan.planner", "hetplan.runtime"))])
def test_no_package_imports_a_layer_above_it(package, allowed):
    """planner below runtime below the CLI (the rest of hetplan): a circle across them starts with
    such an import (hetplan.runtime.worker once took the training flags from hetplan.commands.run)."""
    bad = []
    for name, path in _modules(package).items():
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                     [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else [])
            bad += [f"{name} imports {n}" for n in names if _above(n, allowed)]
    assert bad == []
