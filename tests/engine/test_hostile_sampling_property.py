"""No sampling request takes the engine down or changes another's tokens: a property test on the real default
model.

Hypothesis draws sampling parameters at and past their extremes (NaN, infinities, 1e-300, zero and huge
temperatures, penalties, top-p / top-k / min-p cut to nothing), with and without an output constraint, with
logprobs, with min_tokens, and sends the request alone and beside an innocent greedy request. Half of the
draws skip `SamplingParams.validate`, as if a bound had been forgotten: the sampler and the runner must still
fail that request alone. Every time: the innocent request's tokens and logprobs are those it gets alone, the
hostile request's tokens (if any) lie inside the vocabulary, the engine is healthy, every KV block is back.
"""

from __future__ import annotations

import asyncio
import json
import math

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine.async_engine import AsyncEngine
from engine.config import EngineConfig
from engine.sampling_params import SamplingParams
from engine.structured_output import StructuredOutputSpec

pytestmark = pytest.mark.slow

INNOCENT = SamplingParams(max_tokens=6, temperature=0.0, logprobs=2, ignore_eos=True)


class Unchecked(SamplingParams):
    """SamplingParams whose validation was forgotten: what reaches the sampler is whatever was drawn."""

    def validate(self) -> None:
        return None


def _floats(*extremes: float) -> st.SearchStrategy[float]:
    return st.sampled_from(extremes)


NAN, INF = math.nan, math.inf
CONSTRAINTS = [
    None,
    StructuredOutputSpec("choice", json.dumps(["a"])),
    StructuredOutputSpec("choice", json.dumps(["yes", "no"])),
    StructuredOutputSpec("regex", "[0-9]{2}"),
    StructuredOutputSpec("json_object", ""),
]


@st.composite
def hostile(draw: st.DrawFn) -> SamplingParams:
    max_tokens = draw(st.sampled_from([1, 2, 6]))
    fields = dict(
        max_tokens=max_tokens,
        temperature=draw(_floats(0.0, 1e-6, 1e-5, 2e-5, 0.7, 2.0, 1e4, NAN, INF, -1.0)),
        top_p=draw(_floats(1.0, 0.5, 1e-9, 1e-30, 0.0, NAN, 1.5)),
        top_k=draw(st.sampled_from([0, -1, 1, 2, 10**6])),
        min_p=draw(_floats(0.0, 0.5, 1.0, 1e-30, NAN, 2.0)),
        presence_penalty=draw(_floats(0.0, -2.0, 2.0, 1e30, -1e30, NAN)),
        frequency_penalty=draw(_floats(0.0, -2.0, 2.0, 1e30, -INF, NAN)),
        repetition_penalty=draw(_floats(1.0, 1e-300, 0.01, 100.0, 1e-45, 1e30, INF, NAN)),
        min_tokens=draw(st.sampled_from([0, 1, 2, max_tokens])),
        logprobs=draw(st.sampled_from([None, 0, 20])),
        seed=draw(st.sampled_from([None, 0, 2**63 - 1])),
        ignore_eos=draw(st.booleans()),
        structured=draw(st.sampled_from(CONSTRAINTS)),
    )
    return (Unchecked if draw(st.booleans()) else SamplingParams)(**fields)


@pytest.fixture(scope="module")
def engine():
    eng = AsyncEngine.from_config(EngineConfig(device="cpu", num_blocks=256, enable_prefix_caching=True))
    yield eng
    eng.shutdown()


async def _run(eng: AsyncEngine, prompt: list[int], params: SamplingParams) -> tuple[list, list, str | None]:
    tokens: list[int] = []
    lps: list[tuple] = []
    error = None
    try:
        async for out in eng.generate(prompt, params):
            error = out.error or error
            for c in out.outputs:
                tokens += c.token_ids
                lps += [(lp.logprob, tuple(lp.top)) for lp in c.logprobs or []]
    except ValueError as exc:  # refused before it was queued: the client's 400
        error = str(exc)
    return tokens, lps, error


@pytest.fixture(scope="module")
def prompts(engine):
    encode = engine.tokenizer.encode
    innocent = encode("The capital of France is", add_special_tokens=False)
    victim = encode(
        "Answer yes or no: is the sky blue? The answer, again and again, is", add_special_tokens=False
    )
    alone = asyncio.run(_run(engine, innocent, INNOCENT))
    return innocent, victim, alone


@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
@given(params=hostile(), batched=st.booleans())
def test_no_sampling_request_harms_the_engine_or_its_neighbour(engine, prompts, params, batched) -> None:
    innocent, prompt, alone = prompts
    vocab = engine.tokenizer.vocab_size

    async def both():
        if not batched:
            first = await _run(engine, prompt, params)
            return first, await _run(engine, innocent, INNOCENT)
        return await asyncio.gather(_run(engine, prompt, params), _run(engine, innocent, INNOCENT))

    (tokens, _, _), answer = asyncio.run(both())
    assert answer[:2] == alone[:2] and answer[2] is None, params
    assert all(0 <= t < vocab for t in tokens), (tokens, params)
    assert engine.is_healthy(), params
    assert engine.num_used_blocks() == 0


def test_the_reported_attacks_fail_alone_and_the_engine_stays_up(engine, prompts) -> None:
    """The security review's two requests, past validation: an engine-kill penalty and guided_choice ["a"]
    with min_tokens 2 (the grammar then allows only EOS, which min_tokens masks)."""
    innocent, prompt, alone = prompts
    kill = Unchecked(repetition_penalty=1e-300, temperature=1.0, max_tokens=8, logprobs=1)
    choice = SamplingParams(
        temperature=1.0, min_tokens=2, max_tokens=8, structured=StructuredOutputSpec("choice", '["a"]')
    )

    async def run():
        return await asyncio.gather(
            _run(engine, prompt, kill), _run(engine, prompt, choice), _run(engine, innocent, INNOCENT)
        )

    (_, _, kill_error), (choice_tokens, _, choice_error), answer = asyncio.run(run())
    assert kill_error is not None and "no token could be sampled" in kill_error
    assert choice_error is None and engine.tokenizer.decode(choice_tokens) == "a"
    assert answer == alone and engine.is_healthy()


@pytest.mark.parametrize(
    ("kind", "spec", "allowed"), [("choice", '["a"]', {"a"}), ("regex", "[0-9]{2}", None)]
)
def test_a_grammar_that_has_ended_ends_the_output_even_under_ignore_eos(
    engine, prompts, kind, spec, allowed
) -> None:
    """ignore_eos keeps a free output going past EOS; a constrained one has nothing left once its grammar
    accepted EOS, and went on unconstrained (guided_choice ["a"] answered "a\nassistant\nThe": a probe found it).
    The same under min_tokens, which a grammar that can only end overrides (test_sampler_hostile)."""
    _, prompt, _ = prompts
    for min_tokens in (0, 4):
        params = SamplingParams(
            temperature=0.0,
            ignore_eos=True,
            min_tokens=min_tokens,
            max_tokens=12,
            structured=StructuredOutputSpec(kind, spec),
        )
        tokens, _, error = asyncio.run(_run(engine, prompt, params))
        text = engine.tokenizer.decode(tokens)
        assert error is None and len(tokens) < params.max_tokens, (text, tokens)
        assert text in allowed if allowed else len(text) == 2 and text.isdigit(), text
    assert engine.num_used_blocks() == 0
