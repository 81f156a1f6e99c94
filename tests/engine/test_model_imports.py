"""engine/model's layout holds (issue 34): no import cycle anywhere in engine/, and imports run one way.

Every import counts, wherever it sits: a function-level or `TYPE_CHECKING` import that closes a loop is still
a loop (it only moves where the loop bites). The direction inside engine/model: kernels -> layers -> models
<- loading, with attention beside layers; the runner (engine/model_runner.py) assembles them. So kernels,
layers and attention never import a model or the loader, and a model never imports the loader.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
ENGINE = ROOT / "engine"


def _module(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _graph() -> dict[str, set[str]]:
    """module -> the engine modules it imports (any import statement in the file)."""
    modules = {_module(p): p for p in ENGINE.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        deps: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                # `from pkg import mod` imports pkg.mod where that is a module, else pkg itself.
                targets = [
                    f"{node.module}.{a.name}" for a in node.names if f"{node.module}.{a.name}" in modules
                ]
                targets = targets or [node.module]
            else:
                continue
            deps.update(t for t in targets if t in modules and t != name)
        graph[name] = deps
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

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


def test_no_import_cycles_in_the_model_and_lora_packages():
    cycles = [c for c in _cycles(_graph()) if any(m.startswith(("engine.model", "engine.lora")) for m in c)]
    assert cycles == []


def test_the_cycle_check_sees_a_function_level_import():
    graph = {"a": {"b"}, "b": {"a"}, "c": set()}
    assert _cycles(graph) == [["a", "b"]]
    assert "engine.model.device" in _graph()["engine.model.layers.linear"]  # inside compute_dtype


def test_imports_run_kernels_to_layers_to_models_and_loading_builds_on_them():
    below = {  # package -> the engine.model packages it must never import
        "kernels": ("layers", "attention", "models", "loading.loader", "loading.quantize"),
        "layers": ("attention", "models", "loading"),
        "attention": ("layers", "models", "loading"),
        "models": ("loading",),
    }
    wrong = []
    for name, deps in _graph().items():
        if not name.startswith("engine.model."):
            continue
        package = name.split(".")[2]
        for forbidden in below.get(package, ()):
            wrong += [f"{name} -> {d}" for d in deps if d.startswith(f"engine.model.{forbidden}")]
    assert wrong == []
