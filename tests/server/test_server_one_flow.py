"""One way for each flow in the server (issue 34): every generation route (chat, completions, Messages,
Responses) answers through `server.serving.Generation.respond`, and no route module reaches into another's
private names to build its own."""

from __future__ import annotations

import ast
from pathlib import Path

import server.serving

SERVER = Path(server.serving.__file__).parent


def _modules() -> dict[str, ast.Module]:
    return {p.name: ast.parse(p.read_text(encoding="utf-8")) for p in sorted(SERVER.rglob("*.py"))}


def test_one_respond_for_every_generation_route() -> None:
    defined = [
        name
        for name, tree in _modules().items()
        for node in ast.walk(tree)
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.name == "respond"
    ]
    assert defined == ["serving.py"]


def test_no_route_imports_the_generation_modules_private_names() -> None:
    private = [
        f"{name}: {alias.name}"
        for name, tree in _modules().items()
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom) and node.module in ("server.generation", "server.serving")
        for alias in node.names
        if alias.name.startswith("_")
    ]
    assert private == []
