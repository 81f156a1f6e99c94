"""AsyncEngine with a fake runner: streaming, aborts from the consumer side, errors, engine death."""

from __future__ import annotations

import asyncio
import time

import pytest
from engine_fakes import ByteTokenizer, FakeRunner, scripted

from engine.async_engine import AsyncEngine, EngineDeadError
from engine.config import EngineConfig
from engine.engine_core import EngineCore
from engine.outputs import FinishReason
from engine.request import Origin
from engine.sampling_params import SamplingParams
from kv_cache.namespace import CacheNamespace


def make_engine(runner: FakeRunner | None = None, **kwargs) -> AsyncEngine:
    # 2 ms per step: slow enough that a request is still running when a test aborts it.
    core = EngineCore(
        runner or FakeRunner(num_blocks=64, step_delay=0.002), ByteTokenizer(), EngineConfig(**kwargs)
    )
    return AsyncEngine(core, core.tokenizer, model_name="fake")


@pytest.fixture
def engine():
    eng = make_engine()
    yield eng
    eng.shutdown()


async def wait_for_free_blocks(engine: AsyncEngine, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while engine.num_used_blocks() and time.monotonic() < deadline:
        await asyncio.sleep(0.01)
    assert engine.num_used_blocks() == 0


async def test_generate_streams_deltas_until_finished(engine):
    outs = [o async for o in engine.generate([1, 2, 3], SamplingParams(max_tokens=5, temperature=0))]
    assert [o.finished for o in outs] == [False] * 4 + [True]
    assert sum(len(o.outputs[0].token_ids) for o in outs) == 5
    assert (
        outs[-1].outputs[0].finish_reason is FinishReason.LENGTH
        and outs[-1].outputs[0].num_output_tokens == 5
    )
    assert engine.num_used_blocks() == 0 and engine.is_healthy()


async def test_concurrent_requests_with_a_shared_prefix_match_sequential_ones(engine):
    params = SamplingParams(max_tokens=6, temperature=0)
    prompts = [[9] * 12 + [i] for i in range(8)]

    async def run(p):
        return [t async for o in engine.generate(p, params) for t in o.outputs[0].token_ids]

    together = await asyncio.gather(*(run(p) for p in prompts))
    alone = [await run(p) for p in prompts]
    assert together == alone
    assert engine.num_used_blocks() == 0


async def test_invalid_requests_raise_value_error_before_the_first_yield(engine):
    with pytest.raises(ValueError, match="maximum context length"):
        await engine.generate(list(range(1, 1020)), SamplingParams(max_tokens=10)).__anext__()
    with pytest.raises(ValueError, match="temperature"):
        await engine.generate([1], SamplingParams(temperature=-1)).__anext__()


# Left alone, a request with these runs all 1000 steps (2 s) before it frees its blocks, in a KV pool big
# enough for them (the default 64 blocks of 4 end it after ~250 steps, ~0.5 s, which once let these tests pass
# with no abort at all).
UNENDING = SamplingParams(max_tokens=1000, temperature=0)


@pytest.fixture
def roomy_engine():
    eng = make_engine(FakeRunner(num_blocks=1024, step_delay=0.002))
    yield eng
    eng.shutdown()


def steps_of(engine: AsyncEngine, request_id: str) -> int:
    """How many steps scheduled the request: an aborted one stops long before max_tokens."""
    runner = engine._core.runner
    return sum(s.request_id == request_id for out in runner.steps for s in out.scheduled)


async def test_closing_the_iterator_aborts_and_frees_blocks(roomy_engine):
    engine = roomy_engine
    gen = engine.generate([1, 2, 3, 4, 5], UNENDING, request_id="gone")
    await gen.__anext__()
    assert engine.num_used_blocks() > 0
    await gen.aclose()
    await wait_for_free_blocks(engine)
    assert 0 < steps_of(engine, "gone") < 500  # an abort, not the request's natural end


async def test_cancelling_the_consumer_aborts(roomy_engine):
    engine = roomy_engine
    started = asyncio.Event()

    async def consume():
        async for _ in engine.generate([1, 2], UNENDING, request_id="c"):
            started.set()

    task = asyncio.create_task(consume())
    await started.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await wait_for_free_blocks(engine)
    assert 0 < steps_of(engine, "c") < 500


async def test_abort_ends_the_stream_with_finish_reason_abort(engine):
    gen = engine.generate([3, 4], SamplingParams(max_tokens=1000, temperature=0), request_id="x")
    await gen.__anext__()
    await engine.abort("x")
    outs = [o async for o in gen]
    assert outs[-1].finished and outs[-1].outputs[0].finish_reason is FinishReason.ABORT
    await wait_for_free_blocks(engine)


async def test_duplicate_request_ids_are_refused(engine):
    gen = engine.generate([1], SamplingParams(max_tokens=100), request_id="dup")
    await gen.__anext__()
    with pytest.raises(ValueError, match="already in use"):
        await engine.generate([1], SamplingParams(max_tokens=1), request_id="dup").__anext__()
    await gen.aclose()


async def test_stop_strings_and_n_through_the_async_api():
    eng = make_engine(FakeRunner(num_blocks=64, next_token=scripted("abc. def")))
    try:
        params = SamplingParams(n=2, max_tokens=20, stop=["."], temperature=0)
        outs = [o async for o in eng.generate([1, 2], params)]
        texts = {0: "", 1: ""}
        for o in outs:
            for c in o.outputs:
                texts[c.index] += c.text
        assert texts == {0: "abc", 1: "abc"} and outs[-1].finished
        assert eng.num_used_blocks() == 0
    finally:
        eng.shutdown()


async def test_a_runner_failure_kills_the_engine_and_fails_every_stream():
    eng = make_engine(FakeRunner(num_blocks=64, fail_on_step=3))
    try:
        params = SamplingParams(max_tokens=100, temperature=0)

        async def run(p):
            return [o async for o in eng.generate(p, params)]

        results = await asyncio.wait_for(asyncio.gather(run([1]), run([2]), return_exceptions=True), 10)
        assert all(isinstance(r, EngineDeadError) for r in results)
        assert not eng.is_healthy()
        with pytest.raises(EngineDeadError):
            await eng.generate([1], params).__anext__()
    finally:
        eng.shutdown()


async def test_a_bad_request_fails_alone():
    eng = make_engine(FakeRunner(num_blocks=64, drop_token_for={"bad"}))
    try:
        params = SamplingParams(max_tokens=4, temperature=0)

        async def run(rid):
            return [o async for o in eng.generate([1, 2], params, request_id=rid)]

        good, bad = await asyncio.gather(run("good"), run("bad"))
        assert bad[-1].error and bad[-1].outputs[0].finish_reason is FinishReason.ERROR
        assert good[-1].outputs[0].finish_reason is FinishReason.LENGTH and eng.is_healthy()
    finally:
        eng.shutdown()


async def test_non_causal_runner_turns_prefix_caching_off():
    eng = make_engine(FakeRunner(num_blocks=64, is_causal=False))
    try:
        assert not eng.enable_prefix_caching
        outs = [o async for o in eng.generate([5] * 20, SamplingParams(max_tokens=2))]
        outs += [o async for o in eng.generate([5] * 20, SamplingParams(max_tokens=2))]
        assert all(o.num_cached_tokens == 0 for o in outs)
    finally:
        eng.shutdown()


async def test_reset_prefix_cache_and_cache_salt(engine):
    params = SamplingParams(max_tokens=1, temperature=0)
    [o async for o in engine.generate([7] * 20, params)]
    salted = [
        o async for o in engine.generate([7] * 20, params, origin=Origin(CacheNamespace(salt="tenant-b")))
    ]
    assert salted[-1].num_cached_tokens == 0  # another tenant's blocks are invisible
    again = [o async for o in engine.generate([7] * 20, params)]
    assert again[-1].num_cached_tokens == 19  # a full block, then 3 of the 4 its last block held
    assert engine.tokenizer.forgotten == []
    assert engine.reset_prefix_cache()
    fresh = [o async for o in engine.generate([7] * 20, params)]
    assert fresh[-1].num_cached_tokens == 0
    # The tokenizer's reused prompt pieces go with the blocks: all of them, or the one tenant's.
    engine.forget_prefix_cache(("tenant", "t1"))
    assert engine.tokenizer.forgotten == [None, ("tenant", "t1")]
