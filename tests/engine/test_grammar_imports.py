"""The structured-output modules import one way (issue 34). From the top: the mask filling (grammar_masks)
and the compiler (structured_output) -> a sequence's grammar state and the sandbox -> the compile steps ->
the spec and its errors (structured_spec), with `SamplingParams` and the step records on the spec's side only.
Every import counts, those under TYPE_CHECKING and those inside functions too: an import moved into a
function hides a cycle from Python, not from the next reader."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
OURS = {
    "engine.structured_spec",
    "engine.grammar_compile",
    "engine.grammar_state",
    "engine.grammar_public",
    "engine.grammar_sandbox",
    "engine.structured_output",
    "engine.grammar_masks",
    "engine.sampling_params",
    "engine.outputs",
}


def _imports(module: str) -> set[str]:
    """Every engine module `module` imports, wherever in the file the import is."""
    tree = ast.parse((ROOT / (module.replace(".", "/") + ".py")).read_text())
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.add(node.module)
        elif isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
    return {m for m in out if m.startswith("engine.")}


def _graph() -> dict[str, set[str]]:
    """The import graph of engine's top-level modules (engine/model/ and other packages are not followed)."""
    modules = {f"engine.{p.stem}" for p in (ROOT / "engine").glob("*.py") if p.stem != "__init__"}
    return {m: _imports(m) & modules for m in modules}


def _cycle_through(graph: dict[str, set[str]], start: str) -> list[str] | None:
    """A path start -> ... -> start, if one exists."""
    stack: list[tuple[str, list[str]]] = [(start, [start])]
    seen: set[str] = set()
    while stack:
        node, path = stack.pop()
        for nxt in graph.get(node, ()):
            if nxt == start:
                return [*path, start]
            if nxt not in seen:
                seen.add(nxt)
                stack.append((nxt, [*path, nxt]))
    return None


def test_no_structured_output_module_is_on_an_import_cycle() -> None:
    graph = _graph()
    cycles = {m: c for m in sorted(OURS & set(graph)) if (c := _cycle_through(graph, m)) is not None}
    assert not cycles, " ; ".join(" -> ".join(c) for c in cycles.values())


def test_the_layers_point_down() -> None:
    graph = _graph()
    assert OURS <= set(graph)
    assert graph["engine.structured_spec"] == set()  # holding a spec imports nothing of the engine
    assert graph["engine.grammar_compile"] == {"engine.structured_spec"}
    assert graph["engine.grammar_state"] == {"engine.structured_spec", "engine.grammar_compile"}
    assert graph["engine.grammar_public"] == {"engine.structured_spec"}
    # The sandbox's workers are started by the one module that makes workers die with the server.
    assert graph["engine.grammar_sandbox"] == {
        "engine.structured_spec",
        "engine.grammar_compile",
        "engine.worker_process",
    }
    assert graph["engine.worker_process"] == set()
    assert graph["engine.grammar_masks"] == {"engine.grammar_state", "engine.outputs"}
    assert graph["engine.sampling_params"] <= {"engine.structured_spec"}
    for below in (
        "engine.structured_output",
        "engine.grammar_state",
        "engine.grammar_sandbox",
        "engine.grammar_public",
    ):
        assert "engine.grammar_masks" not in graph[below]
        assert "engine.outputs" not in graph[below]
