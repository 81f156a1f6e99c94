"""AsyncEngine failure paths with the fake runner: a fatal error outside the runner, requests still waiting
when the engine dies, shutdown with requests in flight, one request's failure leaving the others alone, and a
request id reused at once after its client went away (no output may cross from the old request to the new)."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field

import pytest
from engine_fakes import ByteTokenizer, FakeRunner

from engine.async_engine import AsyncEngine, EngineDeadError
from engine.config import EngineConfig
from engine.engine_core import EngineCore
from engine.outputs import FinishReason, RequestOutput
from engine.sampling_params import SamplingParams

PARAMS = SamplingParams(max_tokens=200, temperature=0)


def make_engine(runner: FakeRunner, tokenizer: ByteTokenizer | None = None, **kwargs) -> AsyncEngine:
    core = EngineCore(runner, tokenizer or ByteTokenizer(), EngineConfig(**kwargs))
    return AsyncEngine(core, core.tokenizer, model_name="fake")


async def drain(engine: AsyncEngine, ids: list[int], params: SamplingParams = PARAMS) -> list[RequestOutput]:
    return [o async for o in engine.generate(ids, params)]


async def test_a_fatal_error_in_the_scheduler_fails_running_and_waiting_requests():
    eng = make_engine(FakeRunner(num_blocks=64, step_delay=0.002), max_num_seqs=1)
    try:
        schedule = eng._core.scheduler.schedule
        calls = 0

        def broken_schedule():
            nonlocal calls
            calls += 1
            if calls == 5:
                raise RuntimeError("scheduler bug")
            return schedule()

        eng._core.scheduler.schedule = broken_schedule
        # One runs, two wait behind max_num_seqs=1: none of them may hang.
        results = await asyncio.wait_for(
            asyncio.gather(*(drain(eng, [i + 1]) for i in range(3)), return_exceptions=True), 10
        )
        assert all(isinstance(r, EngineDeadError) and "scheduler bug" in str(r) for r in results)
        assert not eng.is_healthy()
        # The core lock was released when the step died: probes that take it must answer, not hang.
        assert answers_within(eng.num_used_blocks, 5) and answers_within(eng.reset_prefix_cache, 5)
        with pytest.raises(EngineDeadError):
            await drain(eng, [9])
    finally:
        eng.shutdown()


def answers_within(probe, timeout: float) -> bool:
    """True when probe() returns within timeout; run in a daemon thread, so a hung probe cannot hang pytest."""
    done = threading.Event()
    threading.Thread(target=lambda: (probe(), done.set()), daemon=True).start()
    return done.wait(timeout)


async def test_shutdown_fails_requests_in_flight_instead_of_leaving_them_hanging():
    eng = make_engine(FakeRunner(num_blocks=64, step_delay=0.002))
    gen = eng.generate([1, 2, 3], PARAMS)
    await gen.__anext__()
    await asyncio.to_thread(eng.shutdown)
    with pytest.raises(EngineDeadError):
        await asyncio.wait_for(drain_rest(gen), 10)
    assert not eng.is_healthy()


async def drain_rest(gen) -> None:
    async for _ in gen:
        pass


async def drain_all(gen) -> list[RequestOutput]:
    return [o async for o in gen]


class FailOn255(ByteTokenizer):
    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        if 255 in token_ids:
            raise KeyError("unknown token id 255")
        return super().decode(token_ids, skip_special_tokens)


async def test_a_detokenizer_error_fails_its_request_only_and_the_engine_stays_healthy():
    def next_token(context: list[int], num_prompt_tokens: int, seed: int | None) -> int:
        return 255 if context[0] == 200 and len(context) - num_prompt_tokens == 2 else 65

    eng = make_engine(FakeRunner(num_blocks=64, next_token=next_token), FailOn255())
    try:
        params = SamplingParams(max_tokens=5, temperature=0)
        good, bad = await asyncio.wait_for(
            asyncio.gather(drain(eng, [1, 2], params), drain(eng, [200, 2], params)), 10
        )
        assert bad[-1].finished and bad[-1].error and bad[-1].outputs[0].finish_reason is FinishReason.ERROR
        assert "".join(c.text for o in good for c in o.outputs) == "AAAAA"
        assert eng.is_healthy() and eng.num_used_blocks() == 0
    finally:
        eng.shutdown()


@dataclass
class GatedRunner(FakeRunner):
    """Blocks in execute() on step `gate_step` until the test opens the gate."""

    gate_step: int = -1
    entered: threading.Event = field(default_factory=threading.Event)
    gate: threading.Event = field(default_factory=threading.Event)

    def execute(self, out):
        if len(self.steps) == self.gate_step:
            self.entered.set()
            assert self.gate.wait(10)
        return super().execute(out)


async def registered(engine: AsyncEngine, request_id: str) -> None:
    """Waits until a generate() call has registered its stream (and queued its request)."""
    for _ in range(1000):
        if request_id in engine._streams:
            return
        await asyncio.sleep(0.001)
    raise AssertionError(f"{request_id} was never registered")


async def test_a_reused_request_id_never_receives_the_outputs_of_the_request_it_replaces():
    runner = GatedRunner(num_blocks=64, next_token=lambda ctx, n, seed: ctx[0], gate_step=1)
    eng = make_engine(runner)
    try:
        old = eng.generate([65, 1], SamplingParams(max_tokens=50), request_id="x")
        assert (await old.__anext__()).outputs[0].text == "A"
        await asyncio.to_thread(runner.entered.wait, 10)  # step 1 is computing old "x"'s next token
        await old.aclose()  # the client went away; the same id is used again at once
        again = eng.generate([66, 1], SamplingParams(max_tokens=3), request_id="x")
        new = asyncio.create_task(drain_all(again))
        await registered(eng, "x")
        runner.gate.set()
        outs = await asyncio.wait_for(new, 10)
        assert "".join(c.text for o in outs for c in o.outputs) == "BBB"
        assert all(o.prompt_token_ids == [66, 1] for o in outs)
    finally:
        runner.gate.set()
        eng.shutdown()


async def test_a_request_closed_before_the_engine_saw_it_is_never_run_under_the_id_reused_after_it():
    runner = GatedRunner(num_blocks=64, next_token=lambda ctx, n, seed: ctx[0], gate_step=0)
    eng = make_engine(runner)
    try:
        busy = asyncio.create_task(drain(eng, [67], SamplingParams(max_tokens=2)))
        await asyncio.to_thread(runner.entered.wait, 10)  # the step thread is busy: commands queue up
        first = asyncio.create_task(eng.generate([65, 1], PARAMS, request_id="x").__anext__())
        await registered(eng, "x")  # and queued, not yet seen by the busy engine
        first.cancel()
        with pytest.raises(asyncio.CancelledError):
            await first
        again = asyncio.create_task(
            drain_all(eng.generate([66, 1], SamplingParams(max_tokens=3), request_id="x"))
        )
        await registered(eng, "x")
        runner.gate.set()
        outs = await asyncio.wait_for(again, 10)
        assert "".join(c.text for o in outs for c in o.outputs) == "BBB"
        assert outs[-1].outputs[0].finish_reason is FinishReason.LENGTH
        await asyncio.wait_for(busy, 10)
        assert all(s.request_id != "x" or s.new_token_ids[0] != 65 for o in runner.steps for s in o.scheduled)
    finally:
        runner.gate.set()
        eng.shutdown()
