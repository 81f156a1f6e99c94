"""The express lane (engine.express, engine.scheduler; issue 28 section 4): a long step pauses between its
layers, and the engine runs a short step there for owners running few sequences, whose outputs reach their
callers before the long step ends. Step compositions with a fake runner that pauses (the same on every
machine): who runs where, that nothing an express pass reads is still being written by the step in flight,
that tokens and blocks come out as without the lane; then the real default model, where the lane changes no
token or logprob.
"""

from __future__ import annotations

import asyncio
import threading
import time
from dataclasses import dataclass, field

import pytest
from engine_fakes import FakeRunner, collect, make_core, run_to_completion

from engine.async_engine import AsyncEngine
from engine.engine_core import EngineCore
from engine.express import ExpressPacer
from engine.outputs import RequestOutput, RunnerOutput, SchedulerOutput
from engine.request import Origin, RequestStatus
from engine.sampling_params import SamplingParams
from engine.scheduler import EXPRESS_MAX_ROWS, PREFILL_STEP_MIN_RUNNING
from kv_cache.namespace import CacheNamespace

FLOOD = Origin(CacheNamespace(salt="a"))
VICTIM = Origin(CacheNamespace(salt="b"))


@dataclass
class PausingRunner(FakeRunner):
    """A fake runner that pauses `layers - 1` times in a step, as the real one does between decoder layers.
    The step's KV lands only after its pauses (a real step's later layers write after the pause too), so an
    express pass that read a block the step in flight is filling would read it unwritten, and FakeRunner's
    check of every context read back fails."""

    layers: int = 4
    yields_between_layers: bool = True
    log: list[tuple[str, set[str]]] = field(default_factory=list)  # ("begin"/"end", the step's request ids)

    def execute(self, out: SchedulerOutput, between_layers=None) -> RunnerOutput:  # type: ignore[override]
        ids = {sr.request_id for sr in out.scheduled}
        self.log.append(("begin", ids))
        if between_layers is not None:
            for _ in range(self.layers - 1):
                between_layers()
        result = super().execute(out)
        self.log.append(("end", ids))
        return result


class Pause:
    """The driver's side of a pause (engine.express.Interjection): adds `arrivals` at the first poll, and
    records what was emitted and whether a main step was still running then."""

    def __init__(self, core: EngineCore, runner: PausingRunner) -> None:
        self.core, self.runner = core, runner
        self.arrivals: list[tuple[str, list[int], SamplingParams, Origin]] = []
        self.emitted: list[tuple[RequestOutput, int]] = []  # (output, steps begun but not ended then)

    def poll(self) -> None:
        while self.arrivals:
            rid, tokens, params, origin = self.arrivals.pop(0)
            assert self.core.add_request(rid, tokens, params, origin=origin) == []

    def emit(self, outputs: list[RequestOutput]) -> None:
        open_steps = sum(1 if what == "begin" else -1 for what, _ in self.runner.log)
        self.emitted += [(out, open_steps) for out in outputs]


def params(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


def prompt(n: int, start: int) -> list[int]:
    return [(start + i) % 250 + 1 for i in range(n)]


def flooded(running: int = PREFILL_STEP_MIN_RUNNING + 4, **config) -> tuple[EngineCore, PausingRunner, Pause]:
    """`running` sequences under salt "a", all decoding."""
    runner = PausingRunner(num_blocks=4096, block_size=4)
    core = make_core(runner, max_num_seqs=64, max_num_batched_tokens=256, **config)
    core._pacer = ExpressPacer(clock=lambda: 0.0)  # every pause may run a pass (a fake step takes no time)
    pause = Pause(core, runner)
    for i in range(running):
        core.add_request(f"flood-{i}", prompt(6, start=i), params(40), origin=FLOOD)
    for _ in range(3):
        core.step(pause)
    assert all(r.num_tokens - r.num_computed_tokens == 1 for r in core.scheduler.running)
    return core, runner, pause


def test_a_request_arriving_during_a_long_step_gets_its_first_token_before_that_step_ends() -> None:
    core, runner, pause = flooded()
    flood = {r.request_id for r in core.scheduler.running}
    pause.arrivals.append(("victim", prompt(5, start=200), params(6), VICTIM))
    runner.log.clear()
    outputs = core.step(pause)
    # The main step began, paused, and an express step of the victim alone ran inside it.
    assert runner.log[0] == ("begin", flood)
    assert runner.log[1:3] == [("begin", {"victim"}), ("end", {"victim"})]
    assert ("end", flood) in runner.log[3:]
    first = [(out, open_steps) for out, open_steps in pause.emitted if out.request_id == "victim"]
    assert first and first[0][1] == 1  # emitted while the main step was still open
    # Later pauses of the same step decode it further, one token each; none of that waited for the step.
    assert len(collect([o for o, _ in first], "victim")[0]["token_ids"]) == runner.layers - 1
    assert all(open_steps == 1 for _, open_steps in first)
    assert len(collect(outputs, "victim").get(0, {"token_ids": []})["token_ids"]) <= 1  # a pass after it
    core.scheduler.check_invariants()
    core.kv_manager.check_invariants()


def test_a_small_owners_decodes_leave_the_main_step_and_its_tokens_are_as_without_the_lane() -> None:
    core, runner, pause = flooded()
    pause.arrivals.append(("victim", prompt(5, start=200), params(30), VICTIM))
    seen: list[RequestOutput] = []

    def step() -> None:  # the outputs in the order their callers get them
        n = len(pause.emitted)
        returned = core.step(pause)
        seen.extend([out for out, _ in pause.emitted[n:]] + returned)

    step()
    for _ in range(3):
        runner.log.clear()
        step()
        main = runner.log[0][1]
        assert "victim" not in main and len(main) >= PREFILL_STEP_MIN_RUNNING
        assert ("begin", {"victim"}) in runner.log  # served in the main step's pauses
    while core.has_work():
        step()
        core.scheduler.check_invariants()
        core.kv_manager.check_invariants()
    victim = collect(seen, "victim")[0]
    assert victim["finish_reason"] == "length" and len(victim["token_ids"]) == 30
    # The same tokens as the victim alone on an engine without the lane (the fake model reads its context
    # back through its block table, so a block mixed up between the two steps would change them).
    alone = make_core(FakeRunner(num_blocks=4096, block_size=4), express_lane=False)
    alone.add_request("victim", prompt(5, start=200), params(30), origin=VICTIM)
    assert collect(run_to_completion(alone), "victim")[0]["token_ids"] == victim["token_ids"]
    assert core.kv_manager.num_free_blocks == core.kv_manager.num_blocks


def test_an_express_pass_never_reads_a_block_the_step_in_flight_is_writing() -> None:
    """Two unsalted requests (two owners, one namespace) with one long prompt: the first's prefill is the
    main step; the second arrives during it. The blocks the first is filling are cached already (a request
    later in the same step may hit them), but the express pass must not: the fake runner writes the main
    step's KV after its pauses, so a hit would read them empty and fail."""
    core, runner, pause = flooded()
    doc = prompt(48, start=100)
    core.add_request("first", doc, params(2))  # unsalted: its own owner, runs nothing -> a step of its own
    pause.arrivals.append(("second", [*doc, 7, 8], params(2), None))  # type: ignore[arg-type]
    runner.log.clear()
    runner.steps.clear()
    core.step(pause)
    assert runner.log[0] == ("begin", {"first"})
    assert runner.log[1] == ("begin", {"second"})
    second = runner.steps[0]  # FakeRunner records a step when its KV lands: the express step's came first
    assert {sr.request_id for sr in second.scheduled} == {"second"}
    assert second.scheduled[0].num_computed_tokens == 0  # no hit on the blocks in flight
    # Once the step is over those blocks are hits like any other.
    core.add_request("third", [*doc, 9], params(2))
    run_to_completion(core)
    third = next(sr for s in runner.steps for sr in s.scheduled if sr.request_id == "third")
    assert third.num_computed_tokens == 48


def test_beside_a_long_prompts_chunks_a_small_owner_is_served_in_their_pauses() -> None:
    """One request's long prefill, chunked: each chunk is a long step (seconds on a CPU for 2,048 tokens).
    Another owner arriving during it gets its first token in a pause, and its decodes leave the chunks."""
    runner = PausingRunner(num_blocks=512, block_size=4)
    core = make_core(runner, max_num_seqs=64, max_num_batched_tokens=64)
    core._pacer = ExpressPacer(clock=lambda: 0.0)
    pause = Pause(core, runner)
    core.add_request("long", prompt(400, start=3), params(2), origin=FLOOD)
    pause.arrivals.append(("victim", prompt(5, start=200), params(20), VICTIM))
    core.step(pause)
    assert runner.log[0] == ("begin", {"long"}) and runner.log[1] == ("begin", {"victim"})
    for _ in range(3):  # the next chunks: the long prompt alone, the victim in their pauses
        runner.log.clear()
        core.step(pause)
        assert runner.log[0] == ("begin", {"long"})
        assert ("begin", {"victim"}) in runner.log
    run_to_completion(core)


def test_many_small_owners_get_no_express_service() -> None:
    """Rotating salts buys nothing: past EXPRESS_MAX_ROWS small sequences, all run in the main step."""
    core, runner, pause = flooded()
    for i in range(EXPRESS_MAX_ROWS + 1):
        core.add_request(f"s{i}", prompt(5, start=i), params(20), origin=Origin(CacheNamespace(salt=f"s{i}")))
    for _ in range(4):
        core.step(pause)
    runner.log.clear()
    core.step(pause)
    assert len(runner.log) == 2  # one main step, no express pass
    assert {f"s{i}" for i in range(EXPRESS_MAX_ROWS + 1)} <= runner.log[0][1]


def test_express_passes_that_overfill_the_batch_are_trimmed_back_at_the_next_main_step() -> None:
    core, runner, pause = flooded(running=64)  # max_num_seqs
    pause.arrivals.append(("victim", prompt(5, start=200), params(30), VICTIM))
    core.step(pause)
    assert len(core.scheduler.running) == 65  # admitted past max_num_seqs by an express pass
    core.scheduler.check_invariants()
    core.step(pause)
    assert len(core.scheduler.running) <= 64
    assert any(r.request_id == "victim" for r in core.scheduler.running)  # the flood's newest made room
    run_to_completion(core)


def test_without_a_driver_or_with_the_lane_off_the_held_out_decodes_still_run() -> None:
    core, runner, pause = flooded()
    pause.arrivals.append(("victim", prompt(5, start=200), params(10), VICTIM))
    core.step(pause)
    # A caller that steps without a driver (a benchmark, a test): the held-out requests get their pass
    # after each step, and their outputs come back with the step's.
    seen: list[RequestOutput] = []
    while core.has_work():
        seen += core.step()
    assert collect(seen, "victim")[0]["finish_reason"] == "length"
    off = make_core(PausingRunner(num_blocks=4096, block_size=4), express_lane=False)
    assert not off.scheduler.express_enabled


@dataclass
class GatedRunner(PausingRunner):
    """Once armed, blocks a main step at its first pause until `go` is set, and records at that step's end
    what the engine had taken from its inbox meanwhile."""

    armed: bool = False
    paused: threading.Event = field(default_factory=threading.Event)
    go: threading.Event = field(default_factory=threading.Event)
    core: EngineCore | None = None
    seen_at_end: dict[str, object] = field(default_factory=dict)

    def execute(self, out: SchedulerOutput, between_layers=None) -> RunnerOutput:  # type: ignore[override]
        if not (self.armed and between_layers is not None):
            return super().execute(out, between_layers)
        self.armed = False
        first = [True]

        def gate() -> None:
            if first[0]:
                first[0] = False
                self.paused.set()
                assert self.go.wait(10)
            between_layers()

        result = super().execute(out, gate)
        assert self.core is not None
        requests = self.core.scheduler.requests
        victim = requests.get("victim")
        self.seen_at_end = {
            "f0": requests["f0"].status if "f0" in requests else None,
            "victim_tokens": victim.num_output_tokens if victim is not None else 0,
            "late": "late" in requests,
        }
        return result


async def test_a_pause_takes_new_requests_but_leaves_an_abort_and_all_after_it_for_the_steps_end() -> None:
    """Through AsyncEngine: an abort may free blocks the paused step is writing, so the pause takes the
    requests queued before it and nothing after; the rest is applied once the step is over, in order."""
    runner = GatedRunner(num_blocks=4096, block_size=4)
    core = make_core(runner, max_num_seqs=64, max_num_batched_tokens=256)
    runner.core = core
    engine = AsyncEngine(core, core.tokenizer, model_name="fake")  # type: ignore[arg-type]
    flood_started = asyncio.Event()

    async def stream(rid: str, tokens: list[int], max_tokens: int, origin: Origin) -> tuple[int, str]:
        """(tokens received, finish reason)"""
        got, reason = 0, ""
        async for out in engine.generate(tokens, params(max_tokens), request_id=rid, origin=origin):
            got += len(out.outputs[0].token_ids)
            reason = str(out.outputs[0].finish_reason)
            flood_started.set()
        return got, reason

    try:
        flood = [
            asyncio.create_task(stream(f"f{i}", prompt(6, start=i), 300, FLOOD))
            for i in range(PREFILL_STEP_MIN_RUNNING + 4)
        ]
        await flood_started.wait()
        runner.armed = True
        assert await asyncio.to_thread(runner.paused.wait, 10)  # a main step is now held at its first pause
        victim = asyncio.create_task(stream("victim", prompt(5, start=200), 4, VICTIM))
        await asyncio.sleep(0.05)  # its add queued
        await engine.abort("f0")
        late = asyncio.create_task(stream("late", prompt(5, start=220), 4, Origin(CacheNamespace(salt="c"))))
        await asyncio.sleep(0.05)
        runner.go.set()
        assert (await victim)[0] == 4 and (await late)[0] == 4
        aborted, reason = await asyncio.wait_for(flood[0], 5)
        assert aborted < 300 and "abort" in reason.lower()
        # At the paused step's end: the victim had its first token (taken at the pause), the abort and the
        # request queued after it had not been applied.
        assert runner.seen_at_end["victim_tokens"] >= 1
        assert runner.seen_at_end["f0"] is RequestStatus.RUNNING
        assert runner.seen_at_end["late"] is False
        for task in flood[1:]:
            task.cancel()
        await asyncio.gather(*flood[1:], return_exceptions=True)
        deadline = time.monotonic() + 5
        while engine.num_used_blocks() and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        assert engine.num_used_blocks() == 0 and engine.is_healthy()
    finally:
        engine.shutdown()


@pytest.mark.slow
@pytest.mark.parametrize("host_tier", [False, True], ids=["pool", "host-tier"])
def test_the_lane_changes_no_token_or_logprob_on_the_default_model(host_tier: bool) -> None:
    """The real runner (native stack, pauses between layers): requests served in express passes inside a
    flood's steps give the bits of the same requests run alone; with a host KV tier too (its writer takes the
    blocks of a paused step and of the passes inside it at that step's end), and every block comes back."""
    from engine.config import EngineConfig
    from engine.errors import ModelNotFoundError
    from engine.model.loading.files import resolve_model
    from engine.model_runner import ModelRunner
    from engine.tokenizer import Tokenizer

    try:
        path = str(resolve_model(None).path)
    except ModelNotFoundError as exc:
        pytest.skip(f"default model not available here: {exc}")
    tier = 64 * 2**20 if host_tier else None
    config = EngineConfig(model=path, device="cpu", num_blocks=512, max_num_seqs=32, kv_host_memory=tier)
    runner = ModelRunner(config)
    assert runner.yields_between_layers
    tokenizer = Tokenizer(path)
    greedy = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=2)

    def core() -> EngineCore:  # a fresh cache each time, over the one runner (its KV tensors are reused)
        c = EngineCore(runner, tokenizer, config)
        c._pacer = ExpressPacer(clock=lambda: 0.0)
        return c

    victims = [("v0", [504, 3458, 282, 4649, 314]), ("v1", [1, 2385, 30, 504, 3458, 282, 11, 12])]
    solo: dict[str, list] = {}
    for rid, tokens in victims:
        c = core()
        c.add_request(rid, tokens, greedy, origin=VICTIM)
        outs = run_to_completion(c)
        solo[rid] = [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs if o.request_id == rid]
    c = core()
    assert c.scheduler.express_enabled and (c.tiers is not None) == host_tier
    events: list[RequestOutput] = []
    in_pauses: list[str] = []

    class Driver:
        arrivals = list(victims)

        def poll(self) -> None:
            while self.arrivals:
                rid, tokens = self.arrivals.pop(0)
                c.add_request(rid, tokens, greedy, origin=Origin(CacheNamespace(salt=rid)))

        def emit(self, outputs: list[RequestOutput]) -> None:  # only ever called inside a main step
            events.extend(outputs)
            in_pauses.extend(o.request_id for o in outputs)

    for i in range(PREFILL_STEP_MIN_RUNNING + 4):
        c.add_request(
            f"f{i}", [1, 504, 3458, 100 + i], SamplingParams(max_tokens=30, ignore_eos=True), origin=FLOOD
        )
    driver = Driver()
    for _ in range(3):
        events.extend(c.step())
    while c.has_work():
        events.extend(c.step(driver))
    for rid, _ in victims:
        assert rid in in_pauses  # served between the layers of the flood's steps
        got = [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in events if o.request_id == rid]
        assert got == solo[rid], rid
    assert c.num_used_blocks() == 0
