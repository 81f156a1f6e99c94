"""Preemption corner cases with the fake runner: the step that preempts, a victim in the middle of a chunked
prefill, a request that has to preempt itself, n > 1 sequences under a tiny pool, aborts of preempted and
finished requests, the stats of resumed requests, and seeded random workloads with aborts on tight pools that
must reproduce a roomy run. Every run checks the KV invariants after each step and that no block is left held
at the end."""

from __future__ import annotations

import random

import pytest
from engine_fakes import FakeRunner, RecordingLogger, collect, make_core, run_to_completion

from engine.engine_core import EngineCore
from engine.outputs import FinishReason, RequestOutput
from engine.request import RequestStatus
from engine.sampling_params import SamplingParams


def greedy(max_tokens: int = 8, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, **kw)


def prompt(n: int, start: int = 1) -> list[int]:
    return [(start + i) % 250 + 1 for i in range(n)]


def step_checked(core: EngineCore) -> list[RequestOutput]:
    outputs = core.step()
    core.kv_manager.check_invariants()
    return outputs


def held_blocks(core: EngineCore) -> int:
    return core.kv_manager.num_blocks - core.kv_manager.num_free_blocks


def reference_tokens(requests: dict[str, tuple[list[int], SamplingParams]], **core_kw) -> dict[str, dict]:
    """The same requests on a roomy pool (no preemption): what the tight run must reproduce."""
    core = make_core(FakeRunner(num_blocks=256, block_size=4), **core_kw)
    for rid, (ids, params) in requests.items():
        core.add_request(rid, ids, params)
    outputs = run_to_completion(core)
    return {rid: collect(outputs, rid) for rid in requests}


def test_a_step_that_preempts_admits_no_waiting_request_and_the_victim_comes_back_first():
    runner = FakeRunner(num_blocks=6, block_size=4)
    log = RecordingLogger()
    core = make_core(runner, max_num_seqs=2, stat_loggers=[log])
    requests = {
        "old": (prompt(8), greedy(10)),
        "new": (prompt(8, start=100), greedy(10)),
        "late": (prompt(3, start=50), greedy(2)),  # waits behind max_num_seqs
    }
    for rid, (ids, params) in requests.items():
        core.add_request(rid, ids, params)
    outputs: list[RequestOutput] = []
    while not any(s.num_preemptions for s, _ in log.records):
        outputs += step_checked(core)
    sched = core.scheduler
    out = runner.steps[-1]
    # Only the preemptor ran: with 2 blocks and a seq slot free, nobody was admitted in the preempting step.
    assert [s.request_id for s in out.scheduled] == ["old"]
    assert out.num_batched_tokens == 1
    assert [r.request_id for r in sched.running] == ["old"]
    assert [r.request_id for r in sched.waiting] == ["new", "late"]
    new = sched.requests["new"]
    assert new.status is RequestStatus.PREEMPTED and new.num_computed_tokens == 0
    assert core.kv_manager.get_block_ids("new") == [] and held_blocks(core) == 4
    # The victim is admitted again before "late", and resumes from its own still-cached blocks.
    num_steps = len(runner.steps)
    while not {"new", "late"} & {s.request_id for s in runner.steps[-1].scheduled}:
        outputs += step_checked(core)
    back = [s for out in runner.steps[num_steps:] for s in out.scheduled if s.request_id != "old"]
    assert back[0].request_id == "new" and back[0].num_computed_tokens > 0
    outputs += run_to_completion(core)
    expected = reference_tokens(requests, max_num_seqs=2)
    assert {rid: collect(outputs, rid) for rid in requests} == expected


def test_a_victim_that_could_rehit_for_free_is_still_not_readmitted_in_the_step_that_preempted_it():
    # n=3 on 8 tokens: sequences 1 and 2 recompute the prompt's second block into their own copies, so a
    # preempted sequence finds its whole prompt in blocks its siblings hold: readmitting it would cost almost
    # nothing, and would undo the preemption within the step that made it.
    runner = FakeRunner(num_blocks=6, block_size=4)
    log = RecordingLogger()
    core = make_core(runner, stat_loggers=[log])
    requests = {"p": (prompt(8), SamplingParams(n=3, max_tokens=8, seed=5))}
    core.add_request("p", *requests["p"])
    outputs: list[RequestOutput] = []
    while not any(s.num_preemptions for s, _ in log.records):
        outputs += step_checked(core)
    sched = core.scheduler
    (victim,) = sched.waiting
    assert victim.status is RequestStatus.PREEMPTED and core.kv_manager.get_block_ids(victim.request_id) == []
    assert core.kv_manager.get_computed_blocks(victim).num_tokens == 8  # admissible: its prefix is all held
    out = runner.steps[-1]
    assert {s.request_id for s in out.scheduled} == {r.request_id for r in sched.running}
    assert victim.request_id not in {s.request_id for s in out.scheduled}
    assert out.num_batched_tokens == len(out.scheduled)  # decodes only: the victim computed nothing
    outputs += run_to_completion(core)
    assert collect(outputs, "p") == reference_tokens(requests)["p"]


def long_chunks(runner: FakeRunner, request_id: str) -> list[tuple[int, int]]:
    """(num_computed_tokens, num_new_tokens) of each step the request was in."""
    return [
        (s.num_computed_tokens, len(s.new_token_ids))
        for out in runner.steps
        for s in out.scheduled
        if s.request_id == request_id
    ]


def test_a_victim_in_the_middle_of_a_chunked_prefill_restarts_from_its_cached_chunks():
    runner = FakeRunner(num_blocks=10, block_size=4)
    log = RecordingLogger()
    core = make_core(runner, max_num_batched_tokens=9, stat_loggers=[log])
    requests = {"old": (prompt(7), greedy(20)), "long": (prompt(30, start=60), greedy(3))}
    for rid, (ids, params) in requests.items():
        core.add_request(rid, ids, params)
    outputs: list[RequestOutput] = []
    while not any(s.num_preemptions for s, _ in log.records):
        outputs += step_checked(core)
    long = core.scheduler.requests["long"]
    assert long.status is RequestStatus.PREEMPTED and long.num_output_tokens == 0  # still in its prefill
    before = long_chunks(runner, "long")
    computed_before = before[-1][0] + before[-1][1]
    assert 0 < computed_before < 30
    outputs += run_to_completion(core)
    # It resumed from its own chunks still cached (a block boundary, not zero), counted as a resumed lookup.
    resume_at = long_chunks(runner, "long")[len(before)][0]
    assert 0 < resume_at <= computed_before and resume_at % 4 == 0
    # (With fair token shares the short request's decodes may squeeze "long" out again later: each resumed
    # lookup queries its whole prompt, and the first one hit exactly where it resumed.)
    resumed = [s for s, _ in log.records if s.prefix_cache.preempted_queries]
    assert resumed[0].prefix_cache.preempted_hits == resume_at
    assert sum(s.prefix_cache.preempted_queries for s in resumed) == 30 * len(resumed)
    assert sum(s.prefix_cache.queries for s, _ in log.records) == 7 + 30  # the first lookups, once each
    assert {rid: collect(outputs, rid) for rid in requests} == reference_tokens(
        requests, max_num_batched_tokens=9
    )


def test_the_newest_running_request_preempts_itself_when_an_older_one_took_the_last_block():
    runner = FakeRunner(num_blocks=4, block_size=4)
    log = RecordingLogger()
    core = make_core(runner, stat_loggers=[log])
    requests = {"a": (prompt(8), greedy(4)), "b": (prompt(4, start=90), greedy(6))}
    for rid, (ids, params) in requests.items():
        core.add_request(rid, ids, params)
    outputs = step_checked(core)  # a: 2 blocks, b: 1 block, 1 free
    # Both now need a new block; "a" goes first and takes the last one, so "b" can only give up its own.
    outputs += step_checked(core)
    assert log.records[-1][0].num_preemptions == 1
    assert [s.request_id for s in runner.steps[-1].scheduled] == ["a"]
    sched = core.scheduler
    assert [r.request_id for r in sched.running] == ["a"] and [r.request_id for r in sched.waiting] == ["b"]
    assert sched.requests["b"].status is RequestStatus.PREEMPTED and core.kv_manager.get_block_ids("b") == []
    assert held_blocks(core) == 3
    outputs += run_to_completion(core)
    assert {rid: collect(outputs, rid) for rid in requests} == reference_tokens(requests)


def test_n_sequences_under_a_tiny_pool_are_preempted_recovered_and_all_freed():
    runner = FakeRunner(num_blocks=7, block_size=4)  # 2 shared + 3 x 2 own blocks needed at the end
    log = RecordingLogger()
    core = make_core(runner, stat_loggers=[log])
    requests = {"p": (prompt(9), SamplingParams(n=3, max_tokens=8, seed=5))}
    core.add_request("p", *requests["p"])
    outputs = step_checked(core)
    # The three sequences share the prompt's two full blocks; each has its own block for the 9th token.
    tables = [list(core.kv_manager.get_block_ids(f"{i}_p")) for i in range(3)]
    assert tables[0][:2] == tables[1][:2] == tables[2][:2]
    assert len({t[2] for t in tables}) == 3 and held_blocks(core) == 5
    outputs += run_to_completion(core)
    assert sum(s.num_preemptions for s, _ in log.records) > 0
    assert [o.finished for o in outputs].count(True) == 1 and outputs[-1].finished
    seqs = collect(outputs, "p")
    assert seqs == reference_tokens(requests)["p"]
    assert all(len(s["token_ids"]) == 8 and s["finish_reason"] is FinishReason.LENGTH for s in seqs.values())


def preempt_new(core: EngineCore, log: RecordingLogger) -> None:
    """Steps "old" and "new" (added by the caller) until "new" has been preempted."""
    while not any(s.num_preemptions for s, _ in log.records):
        step_checked(core)
    assert core.scheduler.requests["new"].status is RequestStatus.PREEMPTED


def test_abort_of_a_preempted_request_frees_nothing_twice_and_ends_its_stream():
    runner = FakeRunner(num_blocks=6, block_size=4)
    log = RecordingLogger()
    core = make_core(runner, stat_loggers=[log])
    core.add_request("old", prompt(8), greedy(10))
    core.add_request("new", prompt(8, start=100), greedy(10))
    preempt_new(core, log)
    held = held_blocks(core)
    (out,) = core.abort_request("new")
    core.kv_manager.check_invariants()
    assert out.finished and out.outputs[0].finish_reason is FinishReason.ABORT
    assert out.outputs[0].num_output_tokens > 0  # it had generated before it was preempted
    assert held_blocks(core) == held and "new" not in core.scheduler.requests
    assert list(core.scheduler.waiting) == []
    assert core.abort_request("new") == []
    old = collect(run_to_completion(core), "old")[0]
    assert old["finish_reason"] is FinishReason.LENGTH


def test_abort_of_a_finished_request_is_a_no_op_even_while_a_sibling_runs():
    core = make_core(FakeRunner(num_blocks=32, block_size=4))
    core.add_request("done", prompt(4), greedy(1))
    core.add_request("p", prompt(4, start=40), SamplingParams(n=2, max_tokens=1, seed=1))
    core.add_request("run", prompt(4, start=80), greedy(20))
    outputs = step_checked(core)
    assert {o.request_id for o in outputs if o.finished} == {"done", "p"}
    held = held_blocks(core)
    assert core.abort_request("done") == [] and core.abort_request("p") == []
    assert held_blocks(core) == held and len(core.scheduler.running) == 1
    assert collect(run_to_completion(core), "run")[0]["finish_reason"] is FinishReason.LENGTH


def test_abort_of_n_sequences_some_preempted_some_running_frees_every_block():
    runner = FakeRunner(num_blocks=6, block_size=4)
    log = RecordingLogger()
    core = make_core(runner, stat_loggers=[log])
    core.add_request("p", prompt(8), SamplingParams(n=3, max_tokens=8, seed=5))
    while not any(s.num_preemptions for s, _ in log.records):
        step_checked(core)
    statuses = {core.scheduler.requests[f"{i}_p"].status for i in range(3)}
    assert statuses == {RequestStatus.RUNNING, RequestStatus.PREEMPTED}
    (out,) = core.abort_request("p")
    core.kv_manager.check_invariants()
    assert out.finished and sorted(c.index for c in out.outputs) == [0, 1, 2]
    assert all(c.finish_reason is FinishReason.ABORT for c in out.outputs)
    assert held_blocks(core) == 0 and not core.scheduler.requests
    run_to_completion(core)


def random_workload(rng: random.Random) -> dict[str, tuple[list[int], SamplingParams]]:
    shared = [rng.randint(1, 250) for _ in range(rng.randint(0, 20))]
    requests = {}
    for i in range(rng.randint(2, 7)):
        ids = (shared if rng.random() < 0.6 else []) + [
            rng.randint(1, 250) for _ in range(rng.randint(1, 20))
        ]
        n = rng.choice([1, 1, 2, 3])
        params = SamplingParams(n=n, max_tokens=rng.randint(1, 12), temperature=1.0, seed=rng.randint(0, 9))
        requests[f"r{i}"] = (ids, params)
    return requests


@pytest.mark.parametrize("seed", range(40))
def test_random_workloads_on_a_tight_pool_reproduce_the_roomy_outputs_despite_aborts(seed):
    rng = random.Random(seed)
    requests = random_workload(rng)
    block_size = rng.choice([1, 2, 4, 8])
    longest = max(len(ids) + p.max_tokens for ids, p in requests.values())
    num_blocks = -(-longest // block_size) + rng.randint(0, 3)  # the longest just fits: preemptions galore
    runner = FakeRunner(num_blocks=num_blocks, block_size=block_size)
    core = make_core(
        runner,
        max_num_batched_tokens=rng.randint(1, 40),
        max_num_seqs=rng.randint(1, 6),
        enable_prefix_caching=rng.random() < 0.8,
    )
    for rid, (ids, params) in requests.items():
        core.add_request(rid, ids, params)
    aborts = {rng.randint(1, 15): rng.choice(list(requests)) for _ in range(2)}
    outputs: list[RequestOutput] = []
    for step in range(1, 5000):
        if not core.has_work():
            break
        outputs += step_checked(core)
        if step in aborts:
            outputs += core.abort_request(aborts[step])
            core.kv_manager.check_invariants()
    assert held_blocks(core) == 0
    assert sorted(o.request_id for o in outputs if o.finished) == sorted(requests)  # each ends exactly once
    expected = reference_tokens(requests)
    for rid in requests:
        got = collect(outputs, rid)
        if rid not in aborts.values():
            assert got == expected[rid]
        else:  # cut short, but what it produced is the same prefix
            for i, seq in got.items():
                assert expected[rid][i]["token_ids"][: len(seq["token_ids"])] == seq["token_ids"]
