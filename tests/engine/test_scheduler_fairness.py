"""Fair scheduling between owners (issue 17): one request's fan-out or one long prompt must not hold another
request's first token behind it, while a request alone still gets the whole step (continuous batching's
throughput). Fake runner: outputs must match a run of each request alone."""

from __future__ import annotations

from engine_fakes import FakeRunner, collect, make_core, run_to_completion

from engine.engine_core import EngineCore
from engine.outputs import RequestOutput
from engine.request import Origin
from engine.sampling_params import SamplingParams


def greedy(max_tokens: int = 8, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, **kw)


def prompt(n: int, start: int = 1) -> list[int]:
    return [(start + i) % 250 + 1 for i in range(n)]


def step(core: EngineCore) -> list[RequestOutput]:
    outputs = core.step()
    core.kv_manager.check_invariants()
    core.scheduler.check_invariants()
    return outputs


def steps_until_first_token(
    core: EngineCore, request_id: str, seen: list[RequestOutput] | None = None, limit: int = 500
) -> int:
    for n in range(1, limit + 1):
        outputs = step(core)
        if seen is not None:
            seen += outputs
        if any(o.request_id == request_id and any(c.token_ids for c in o.outputs) for o in outputs):
            return n
    raise AssertionError(f"{request_id} got no token in {limit} steps")


def alone(request_id: str, ids: list[int], params: SamplingParams, **core_kw) -> dict:
    core = make_core(FakeRunner(num_blocks=512, block_size=4), **core_kw)
    core.add_request(request_id, ids, params)
    return collect(run_to_completion(core), request_id)


def test_a_fan_out_waiting_ahead_does_not_delay_another_requests_first_token():
    core = make_core(FakeRunner(num_blocks=512, block_size=4), max_num_seqs=4)
    core.add_request("fan", prompt(6), SamplingParams(n=64, max_tokens=30, temperature=1.0, seed=1))
    core.add_request("victim", prompt(5, start=90), greedy(5))
    # FCFS would admit 64 fan-out sequences first (16 rounds of 4, 30 tokens each) before the victim.
    assert steps_until_first_token(core, "victim") <= 2
    run_to_completion(core)
    assert not core.scheduler.requests and core.kv_manager.num_free_blocks == core.kv_manager.num_blocks


def test_a_fan_out_holding_every_slot_gives_one_up_to_a_newcomer():
    core = make_core(FakeRunner(num_blocks=512, block_size=4), max_num_seqs=4)
    core.add_request("fan", prompt(6), SamplingParams(n=8, max_tokens=200, temperature=1.0, seed=1))
    for _ in range(3):
        step(core)
    assert [r.owner for r in core.scheduler.running] == ["fan"] * 4
    core.add_request("victim", prompt(5, start=90), greedy(5))
    # One fan-out sequence is preempted (recomputed later from its cached blocks) to make room.
    outputs: list[RequestOutput] = []
    assert steps_until_first_token(core, "victim", outputs) == 1
    assert sum(r.num_preemptions for r in core.scheduler.requests.values()) == 1
    outputs += run_to_completion(core)
    assert collect(outputs, "victim") == alone("victim", prompt(5, start=90), greedy(5))


def test_kv_pressure_from_a_fan_out_is_relieved_for_a_newcomer():
    # 40 blocks of 4 tokens; the fan-out's 4 running sequences of 30-token prompts hold 32 of them.
    core = make_core(FakeRunner(num_blocks=40, block_size=4), max_num_seqs=6)
    core.add_request("fan", prompt(30), SamplingParams(n=4, max_tokens=100, temperature=1.0, seed=2))
    for _ in range(12):
        step(core)
    core.add_request("victim", prompt(12, start=90), greedy(3))
    assert steps_until_first_token(core, "victim") <= 2
    run_to_completion(core)
    assert core.kv_manager.num_free_blocks == core.kv_manager.num_blocks


def test_a_long_prompt_does_not_hold_a_short_ones_first_token_behind_its_whole_prefill():
    core = make_core(FakeRunner(num_blocks=512, block_size=4), max_num_batched_tokens=32)
    core.add_request("long", prompt(600), greedy(2))
    step(core)
    core.add_request("short", prompt(5, start=90), greedy(3))
    # FCFS would give the long prompt's remaining 568 tokens the whole budget: 18 more steps.
    outputs: list[RequestOutput] = []
    assert steps_until_first_token(core, "short", outputs) == 1
    outputs += run_to_completion(core)
    assert collect(outputs, "long") == alone("long", prompt(600), greedy(2), max_num_batched_tokens=32)


def test_a_request_alone_gets_the_whole_budget_and_leftovers_go_back_to_cut_chunks():
    runner = FakeRunner(num_blocks=512, block_size=4)
    core = make_core(runner, max_num_batched_tokens=32)
    core.add_request("long", prompt(100), greedy(2))
    step(core)
    assert [len(s.new_token_ids) for s in runner.steps[-1].scheduled] == [32]
    core.add_request("short", prompt(5, start=90), greedy(20))
    step(core)  # two owners: shares of 16, but "short" needs 5, so "long" gets the other 27
    assert [(s.request_id, len(s.new_token_ids)) for s in runner.steps[-1].scheduled] == [
        ("long", 27),
        ("short", 5),
    ]
    step(core)  # "short" decodes: "long" takes the rest of the budget
    assert [(s.request_id, len(s.new_token_ids)) for s in runner.steps[-1].scheduled] == [
        ("long", 31),
        ("short", 1),
    ]


def test_the_prompts_of_one_api_request_share_one_owner():
    core = make_core(FakeRunner(num_blocks=512, block_size=4), max_num_seqs=4)
    for i in range(6):  # one API request with 6 prompts, 2 sequences each
        params = SamplingParams(n=2, max_tokens=40, temperature=1.0, seed=i)
        core.add_request(f"api-{i}", prompt(4, start=10 * i), params, origin=Origin(group="api"))
    core.add_request("other", prompt(5, start=90), greedy(3))
    assert steps_until_first_token(core, "other") <= 2
    running = [r.owner for r in core.scheduler.running]
    assert running.count("api") <= 3 and "other" in running
    run_to_completion(core)
