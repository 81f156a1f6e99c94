"""The engine with the real default model (slow): prefix caching changes nothing but the work done, and
output constraints change nothing for the free requests batched beside them.

One engine with prefix caching and one without are shared by the whole module; after every test no block may
still be in use.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time

import pytest

from engine.async_engine import AsyncEngine
from engine.detokenizer import IncrementalDetokenizer
from engine.sampling_params import SamplingParams
from engine.structured_output import StructuredOutputSpec

pytestmark = pytest.mark.slow

GREEDY = SamplingParams(max_tokens=24, temperature=0.0)


def chat_ids(engine: AsyncEngine, system: str, user: str) -> list[int]:
    messages = [{"role": "system", "content": system}, {"role": "user", "content": user}]
    return engine.tokenizer.encode(engine.tokenizer.apply_chat_template(messages), add_special_tokens=False)


async def run(
    engine: AsyncEngine, ids: list[int], params: SamplingParams = GREEDY
) -> tuple[list[int], str, int]:
    tokens, text, cached_tokens = [], "", 0
    async for out in engine.generate(ids, params):
        for c in out.outputs:
            tokens += c.token_ids
            text += c.text
        cached_tokens = out.num_cached_tokens
    return tokens, text, cached_tokens


async def test_single_requests_are_identical_with_and_without_prefix_caching(cached, uncached):
    ids = chat_ids(cached, "You are a terse assistant.", "Name three primary colors.")
    reference, ref_text, _ = await run(uncached, ids)
    first, first_text, _ = await run(cached, ids)
    again, _, hit = await run(cached, ids)  # now served mostly from the cache
    assert hit > 0
    assert first == again == reference and first_text == ref_text
    assert ref_text.strip()


async def test_eight_concurrent_requests_sharing_a_system_prompt(cached, uncached):
    system = "You are a helpful assistant who answers in one short sentence. " * 6
    questions = ["What is 2+2?", "Capital of France?", "Color of the sky?", "Opposite of hot?",
                 "Largest planet?", "Author of Hamlet?", "Boiling point of water?", "A synonym of big?"]  # fmt: skip
    prompts = [chat_ids(cached, system, q) for q in questions]
    with_cache = await asyncio.gather(*(run(cached, p) for p in prompts))
    without = await asyncio.gather(*(run(uncached, p) for p in prompts))
    assert [t for t, _, _ in with_cache] == [t for t, _, _ in without]
    shared_blocks = len(system) // 8 // 16  # loose lower bound on the shared prefix's full blocks
    assert sum(hit for _, _, hit in with_cache) >= 7 * shared_blocks * 16
    assert all(hit == 0 for _, _, hit in without)


async def test_a_prompt_sent_again_recomputes_nothing_and_answers_the_same(cached, uncached):
    ids = chat_ids(cached, "You are a precise assistant.", "List the planets of the solar system, in order.")
    assert len(ids) % 16 > 1, "the test needs a last block that is partly filled"
    params = SamplingParams(max_tokens=8, temperature=0.0, logprobs=2)

    async def answer(engine: AsyncEngine) -> tuple[list, int]:
        record, cached_tokens = [], 0
        async for out in engine.generate(ids, params):
            for c in out.outputs:
                record += [
                    (t, lp.logprob, lp.top) for t, lp in zip(c.token_ids, c.logprobs or [], strict=True)
                ]
            cached_tokens = out.num_cached_tokens
        return record, cached_tokens

    reference, _ = await answer(uncached)
    first, _ = await answer(cached)
    # Its full blocks by hash, then its partial block (a tail, copied), its last token's KV included: the
    # logits after it were kept (engine.kept_logits; tests/engine/test_kept_logits.py).
    again, hit = await answer(cached)
    assert hit == len(ids)
    assert again == first == reference and len(reference) == 8


async def test_a_second_request_with_the_same_1000_token_prefix_reuses_all_of_it(cached):
    tok = cached.tokenizer
    words = " ".join(f"item{i}" for i in range(2000))
    prefix = tok.encode(words, add_special_tokens=False)[:1000]
    assert len(prefix) == 1000
    params = SamplingParams(max_tokens=4, temperature=0.0)
    _, _, first_hit = await run(cached, prefix + tok.encode(" first", add_special_tokens=False), params)
    _, _, second_hit = await run(cached, prefix + tok.encode(" second one", add_special_tokens=False), params)
    # 992 tokens in full blocks, then the 8 of the next block the first request's tail shares.
    assert second_hit == 1000 and second_hit >= first_hit


async def test_streaming_detokenization_of_multilingual_text_is_exact(cached):
    tok = cached.tokenizer
    text = "日本語のテキスト、中文字符。مرحبا بالعالم! 👩‍👩‍👧 🎉🇯🇵 naïve café — Ελληνικά. 한국어 텍스트"
    ids = tok.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(tok.decode, tok.encode("Say:", add_special_tokens=False))
    deltas = [detok.step(i) for i in ids]
    assert "".join(deltas) + detok.flush() == tok.decode(ids) == text
    assert not any("\ufffd" in d for d in deltas)


async def test_streamed_output_text_equals_the_decode_of_its_tokens(cached):
    ids = chat_ids(cached, "Reply in Japanese with an emoji.", "Say good morning 🌅")
    params = SamplingParams(max_tokens=40, temperature=0.8, seed=3)
    tokens, text, _ = await run(cached, ids, params)
    eos = cached.tokenizer.eos_token_ids
    assert text == cached.tokenizer.decode([t for t in tokens if t not in eos])


def test_encoding_a_long_prompt_lets_other_threads_run(cached):
    """The server tokenizes in a worker thread; that only helps if the tokenizer releases the GIL meanwhile,
    or a long prompt would stall the event loop (and the engine thread) until it is encoded."""
    text = "The quick brown fox jumps over the lazy dog, again and again. " * 8000  # ~500 kB
    ticks, done = 0, threading.Event()

    def ticker() -> None:
        nonlocal ticks
        while not done.is_set():
            time.sleep(0.001)
            ticks += 1

    thread = threading.Thread(target=ticker)
    thread.start()
    try:
        ids = cached.tokenizer.encode(text, add_special_tokens=False)
    finally:
        done.set()
        thread.join()
    assert ids == cached.tokenizer.backend.encode(text, add_special_tokens=False).ids
    assert ticks >= 10, f"the other thread ran only {ticks} times while {len(ids)} tokens were encoded"


# A string longer than any run fills: each constrained request's grammar is live at every step it shares.
LONG_JSON = StructuredOutputSpec(
    "json_schema",
    json.dumps(
        {
            "type": "object",
            "properties": {"story": {"type": "string", "minLength": 4096}},
            "required": ["story"],
            "additionalProperties": False,
        },
        sort_keys=True,
    ),
)


async def test_sixteen_at_once_half_constrained_leave_the_free_half_unchanged(cached, uncached):
    """16 concurrent requests, 8 constrained to a JSON schema and 8 free (sampled with seeds): each free one
    gives the very tokens it gives alone, and the constrained ones ran constrained in the same steps. A
    constrained request gives the same tokens alone, in that batch, and with its prefix cached."""
    free = [
        (chat_ids(uncached, "You are a poet.", f"Write a line about the number {i}."), i) for i in range(8)
    ]
    params = [SamplingParams(max_tokens=24, temperature=0.9, seed=seed) for _, seed in free]
    alone = [(await run(uncached, ids, p))[0] for (ids, _), p in zip(free, params, strict=True)]
    asked = [chat_ids(uncached, "Answer in JSON.", f"Tell story number {i}.") for i in range(8)]
    json_params = SamplingParams(max_tokens=32, temperature=0.9, seed=7, structured=LONG_JSON)
    constrained_alone = (await run(uncached, asked[0], json_params))[0]
    results = await asyncio.gather(
        *[run(uncached, ids, p) for (ids, _), p in zip(free, params, strict=True)],
        *[run(uncached, ids, json_params) for ids in asked],
    )
    assert [tokens for tokens, _, _ in results[:8]] == alone
    for tokens, text, _ in results[8:]:
        assert len(tokens) == 32 and text.startswith('{"story": "'), text
    assert results[8][0] == constrained_alone
    await run(cached, asked[0], json_params)
    again, _, hit = await run(cached, asked[0], json_params)
    assert hit > 0 and again == constrained_alone
