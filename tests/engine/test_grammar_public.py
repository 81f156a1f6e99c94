"""Operator-declared public grammars (--public-grammar-dir, engine.grammar_public): compiled once before
serving and shared by every namespace (no request compiles them, so none can time another's), never dropped
by a reset; every other schema stays private to its namespace. A request's schema matches a public file
after canonical JSON (the server's own text for it), a regex or EBNF file byte for byte less its final
newline; a file that cannot be used names itself."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import xgrammar as xgr

from engine.config import EngineConfig
from engine.grammar_public import PublicGrammarError, load_public_specs
from engine.structured_output import GrammarCompiler
from engine.structured_spec import StructuredOutputError, StructuredOutputSpec
from kv_cache.namespace import CacheNamespace
from server import cli, serve
from server.structured import _schema_text

VOCAB = ["<eos>", "{", "}", '"', ":", ",", " ", "[", "]", "a", "b", "ab", "1", "2", "12", "true", "x", "y"]
SCHEMA = {"type": "object", "properties": {"b": {"type": "string"}, "a": {"type": "integer"}}}
A, B, SALTED = CacheNamespace(tenant="a"), CacheNamespace(tenant="b"), CacheNamespace(salt="s")


def _info() -> xgr.TokenizerInfo:
    return xgr.TokenizerInfo(VOCAB, vocab_type=xgr.VocabType.RAW, vocab_size=40, stop_token_ids=[0])


@pytest.fixture
def public_dir(tmp_path: Path) -> Path:
    (tmp_path / "order.json").write_text(json.dumps(SCHEMA, indent=2))
    (tmp_path / "letters.regex").write_text("[xy]+\n")
    (tmp_path / "bees.ebnf").write_text('root ::= "b" ("b")*\n')
    (tmp_path / "README.md").write_text("not a grammar")
    (tmp_path / ".hidden.json").write_text("{")
    return tmp_path


def test_files_become_the_specs_requests_send(public_dir: Path) -> None:
    specs = dict(load_public_specs(public_dir))
    assert sorted(specs) == ["bees.ebnf", "letters.regex", "order.json"]  # others skipped
    # The server's text for the same schema, its keys in any order: the same spec.
    reordered = dict(reversed(list(SCHEMA.items())))
    assert specs["order.json"] == StructuredOutputSpec("json_schema", _schema_text(reordered, "guided_json"))
    assert specs["letters.regex"] == StructuredOutputSpec("regex", "[xy]+")
    assert specs["bees.ebnf"] == StructuredOutputSpec("grammar", 'root ::= "b" ("b")*')


def test_a_public_grammar_is_compiled_once_and_shared_by_every_namespace(public_dir: Path) -> None:
    compiler = GrammarCompiler(_info())
    named = load_public_specs(public_dir)
    compiler.add_public(named)
    assert compiler.compiles == 0 and len(compiler) == 0  # not request compiles, not in the LRU cache
    assert compiler.public_bytes > 0
    for _, spec in named:
        shared = compiler.cached(spec, A)
        assert shared is not None
        assert all(compiler.cached(spec, ns) is shared for ns in (B, SALTED, None))
        assert compiler.compile(spec, B) is shared
    assert compiler.compiles == 0
    compiler.forget(("tenant", "a"))
    compiler.forget()  # a global reset forgets tenants' grammars, not the operator's
    assert all(compiler.cached(spec, A) is not None for _, spec in named)
    private = StructuredOutputSpec("regex", "[xy]+1")  # not declared: per namespace as ever
    compiler.compile(private, A)
    assert compiler.cached(private, B) is None and compiler.compiles == 1


def test_a_public_file_that_cannot_be_used_names_itself(tmp_path: Path) -> None:
    (tmp_path / "broken.json").write_text("{")
    with pytest.raises(PublicGrammarError, match="broken.json: not valid JSON"):
        load_public_specs(tmp_path)
    (tmp_path / "broken.json").write_text("[1]")
    with pytest.raises(PublicGrammarError, match="broken.json: a JSON schema must be an object"):
        load_public_specs(tmp_path)
    (tmp_path / "broken.json").unlink()
    (tmp_path / "bad.regex").write_text("(unclosed")
    compiler = GrammarCompiler(_info())
    with pytest.raises(PublicGrammarError, match="public grammar bad.regex: .*could not be compiled"):
        compiler.add_public(load_public_specs(tmp_path))
    slow = GrammarCompiler(_info(), mask_budget_s=0.0)
    with pytest.raises(PublicGrammarError, match="per token"):
        slow.add_public([("letters.regex", StructuredOutputSpec("regex", "[xy]+"))])
    with pytest.raises(PublicGrammarError, match="not a directory"):
        load_public_specs(tmp_path / "missing")
    assert issubclass(PublicGrammarError, ValueError) and not issubclass(
        PublicGrammarError, StructuredOutputError
    )  # the operator's error, which stops the start; never a client's 400


def test_the_flag_reaches_the_engine_config(tmp_path: Path) -> None:
    args = cli.build_parser().parse_args(["serve", "--public-grammar-dir", str(tmp_path)])
    assert serve.engine_config(args, []).public_grammar_dir == str(tmp_path)
    assert EngineConfig().public_grammar_dir is None
