"""The jlora package's import graph has no cycles.

Every module of `jlora` is parsed with `ast` (nothing is imported), and each `import` or
`from ... import` of another jlora module becomes an edge, wherever it stands: at the top of the
module or deferred inside a function. A deferred import keeps Python from failing on a cycle,
not the reader from following it: `cli -> demo -> cli` is still two modules that each need the
other. `from jlora.models import quant` is an edge to `jlora.models.quant`; `from jlora.models
import Llama` one to `jlora.models` (its `__init__`).
"""

from __future__ import annotations

import ast
from pathlib import Path

import jlora

ROOT = Path(jlora.__file__).resolve().parent


def package_modules(root: Path = ROOT) -> dict[str, Path]:
    """Dotted module name -> file, for every .py under the package."""
    mods = {}
    for f in sorted(root.rglob("*.py")):
        parts = (root.name,) + f.relative_to(root).with_suffix("").parts
        mods[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = f
    return mods


def import_graph(mods: dict[str, Path]) -> dict[str, set[str]]:
    """Module -> the package modules it imports (anywhere in its body)."""
    graph: dict[str, set[str]] = {}
    for mod, f in mods.items():
        package = mod if f.name == "__init__.py" else mod.rpartition(".")[0]
        edges = set()
        for node in ast.walk(ast.parse(f.read_text(), str(f))):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                    base = ".".join(up + ([base] if base else []))
                names = [f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base for a in node.names]
            else:
                continue
            edges.update(n for n in names if n in mods and n != mod)
        graph[mod] = edges
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Cycles (paths back to their start) in every strongly connected component of more than one
    module: a shortest one through each of its modules, each cycle once."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found = []

    def visit(v: str) -> None:  # Tarjan
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                comp.append(w)
                if w == v:
                    break
            for start in sorted(comp) if len(comp) > 1 else ():
                cycle = _cycle_in(start, set(comp), graph)
                first = cycle.index(min(cycle))  # one rotation per cycle, so each is listed once
                cycle = cycle[first:-1] + cycle[:first] + [cycle[first]]
                if cycle not in found:
                    found.append(cycle)

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def _cycle_in(start: str, comp: set[str], graph: dict[str, set[str]]) -> list[str]:
    """A shortest path from `start` back to itself, inside its component."""
    paths = {start: [start]}
    frontier = [start]
    while frontier:
        nxt = []
        for v in frontier:
            for w in sorted(graph[v] & comp):
                if w == start:
                    return paths[v] + [start]
                if w not in paths:
                    paths[w] = paths[v] + [w]
                    nxt.append(w)
        frontier = nxt
    raise AssertionError(f"no cycle through {start} in {sorted(comp)}")


def test_jlora_has_no_import_cycles():
    found = cycles(import_graph(package_modules()))
    assert not found, "import cycles:\n" + "\n".join(" -> ".join(c) for c in found)


def test_the_checker_finds_a_cycle_and_reads_deferred_and_relative_imports(tmp_path):
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from pkg.sub import b\n")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "sub" / "b.py").write_text("def f():\n    from ..c import x\n")
    (pkg / "c.py").write_text("import pkg.a\nx = 1\n")
    (pkg / "d.py").write_text("from pkg import c\n")  # into the cycle, not part of it
    mods = package_modules(pkg)
    assert set(mods) == {"pkg", "pkg.a", "pkg.sub", "pkg.sub.b", "pkg.c", "pkg.d"}
    assert cycles(import_graph(mods)) == [["pkg.a", "pkg.sub.b", "pkg.c", "pkg.a"]]
    (pkg / "c.py").write_text("x = 1\n")
    assert cycles(import_graph(package_modules(pkg))) == []
