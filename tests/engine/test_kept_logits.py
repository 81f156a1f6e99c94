"""Kept logits (engine.kept_logits) with the real default model: a prompt sent again computes nothing and
answers exactly as a cold engine does (tokens and logprobs, greedy and seeded, penalties and grammars), never
across namespaces, and a tenant's reset or a cache reset drops what it kept.

One engine with prefix caching and one without are shared by the module; after every test no block may still
be in use.
"""

from __future__ import annotations

import asyncio
import json

import pytest

from engine.async_engine import AsyncEngine
from engine.request import Origin
from engine.sampling_params import SamplingParams
from engine.structured_output import StructuredOutputSpec
from kv_cache import CacheNamespace
from metrics.stats import IterationStats, SchedulerStats, StatLogger

pytestmark = pytest.mark.slow


def kept(engine: AsyncEngine):
    store = engine._core.kept_logits
    assert store is not None, "the default model's kernels are batch invariant: logits are kept"
    return store


def prompt(engine: AsyncEngine, text: str, length: int | None = None) -> list[int]:
    ids = engine.tokenizer.encode(text, add_special_tokens=False)
    return ids[:length] if length is not None else ids


async def answer(
    engine: AsyncEngine, ids: list[int], params: SamplingParams, origin: Origin | None = None
) -> tuple[list, int]:
    """(token, logprob, top) per output token, and the cached prompt tokens."""
    record, cached_tokens = [], 0
    async for out in engine.generate(ids, params, origin=origin):
        for c in out.outputs:
            lps = c.logprobs or [None] * len(c.token_ids)
            record += [(t, lp and (lp.logprob, lp.top)) for t, lp in zip(c.token_ids, lps, strict=True)]
        cached_tokens = out.num_cached_tokens
    return record, cached_tokens


class Counted(StatLogger):
    """Sums what the engine's steps report."""

    def __init__(self) -> None:
        self.kept_hits = self.prompt_tokens = 0

    def record(self, scheduler_stats: SchedulerStats, iteration_stats: IterationStats) -> None:
        self.kept_hits += iteration_stats.num_kept_logits_hits
        self.prompt_tokens += iteration_stats.num_prompt_tokens


TEXT = (
    "The harbour master's log for the ninth of March records three ships: the Aurora, carrying timber from "
    "Riga; the Halcyon, with copper wire for the depot at Kiel; and the Meridian, which turned back in the "
    "storm. Question: which ship carried copper wire, and where to? Answer:"
)
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, logprobs=3)


@pytest.mark.parametrize("length", [48, 45], ids=["full-last-block", "partial-last-block"])
async def test_a_prompt_sent_again_computes_nothing_and_answers_as_a_cold_engine(cached, uncached, length):
    ids = prompt(cached, TEXT, length)
    assert len(ids) == length
    reference, _ = await answer(uncached, ids, GREEDY)
    store = kept(cached)
    counted = Counted()
    cached._core.stat_loggers.append(counted)
    try:
        first, first_hit = await answer(cached, ids, GREEDY)
        hits = store.hits
        again, hit = await answer(cached, ids, GREEDY)
    finally:
        cached._core.stat_loggers.remove(counted)
    assert first_hit < length and hit == length  # every prompt token from the cache, its last one too
    assert store.hits == hits + 1  # its first token was sampled from the kept row: no forward
    assert again == first == reference and len(reference) == 8
    # brine_prefix_cache_kept_logits_hits_total: the second send; and its prompt computed no token
    assert counted.kept_hits == 1 and counted.prompt_tokens == length - first_hit


async def test_seeded_sampling_and_penalties_from_a_kept_row_are_those_of_a_cold_engine(cached, uncached):
    ids = prompt(cached, "Write a short poem about the sea and a lighthouse keeper named Ada.")
    seeded = SamplingParams(max_tokens=10, temperature=0.9, seed=1234, logprobs=2)
    penalized = SamplingParams(max_tokens=10, temperature=0.0, repetition_penalty=1.5, presence_penalty=0.5)
    await answer(cached, ids, GREEDY)  # keeps the row
    for params in (seeded, penalized, GREEDY):  # greedy last: the penalties must not have touched the row
        reference, _ = await answer(uncached, ids, params)
        hits = kept(cached).hits
        got, hit = await answer(cached, ids, params)
        assert hit == len(ids) and kept(cached).hits == hits + 1
        assert got == reference, params


async def test_a_constrained_request_samples_its_kept_row_under_its_grammar(cached, uncached):
    ids = prompt(cached, "Give the ship's name and cargo as JSON.")
    schema = {
        "type": "object",
        "properties": {"ship": {"type": "string"}, "cargo": {"type": "string"}},
        "required": ["ship", "cargo"],
    }
    params = SamplingParams(
        max_tokens=30,
        temperature=0.0,
        structured=StructuredOutputSpec("json_schema", json.dumps(schema, sort_keys=True)),
    )
    await answer(cached, ids, SamplingParams(max_tokens=1, temperature=0.0))  # keeps the row, unconstrained
    reference, _ = await answer(uncached, ids, params)
    got, hit = await answer(cached, ids, params)
    assert hit == len(ids) and got == reference


async def test_kept_logits_never_cross_namespaces_and_go_with_a_tenants_reset(cached):
    ids = prompt(cached, "Summarize the tenancy agreement between the landlord and Mr. Okafor in one line.")
    alice = Origin(CacheNamespace(tenant="alice"))
    bob = Origin(CacheNamespace(tenant="bob"))
    store = kept(cached)
    await answer(cached, ids, GREEDY, alice)
    _, bob_hit = await answer(cached, ids, GREEDY, bob)
    assert bob_hit == 0  # bob's first send: nothing of alice's, blocks or logits
    hits = store.hits
    _, alice_hit = await answer(cached, ids, GREEDY, alice)
    assert alice_hit == len(ids) and store.hits == hits + 1
    n = len(store)
    cached.forget_prefix_cache(("tenant", "alice"))
    assert len(store) == n - 1  # alice's row is gone, bob's stays
    _, alice_hit = await answer(cached, ids, GREEDY, alice)
    assert alice_hit == 0 and store.hits == hits + 1
    assert cached.reset_prefix_cache()
    assert len(store) == 0


async def test_without_its_kept_row_a_prompt_sent_again_recomputes_its_last_token(cached, uncached):
    ids = prompt(cached, TEXT, 45)
    reference, _ = await answer(uncached, ids, GREEDY)
    await answer(cached, ids, GREEDY)
    kept(cached).clear()  # pushed out (the store is bounded) or dropped: the KV alone is hit
    got, hit = await answer(cached, ids, GREEDY)
    assert hit == len(ids) - 1 and got == reference


async def test_many_sends_of_one_prompt_at_once_all_answer_as_a_cold_engine(cached, uncached):
    ids = prompt(cached, "List four colours of the rainbow:")
    reference, _ = await answer(uncached, ids, GREEDY)
    await answer(cached, ids, GREEDY)
    results = await asyncio.gather(*(answer(cached, ids, GREEDY) for _ in range(6)))
    assert all(r == reference for r, _ in results)
    assert all(hit == len(ids) for _, hit in results)


def test_no_logits_are_kept_without_prefix_caching(uncached):
    assert uncached._core.kept_logits is None


async def test_a_kept_row_beside_computed_rows_answers_as_a_cold_engine(cached, uncached):
    """A step with both: a running decode and a prompt prefilling (rows from the forward) and a prompt sent
    again (its kept row), each answering as alone."""
    ids = prompt(cached, TEXT, 45)
    busy = prompt(cached, "Count slowly from one to fifty, one number per line:")
    fresh = prompt(cached, "Name the largest moon of Saturn.")
    long = SamplingParams(max_tokens=40, temperature=0.0, logprobs=1)
    refs = [await answer(uncached, p, s) for p, s in ((ids, GREEDY), (fresh, GREEDY), (busy, long))]
    await answer(cached, ids, GREEDY)
    hits = kept(cached).hits
    running = asyncio.create_task(answer(cached, busy, long))
    await asyncio.sleep(0.3)  # decoding by now
    got = await asyncio.gather(answer(cached, ids, GREEDY), answer(cached, fresh, GREEDY), running)
    assert [g for g, _ in got] == [r for r, _ in refs]
    assert got[0][1] == len(ids) and kept(cached).hits == hits + 1
