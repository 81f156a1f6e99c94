"""Structured outputs in the engine: the grammar compiler's cache and errors, a sequence's grammar state, and
the sampler's per-row masks (constrained rows obey their grammar; every other row keeps its exact bits and
tokens). A tiny raw vocabulary keeps these fast; the e2e tests use the default model's tokenizer."""

from __future__ import annotations

import json

import pytest
import torch
import xgrammar as xgr

from engine.grammar_masks import apply_masks
from engine.outputs import ScheduledRequest
from engine.request import Request
from engine.sampler import Sampler
from engine.sampling_params import SamplingParams
from engine.structured_output import (
    GrammarCompiler,
    GrammarState,
    StructuredOutputError,
    StructuredOutputSpec,
)

EOS = 0
VOCAB = ["<eos>", "{", "}", '"', ":", ",", " ", "[", "]", "a", "b", "ab", "1", "2", "12", "true", "x", "y"]
V = 40  # the model's logits are wider than the vocabulary: ids 18..39 are padding, never allowed
ID = {t: i for i, t in enumerate(VOCAB)}
SCHEMA = StructuredOutputSpec(
    "json_schema",
    json.dumps({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}),
)


@pytest.fixture(scope="module")
def compiler() -> GrammarCompiler:
    info = xgr.TokenizerInfo(VOCAB, vocab_type=xgr.VocabType.RAW, vocab_size=V, stop_token_ids=[EOS])
    return GrammarCompiler(info)


def _allowed(state: GrammarState) -> set[int]:
    logits = torch.zeros(1, V)
    out = apply_masks(logits, [(0, state)], V)
    return set(torch.nonzero(out[0] > float("-inf")).flatten().tolist())


def _walk(state: GrammarState, text: list[str]) -> None:
    for tok in text:
        assert ID[tok] in _allowed(state), (tok, _allowed(state))
        state.accept(ID[tok])


def test_the_mask_follows_the_schema_token_by_token(compiler: GrammarCompiler) -> None:
    state = GrammarState(compiler.compile(SCHEMA))
    assert _allowed(state) == {ID["{"]}
    _walk(state, ["{", '"', "a", '"', ":", " "])
    assert _allowed(state) == {ID["1"], ID["2"], ID["12"]}  # an integer, and no padding id
    _walk(state, ["12", "}"])
    assert _allowed(state) == {EOS}  # complete: only the stop token
    state.accept(EOS)
    assert not state.active


def test_choice_regex_and_grammar_kinds(compiler: GrammarCompiler) -> None:
    choice = GrammarState(compiler.compile(StructuredOutputSpec("choice", json.dumps(["ab", "x"]))))
    assert _allowed(choice) == {ID["a"], ID["ab"], ID["x"]}
    regex = GrammarState(compiler.compile(StructuredOutputSpec("regex", "[xy]+1")))
    _walk(regex, ["x", "y", "x"])
    assert _allowed(regex) == {ID["x"], ID["y"], ID["1"]}
    ebnf = GrammarState(compiler.compile(StructuredOutputSpec("grammar", 'root ::= "b" ("b")*')))
    _walk(ebnf, ["b"])
    assert _allowed(ebnf) == {ID["b"], EOS}


def test_compiles_once_per_spec_and_bad_specs_raise_a_client_error() -> None:
    info = xgr.TokenizerInfo(VOCAB, vocab_type=xgr.VocabType.RAW, vocab_size=V, stop_token_ids=[EOS])
    timings: list[float] = []
    compiler = GrammarCompiler(info, on_compile=timings.append)
    first = compiler.compile(SCHEMA)
    assert compiler.compile(StructuredOutputSpec(SCHEMA.kind, SCHEMA.spec)) is first
    assert len(timings) == 1 and timings[0] >= 0
    for bad in (
        StructuredOutputSpec("regex", "(unclosed"),
        StructuredOutputSpec("json_schema", '{"type": "object", "minProperties": "x"}'),
        StructuredOutputSpec("grammar", "root ::= ???"),
    ):
        with pytest.raises(StructuredOutputError) as info_:
            compiler.compile(bad)
        assert info_.value.param == "response_format"
    assert len(timings) == 1  # failures are not timed as compilations


def test_masked_rows_leave_every_other_row_bit_identical(compiler: GrammarCompiler) -> None:
    logits = torch.randn(6, V, generator=torch.Generator().manual_seed(0))
    states = [(1, GrammarState(compiler.compile(SCHEMA))), (4, GrammarState(compiler.compile(SCHEMA)))]
    out = apply_masks(logits, states, V)
    for row in (0, 2, 3, 5):
        assert torch.equal(out[row], logits[row])
    for row, _ in states:
        assert out[row][ID["{"]] == logits[row][ID["{"]]
        assert torch.isinf(out[row]).sum() == V - 1
    assert not torch.isinf(logits).any()  # the caller's tensor is untouched (raw logprobs read it)


def _sched(params: SamplingParams, rid: str, grammar: GrammarState | None = None) -> ScheduledRequest:
    tokens = [5, 6, 7]
    return ScheduledRequest(
        rid, tokens[-1:], 2, [0], True, params, tokens, 3, 0, grammar=grammar, eos_token_ids=frozenset({EOS})
    )


def test_free_rows_sample_the_same_tokens_beside_constrained_ones(compiler: GrammarCompiler) -> None:
    sampler = Sampler(torch.device("cpu"), V)
    logits = torch.randn(8, V, generator=torch.Generator().manual_seed(3)) * 3
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.8, seed=7)] * 4
    free = [_sched(p, f"f{i}") for i, p in enumerate(params)]
    alone = sampler(logits[[0, 2, 4, 6]], [free[i] for i in (0, 2, 4, 6)]).token_ids.tolist()
    mixed = [
        _sched(p, f"m{i}", GrammarState(compiler.compile(SCHEMA))) if i % 2 else free[i]
        for i, p in enumerate(params)
    ]
    # Rows 0, 2, 4, 6 are free (greedy and seeded alike); the odd rows are constrained.
    both = sampler(logits, mixed).token_ids.tolist()
    assert [both[i] for i in (0, 2, 4, 6)] == alone
    assert all(both[i] == ID["{"] for i in (1, 3, 5, 7))


def test_a_request_advances_its_grammar_with_output_tokens_only(compiler: GrammarCompiler) -> None:
    state = GrammarState(compiler.compile(SCHEMA))
    req = Request("r", [ID["x"], ID["y"]], SamplingParams(), grammar=state)  # prompt tokens: not JSON
    assert state.active and _allowed(state) == {ID["{"]}
    req.append_output_token(ID["{"])
    assert ID["{"] not in _allowed(state) and ID['"'] in _allowed(state)
