"""Operator-declared public grammars (`--public-grammar-dir`): schemas and grammars the operator lists as
shared, compiled once when the server starts and used by every cache namespace.

Why they may be shared: compiled grammars are cached per namespace because a cache hit answers faster than a
compile, which would tell a tenant that another tenant sent the same schema (issue 28). A public grammar is
compiled before any request arrives, so its answer time is the same for everyone whoever sent it first, and
the operator has declared its text no secret: the same reasoning as `--public-prefix` for KV blocks. Every
other schema stays private to its namespace.

A file is one grammar, by its suffix: `.json` a JSON schema (matched after canonical JSON, `schema_text`: key
order does not matter), `.regex` a regex and `.ebnf` / `.gbnf` an EBNF grammar (matched byte for byte, less
the file's final newline). Other files are skipped with a warning; a file that cannot be read or parsed stops
the server with its name, as a bad flag does.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

from engine.structured_spec import StructuredOutputSpec, schema_text

logger = logging.getLogger(__name__)

KIND_BY_SUFFIX = {".json": "json_schema", ".regex": "regex", ".ebnf": "grammar", ".gbnf": "grammar"}


class PublicGrammarError(ValueError):
    """A public grammar file the server cannot use: the operator's to fix, before the server serves."""


def load_public_specs(directory: str | Path) -> list[tuple[str, StructuredOutputSpec]]:
    """(file name, spec) of every grammar file in `directory`, in name order."""
    root = Path(directory)
    if not root.is_dir():
        raise PublicGrammarError(f"--public-grammar-dir {directory}: not a directory")
    out: list[tuple[str, StructuredOutputSpec]] = []
    for path in sorted(p for p in root.iterdir() if p.is_file() and not p.name.startswith(".")):
        kind = KIND_BY_SUFFIX.get(path.suffix)
        if kind is None:
            logger.warning("public grammars: %s skipped (not .json, .regex, .ebnf or .gbnf)", path.name)
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise PublicGrammarError(f"public grammar {path.name}: cannot be read ({exc})") from None
        out.append((path.name, StructuredOutputSpec(kind, _spec_text(path.name, kind, text))))
    return out


def _spec_text(name: str, kind: str, text: str) -> str:
    if kind != "json_schema":
        return text[:-1] if text.endswith("\n") else text
    try:
        schema = json.loads(text)
    except ValueError as exc:
        raise PublicGrammarError(f"public grammar {name}: not valid JSON ({exc})") from None
    if not isinstance(schema, dict):
        raise PublicGrammarError(f"public grammar {name}: a JSON schema must be an object")
    return schema_text(schema)
