"""The README stays a README, and the docs cannot rot silently.

- README.md stays short (the detail lives in docs/, one page per topic) and links every docs/ page;
- every relative link in README.md and docs/*.md names a file that exists, and a `#fragment` names a heading
  of that page (GitHub's anchor rules);
- the quick start's `make` commands are Makefile targets;
- every repository path a page names (`engine/...py`, `tests/...`, `docker/...`) exists, so a moved file
  moves its docs with it;
- every `path.py` and `path.py:function` docs/architecture.md names exists, so the map follows the code.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = ROOT / "docs"
MAX_README_LINES = 260
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^(```|~~~)")


def prose_lines(text: str) -> list[str]:
    """The lines outside fenced code blocks (a `# comment` in a shell block is not a heading)."""
    out, fenced = [], False
    for line in text.splitlines():
        if FENCE.match(line.strip()):
            fenced = not fenced
        elif not fenced:
            out.append(line)
    return out


def anchors(page: Path) -> set[str]:
    """GitHub's heading ids: lowercased, punctuation but `-` and `_` dropped, spaces to `-`; repeats get -N."""
    seen: dict[str, int] = {}
    out = set()
    for line in prose_lines(page.read_text()):
        m = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not m:
            continue
        slug = re.sub(r"[^\w\- ]", "", m.group(1).lower()).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    return out


def links(page: Path) -> list[str]:
    return [t for line in prose_lines(page.read_text()) for t in LINK.findall(line)]


def pages() -> list[Path]:
    return [README, *sorted(DOCS.glob("*.md"))]


def test_readme_is_short() -> None:
    n = len(README.read_text().splitlines())
    assert n <= MAX_README_LINES, f"README.md has {n} lines: move detail to a docs/ page and link it"


@pytest.mark.parametrize("page", pages(), ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(page: Path) -> None:
    broken = []
    for target in links(page):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # https:, mailto:: not ours to check offline
            continue
        path, _, fragment = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            broken.append(f"{target}: no such file")
        elif fragment and dest.suffix == ".md" and fragment not in anchors(dest):
            broken.append(f"{target}: no heading #{fragment} in {dest.relative_to(ROOT)}")
    assert not broken, broken


def test_readme_links_every_docs_page() -> None:
    linked = {(ROOT / t.partition("#")[0]).resolve() for t in links(README) if t.startswith("docs/")}
    assert linked, "README.md links no docs/ page"
    orphans = [p.name for p in DOCS.glob("*.md") if p.resolve() not in linked]
    assert not orphans, f"docs pages no README link reaches: {orphans}"


def test_quick_start_commands_are_makefile_targets() -> None:
    text = README.read_text()
    quick = text[text.index("\n## Quick start\n") : text.index("\n## ", text.index("\n## Quick start\n") + 1)]
    block = re.search(r"```bash\n(.*?)```", quick, re.S)
    assert block, "the quick start has no bash block"
    commands = re.findall(r"^make (\w[\w-]*)", block.group(1), re.M)
    assert {"serve", "test"} <= set(commands), commands
    makefile = (ROOT / "Makefile").read_text()
    for target in commands:
        assert re.search(rf"^{re.escape(target)}:", makefile, re.M), f"make {target}: no such Makefile target"
    # `make serve` serves the embedded default model: no MODEL means brine's default.
    assert re.search(r"^MODEL \?=\s*$", makefile, re.M)
    assert "brine serve $(MODEL)" in makefile


REPO_PATH = re.compile(
    r"(?<![\w/.])((?:server|engine|kv_cache|metrics|tests|benchmarks|docker|\.ci)/[\w./-]*[\w-])(?=[`:)\s,;])"
)


@pytest.mark.parametrize("page", pages(), ids=lambda p: str(p.relative_to(ROOT)))
def test_every_repository_path_named_exists(page: Path) -> None:
    # Build outputs (the benchmarks' baseline venvs) are not in a clean checkout.
    named = {p for p in REPO_PATH.findall(page.read_text()) if "/.venv" not in p}
    missing = sorted(p for p in named if not (ROOT / p.rstrip("/")).exists())
    assert not missing, f"{page.relative_to(ROOT)} names paths that do not exist: {missing}"


def defined_names(path: Path) -> set[str]:
    """Top-level functions and classes of a module, and `Class.method` for their methods."""
    names = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        if isinstance(node, ast.ClassDef):
            for item in node.body:
                if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    names.add(f"{node.name}.{item.name}")
        if isinstance(node, (ast.Assign, ast.AnnAssign)):  # a registry such as ARCHITECTURES
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names.update(t.id for t in targets if isinstance(t, ast.Name))
    return names


def architecture_references() -> list[tuple[str, str | None]]:
    """Every `dir/file.py` or `dir/file.py:name` in docs/architecture.md's backticks."""
    text = (DOCS / "architecture.md").read_text()
    refs = []
    for code in re.findall(r"`([^`\n]+)`", text):
        for m in re.finditer(r"\b([\w./-]+\.(?:py|cpp|h))(?::([\w.]+))?", code):
            refs.append((m.group(1), m.group(2)))
    return refs


def test_architecture_map_names_only_what_exists() -> None:
    refs = architecture_references()
    assert len(refs) >= 10, "docs/architecture.md should name the files of the request path"
    missing = []
    for path, name in refs:
        file = ROOT / path
        if not file.is_file():
            missing.append(path)
        elif name is not None and name not in defined_names(file):
            missing.append(f"{path}:{name}")
    assert not missing, f"docs/architecture.md names what does not exist: {missing}"
