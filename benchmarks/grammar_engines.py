"""xgrammar vs llguidance on this machine, with the default model's tokenizer: the cost of compiling a JSON
schema (cold) and of one token mask per generated token (fill + accept), walking a valid output token by token.

    .venv/bin/python -m benchmarks.grammar_engines

Why Brine uses xgrammar is written in engine/structured_output.py; this is the measurement behind it.
"""

from __future__ import annotations

import json
import statistics
import time

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "tags": {"type": "array", "items": {"type": "string", "enum": ["a", "b", "c"]}},
        "address": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "zip": {"type": "string"}},
            "required": ["city", "zip"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "age", "tags", "address"],
    "additionalProperties": False,
}
OUTPUT = {"name": "Ada Lovelace", "age": 36, "tags": ["a", "c"], "address": {"city": "London", "zip": "W1"}}


def _xgrammar(hf, vocab: int, eos: list[int], tokens: list[int]) -> tuple[float, float, float]:
    import xgrammar as xgr

    t0 = time.perf_counter()
    info = xgr.TokenizerInfo.from_huggingface(hf, vocab_size=vocab, stop_token_ids=eos)
    compiler = xgr.GrammarCompiler(info, max_threads=2, cache_enabled=False)
    t1 = time.perf_counter()
    compiled = compiler.compile_json_schema(json.dumps(SCHEMA), any_whitespace=False, separators=(", ", ": "))
    t2 = time.perf_counter()
    matcher = xgr.GrammarMatcher(compiled)
    bitmask = xgr.allocate_token_bitmask(1, vocab)
    per = []
    for tok in tokens:
        s = time.perf_counter()
        matcher.fill_next_token_bitmask(bitmask, 0)
        ok = matcher.accept_token(tok)
        per.append(time.perf_counter() - s)
        assert ok, tok
    return t1 - t0, t2 - t1, statistics.median(per)


def _llguidance(hf, vocab: int, eos: list[int], tokens: list[int]) -> tuple[float, float, float]:
    import llguidance
    import llguidance.hf
    import llguidance.torch

    t0 = time.perf_counter()
    tok = llguidance.hf.from_tokenizer(hf, n_vocab=vocab, eos_token=eos[0])
    t1 = time.perf_counter()
    grammar = llguidance.LLMatcher.grammar_from_json_schema(
        SCHEMA, defaults={"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
    )
    matcher = llguidance.LLMatcher(tok, grammar)
    if matcher.is_error():
        raise RuntimeError(matcher.get_error())
    t2 = time.perf_counter()
    bitmask = llguidance.torch.allocate_token_bitmask(1, vocab)
    per = []
    for t in tokens:
        s = time.perf_counter()
        llguidance.torch.fill_next_token_bitmask(matcher, bitmask, 0)
        ok = matcher.consume_token(t)
        per.append(time.perf_counter() - s)
        assert ok, (t, matcher.get_error())
    return t1 - t0, t2 - t1, statistics.median(per)


def main() -> None:
    from engine.model.loading.files import resolve_model
    from engine.tokenizer import Tokenizer

    files = resolve_model(None)
    tokenizer = Tokenizer(files.path)
    vocab = tokenizer.vocab_size
    eos = sorted(tokenizer.eos_token_ids)
    tokens = tokenizer.encode(json.dumps(OUTPUT), add_special_tokens=False)
    print(f"{files.name}: vocab {vocab}, walking {len(tokens)} output tokens")
    for name, fn in (("xgrammar", _xgrammar), ("llguidance", _llguidance)):
        setup, compile_s, per_token = fn(tokenizer.hf, vocab, eos, tokens)
        print(
            f"{name:11s} tokenizer setup {setup * 1e3:8.1f} ms  schema compile {compile_s * 1e3:7.2f} ms  "
            f"mask+accept per token (median) {per_token * 1e6:7.1f} us"
        )


if __name__ == "__main__":
    main()
