"""Scheduler + engine core with a fake runner: chunked prefill, prefix hits, preemption, aborts, limits, n > 1.

Every run checks the KV cache manager's invariants after each step and that no block is left in use at the
end (engine_fakes.run_to_completion). The fake runner reads context back through the block tables, so a
wrong hit or a clobbered block shows up as a wrong token.
"""

from __future__ import annotations

import pytest
from engine_fakes import FakeRunner, RecordingLogger, collect, make_core, run_to_completion

from engine.outputs import FinishReason
from engine.sampling_params import SamplingParams


def greedy(max_tokens: int = 8, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, **kw)


def prompt(n: int, start: int = 1) -> list[int]:
    return [(start + i) % 250 + 1 for i in range(n)]


def chunks_of(runner: FakeRunner, request_id: str) -> list[tuple[int, int, bool]]:
    """(num_computed_tokens, num_new_tokens, sample) of each step the request was in."""
    return [
        (s.num_computed_tokens, len(s.new_token_ids), s.sample)
        for out in runner.steps
        for s in out.scheduled
        if s.request_id == request_id
    ]


def test_chunked_prefill_splits_a_long_prompt_and_matches_unchunked():
    runner = FakeRunner(num_blocks=64)
    core = make_core(runner, max_num_batched_tokens=32)
    core.add_request("long", prompt(100), greedy(4))
    chunked = collect(run_to_completion(core), "long")[0]
    assert chunks_of(runner, "long")[:4] == [(0, 32, False), (32, 32, False), (64, 32, False), (96, 4, True)]
    assert chunks_of(runner, "long")[4:] == [(100, 1, True), (101, 1, True), (102, 1, True)]

    whole = make_core(FakeRunner(num_blocks=64), max_num_batched_tokens=2048)
    whole.add_request("long", prompt(100), greedy(4))
    assert collect(run_to_completion(whole), "long")[0]["token_ids"] == chunked["token_ids"]
    assert len(chunked["token_ids"]) == 4 and chunked["finish_reason"] is FinishReason.LENGTH


def test_prefix_hit_skips_exactly_the_hit_tokens():
    runner = FakeRunner(num_blocks=64, block_size=4)
    core = make_core(runner)
    core.add_request("a", prompt(18), greedy(3))
    first = run_to_completion(core)
    assert first[0].num_cached_tokens == 0
    # Same 16-token prefix (4 full blocks), different tail: exactly 16 tokens come from the cache.
    core.add_request("b", prompt(16) + [200, 201, 202], greedy(3))
    second = run_to_completion(core)
    assert chunks_of(runner, "b")[0] == (16, 3, True)
    assert second[0].num_cached_tokens == 16
    # An identical 16-token prompt: the hit is capped so that the last token is computed for its logits. Full
    # blocks give 12 tokens; the 3 after them come from a's block 3 (a tail), copied into a block of c's own.
    core.add_request("c", prompt(16), greedy(3))
    third = run_to_completion(core)
    assert chunks_of(runner, "c")[0] == (15, 1, True) and third[0].num_cached_tokens == 15
    first_step = next(s for s in runner.steps if any(r.request_id == "c" for r in s.scheduled))
    [(src, dst)] = first_step.block_copies
    assert src != dst and dst == first_step.scheduled[0].block_ids[3]


def test_a_block_cached_in_the_same_step_is_no_tail_before_that_step_writes_it():
    # a's block 4 (tokens 16..19) is cached when a is scheduled, but written only by that step; b, admitted in
    # the same step, shares tokens 16 and 17 of it. Copying it now would copy nothing (the fake runner checks
    # every context it reads back), so b takes its 4 full blocks only; a later request gets the tail.
    runner = FakeRunner(num_blocks=64, block_size=4)
    core = make_core(runner)
    core.add_request("a", prompt(20), greedy(2))
    core.add_request("b", prompt(18) + [250], greedy(2))
    first = run_to_completion(core)
    b_out = [o for o in first if o.request_id == "b"]
    assert b_out[-1].num_cached_tokens == 16 and runner.steps[0].block_copies == []
    core.add_request("c", prompt(18) + [250], greedy(2))
    later = run_to_completion(core)
    assert later[0].num_cached_tokens == 18  # now from a's block 4 (or b's partial), copied first
    assert collect(later, "c")[0]["token_ids"] == collect(first, "b")[0]["token_ids"]


def test_prefix_caching_off_computes_everything_with_the_same_outputs():
    outs = {}
    for caching in (True, False):
        runner = FakeRunner(num_blocks=64)
        core = make_core(runner, enable_prefix_caching=caching)
        for i in range(3):
            core.add_request(f"r{i}", prompt(20) + [100 + i], greedy(5))
        outputs = run_to_completion(core)
        outs[caching] = [collect(outputs, f"r{i}")[0]["token_ids"] for i in range(3)]
        computed = sum(len(s.new_token_ids) for out in runner.steps for s in out.scheduled)
        assert computed == (3 * 21 + 3 * 4 - 2 * 20 if caching else 3 * 21 + 3 * 4)
    assert outs[True] == outs[False]


def test_shared_prefix_in_one_step_is_computed_once():
    runner = FakeRunner(num_blocks=64, block_size=4)
    core = make_core(runner)
    shared = prompt(12)
    core.add_request("a", shared + [50, 51], greedy(2))
    core.add_request("b", shared + [60], greedy(2))
    core.step()
    core.kv_manager.check_invariants()
    first = {s.request_id: (s.num_computed_tokens, len(s.new_token_ids)) for s in runner.steps[0].scheduled}
    assert first == {"a": (0, 14), "b": (12, 1)}
    assert runner.steps[0].num_batched_tokens == 15
    outputs = run_to_completion(core)
    assert {o.request_id: o.num_cached_tokens for o in outputs if o.finished} == {"a": 0, "b": 12}


def test_preemption_under_a_tiny_pool_recovers_with_identical_outputs():
    def run(num_blocks: int) -> tuple[dict, int]:
        log = RecordingLogger()
        core = make_core(FakeRunner(num_blocks=num_blocks, block_size=4), stat_loggers=[log])
        for i in range(4):
            core.add_request(f"r{i}", prompt(6, start=10 * i), greedy(12))
        outputs = run_to_completion(core)
        tokens = {f"r{i}": collect(outputs, f"r{i}")[0]["token_ids"] for i in range(4)}
        return tokens, sum(s.num_preemptions for s, _ in log.records)

    roomy, roomy_preemptions = run(64)
    tight, tight_preemptions = run(10)  # each request needs up to 5 blocks: four can never run together
    assert roomy_preemptions == 0 and tight_preemptions > 0
    assert tight == roomy
    assert all(len(t) == 12 for t in tight.values())


def test_preempted_request_goes_back_to_the_front_and_rehits_its_blocks():
    runner = FakeRunner(num_blocks=6, block_size=4)
    log = RecordingLogger()
    core = make_core(runner, stat_loggers=[log])
    core.add_request("old", prompt(8), greedy(12))
    core.add_request("new", prompt(8, start=100), greedy(12))
    run_to_completion(core)
    assert sum(s.num_preemptions for s, _ in log.records) >= 1
    # "new" was the victim; when it came back its own full blocks were still hashed in the free queue.
    assert sum(s.prefix_cache.preempted_hits for s, _ in log.records) > 0
    resumed = [c for c in chunks_of(runner, "new") if c[0] > 0 and c[1] > 1]
    assert resumed, "the preempted request should resume from cached blocks, not from scratch"


def test_abort_frees_blocks():
    runner = FakeRunner(num_blocks=32)
    core = make_core(runner)
    core.add_request("a", prompt(10), greedy(100))
    core.add_request("w", prompt(10, start=40), greedy(5))
    for _ in range(3):
        core.step()
    assert core.kv_manager.num_free_blocks < core.kv_manager.num_blocks
    (out,) = core.abort_request("a")
    assert out.finished and out.outputs[0].finish_reason is FinishReason.ABORT
    core.kv_manager.check_invariants()
    assert core.abort_request("a") == []  # aborting twice is harmless
    run_to_completion(core)


def test_abort_of_a_waiting_request():
    core = make_core(FakeRunner(num_blocks=32), max_num_seqs=1)
    core.add_request("a", prompt(5), greedy(3))
    core.add_request("b", prompt(5, start=9), greedy(3))
    core.step()
    (out,) = core.abort_request("b")
    assert out.finished and out.outputs[0].token_ids == []
    assert collect(run_to_completion(core), "a")[0]["finish_reason"] is FinishReason.LENGTH


def test_requests_that_can_never_run_are_rejected_up_front():
    core = make_core(FakeRunner(num_blocks=8, block_size=4, max_model_len=64))
    with pytest.raises(ValueError, match="maximum context length"):
        core.check_request(prompt(60), greedy(8))
    with pytest.raises(ValueError, match="maximum context length"):
        core.check_request(prompt(64), SamplingParams(max_tokens=None))
    with pytest.raises(ValueError, match="KV cache"):
        core.check_request(prompt(33), greedy(1))  # 8 blocks of 4 hold 32 tokens
    with pytest.raises(ValueError, match="at least one token"):
        core.check_request([], greedy(1))
    (out,) = core.add_request("x", prompt(60), greedy(8))
    assert out.finished and out.error and "maximum context length" in out.error
    core.check_request(prompt(32), greedy(1))  # fits exactly


def test_generation_stops_at_the_end_of_the_kv_pool_without_looping():
    core = make_core(FakeRunner(num_blocks=4, block_size=4, max_model_len=1024))
    core.add_request("a", prompt(10), SamplingParams(max_tokens=None, temperature=0))
    seq = collect(run_to_completion(core), "a")[0]
    assert seq["finish_reason"] is FinishReason.LENGTH and 10 + len(seq["token_ids"]) == 17


def test_max_num_seqs_caps_the_running_batch():
    runner = FakeRunner(num_blocks=64)
    core = make_core(runner, max_num_seqs=2)
    for i in range(5):
        core.add_request(f"r{i}", prompt(3, start=i * 7), greedy(3))
    run_to_completion(core)
    assert max(len(out.scheduled) for out in runner.steps) == 2


def test_eos_stop_tokens_min_tokens_and_ignore_eos():
    # The script emits "ab", then EOS (id 0) forever.
    def run(params: SamplingParams) -> dict:
        core = make_core(FakeRunner(next_token=_script(b"ab\x00cd")))
        core.add_request("r", prompt(3), params)
        return collect(run_to_completion(core), "r")[0]

    eos = run(greedy(10))
    assert eos["token_ids"] == [97, 98, 0] and eos["text"] == "ab"
    assert eos["finish_reason"] is FinishReason.STOP and eos["stop_reason"] is None
    ignored = run(greedy(5, ignore_eos=True))
    assert ignored["token_ids"] == [97, 98, 0, 99, 100] and ignored["finish_reason"] is FinishReason.LENGTH
    stop_tok = run(greedy(10, stop_token_ids=[98]))
    assert stop_tok["token_ids"] == [97, 98] and stop_tok["text"] == "a" and stop_tok["stop_reason"] == 98
    late = run(greedy(10, min_tokens=4, stop_token_ids=[98]))
    assert late["token_ids"] == [97, 98, 0, 99, 100, 100, 100, 100, 100, 100]  # no stop before 4, then none


def _script(data: bytes, then: int = 100):
    def next_token(context, num_prompt_tokens, seed):
        i = len(context) - num_prompt_tokens
        return data[i] if i < len(data) else then

    return next_token


def test_n_sequences_share_the_prompt_blocks_and_use_seed_plus_i():
    runner = FakeRunner(num_blocks=64, block_size=4)
    core = make_core(runner)
    core.add_request("p", prompt(17), SamplingParams(n=3, max_tokens=6, seed=7))
    outputs = core.step()
    first = {s.request_id: (s.num_computed_tokens, s.sampling_params.seed) for s in runner.steps[0].scheduled}
    assert first == {"0_p": (0, 7), "1_p": (16, 8), "2_p": (16, 9)}
    outputs += run_to_completion(core)
    assert [o.finished for o in outputs].count(True) == 1 and outputs[-1].finished
    seqs = collect(outputs, "p")
    assert sorted(seqs) == [0, 1, 2]
    assert len({tuple(s["token_ids"]) for s in seqs.values()}) == 3  # different seeds, different samples
    assert all(len(s["token_ids"]) == 6 for s in seqs.values())

    # A single request with seed 8 reproduces sequence 1.
    core.add_request("q", prompt(17), SamplingParams(max_tokens=6, seed=8))
    assert collect(run_to_completion(core), "q")[0]["token_ids"] == seqs[1]["token_ids"]


def test_a_request_the_runner_fails_gets_an_error_and_others_continue():
    runner = FakeRunner(num_blocks=64, drop_token_for={"bad"})
    core = make_core(runner)
    core.add_request("good", prompt(5), greedy(4))
    core.add_request("bad", prompt(5, start=30), greedy(4))
    outputs = run_to_completion(core)
    bad = [o for o in outputs if o.request_id == "bad"]
    assert len(bad) == 1 and bad[0].finished and bad[0].error
    assert bad[0].outputs[0].finish_reason is FinishReason.ERROR
    assert collect(outputs, "good")[0]["finish_reason"] is FinishReason.LENGTH


def test_stats_count_queries_hits_and_computed_prompt_tokens():
    log = RecordingLogger()
    core = make_core(FakeRunner(num_blocks=64, block_size=4), stat_loggers=[log])
    core.add_request("a", prompt(9), greedy(2))
    run_to_completion(core)
    core.add_request("b", prompt(9), greedy(2))
    run_to_completion(core)
    sched = [s for s, _ in log.records]
    it = [i for _, i in log.records]
    assert sum(s.prefix_cache.queries for s in sched) == 18 and sum(s.prefix_cache.hits for s in sched) == 8
    assert sum(i.num_prompt_tokens for i in it) == 9 + 1
    assert sum(i.num_generation_tokens for i in it) == 4
    assert sum(len(i.ttfts) for i in it) == 2 and sum(len(i.inter_token_latencies) for i in it) == 2
    finished = [f for i in it for f in i.finished]
    assert [(f.num_cached_tokens, f.finish_reason, f.num_generation_tokens) for f in finished] == [
        (0, "length", 2),
        (8, "length", 2),
    ]
    assert sched[-1].num_running == 0 and sched[-1].kv_cache_usage == 0.0


def test_prompt_logprobs_skip_the_cache_and_cover_every_position():
    core = make_core(FakeRunner(num_blocks=64, block_size=4), max_num_batched_tokens=5)
    core.add_request("warm", prompt(12), greedy(1))
    run_to_completion(core)
    core.add_request("lp", prompt(12), greedy(2, prompt_logprobs=1, logprobs=0))
    outputs = run_to_completion(core)
    assert outputs[0].num_cached_tokens == 0
    plp = outputs[0].prompt_logprobs
    assert plp[0] is None and [e.token_id for e in plp[1:]] == prompt(12)[1:]
    assert all(o.prompt_logprobs is None for o in outputs[1:])
    assert all(len(c.logprobs) == len(c.token_ids) for o in outputs for c in o.outputs if c.token_ids)


def test_colliding_child_ids_fail_only_the_new_request():
    core = make_core(FakeRunner(num_blocks=32))
    assert core.add_request("0_x", prompt(4), greedy(2)) == []
    (out,) = core.add_request("x", prompt(4), SamplingParams(n=2, max_tokens=2))
    assert out.finished and "already in use" in out.error
    assert collect(run_to_completion(core), "0_x")[0]["finish_reason"] is FinishReason.LENGTH
