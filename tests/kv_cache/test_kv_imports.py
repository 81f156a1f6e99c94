"""kv_cache's imports: no cycle between its modules, and never torch, engine, server or metrics.

Every import counts, TYPE_CHECKING and function-level ones included: a cycle hidden behind TYPE_CHECKING is
still two modules that cannot be read (or moved) one without the other.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "kv_cache"


def imports_of(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


def graph() -> dict[str, set[str]]:
    modules = {f"kv_cache.{p.stem}": p for p in PACKAGE.glob("*.py") if p.stem != "__init__"}
    return {m: {i for i in imports_of(p) if i in modules} for m, p in modules.items()}


def test_no_module_of_kv_cache_imports_torch_or_anything_above_it() -> None:
    above = ("torch", "engine", "server", "metrics")
    bad = {p.name: sorted(i for i in imports_of(p) if i.split(".")[0] in above) for p in PACKAGE.glob("*.py")}
    assert {name: found for name, found in bad.items() if found} == {}


def test_kv_cache_modules_import_each_other_without_a_cycle() -> None:
    edges = graph()
    done: set[str] = set()

    def visit(module: str, path: list[str]) -> None:
        if module in path:
            raise AssertionError("import cycle: " + " -> ".join([*path[path.index(module) :], module]))
        if module in done:
            return
        for dep in sorted(edges[module]):
            visit(dep, [*path, module])
        done.add(module)

    for module in sorted(edges):
        visit(module, [])
    assert "kv_cache.tier_bridge" not in edges["kv_cache.lookup"]  # the shared records depend on neither
    assert "kv_cache.manager" not in edges["kv_cache.tier_bridge"]
