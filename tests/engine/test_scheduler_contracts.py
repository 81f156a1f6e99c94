"""The Scheduler driven step by step by hand (no engine core): the exact limits of one step's token budget
and of the free pool, what update() hands back for a request that failed, was aborted mid-step or stopped at
min_tokens, and its messages. `make mutate` found each of these unchecked by the end-to-end scheduler tests.
"""

from __future__ import annotations

import pytest

from engine.config import EngineConfig
from engine.outputs import RunnerOutput, TokenLogprob
from engine.request import Request, RequestStatus
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler
from kv_cache import KVCacheManager

EOS = 2


def make(num_blocks: int = 16, block_size: int = 4, budget: int = 64, **kw) -> Scheduler:
    kv = KVCacheManager(num_blocks, block_size)
    config = EngineConfig(max_num_seqs=8, max_num_batched_tokens=budget, max_model_len=64, **kw)
    return Scheduler(kv, config, eos_token_ids=[EOS])


def add(sched: Scheduler, rid: str, n: int, **params) -> Request:
    req = Request(
        rid, [10 + i for i in range(n)], SamplingParams(temperature=0, **{"max_tokens": 8, **params})
    )
    req.hasher = sched.kv_manager.make_hasher()
    if req.hasher is not None:
        req.hasher.extend(req.block_hashes, req.all_token_ids)
    sched.add_request(req)
    return req


def step(sched: Scheduler, token: int = 50, **logprobs: TokenLogprob):
    out = sched.schedule()
    tokens = {s.request_id: token for s in out.scheduled if s.sample}
    return out, sched.update(out, RunnerOutput(tokens, dict(logprobs)))


def test_check_request_messages() -> None:
    sched = make()
    with pytest.raises(ValueError, match=r"^The prompt must contain at least one token\.$"):
        sched.check_request(0, 5)
    with pytest.raises(ValueError) as with_max:
        sched.check_request(60, 5)
    assert str(with_max.value) == (
        "This model's maximum context length is 64 tokens. However, you requested 65 tokens (60 in the prompt, "
        "5 in the completion). Please reduce the length of the prompt or the completion."
    )
    with pytest.raises(ValueError) as without_max:
        sched.check_request(64, None)
    assert str(without_max.value) == (
        "This model's maximum context length is 64 tokens. However, you requested 65 tokens (64 in the prompt, "
        "at least 1 to generate). Please reduce the length of the prompt or the completion."
    )
    add(sched, "a", 3)
    with pytest.raises(ValueError, match=r"^duplicate request id 'a'$"):
        add(sched, "a", 3)


def test_the_last_token_of_the_budget_is_used_and_none_past_it() -> None:
    sched = make(budget=3)
    add(sched, "a", 2)
    add(sched, "b", 5)
    out, _ = step(sched)
    # a takes 2, b is admitted with the 1 token left (a chunk), and nothing gets a 0-token entry.
    assert [(s.request_id, len(s.new_token_ids)) for s in out.scheduled] == [("a", 2), ("b", 1)]
    add(sched, "c", 2)
    # Three owners share the 3-token budget (fair scheduling): a decodes 1, b's chunk and c's first chunk get
    # 1 each. The budget is spent to its last token, and no one gets a 0-token entry.
    out, _ = step(sched)
    assert [(s.request_id, len(s.new_token_ids)) for s in out.scheduled] == [("a", 1), ("b", 1), ("c", 1)]
    assert out.num_batched_tokens == 3 and not sched.waiting


def test_two_decodes_fill_a_budget_of_two() -> None:
    sched = make(budget=2)
    add(sched, "a", 1)
    add(sched, "b", 1)
    for _ in range(3):
        out, _ = step(sched)
        assert [(s.request_id, len(s.new_token_ids)) for s in out.scheduled] == [("a", 1), ("b", 1)]


def test_the_last_free_block_is_still_handed_out() -> None:
    sched = make(num_blocks=2, block_size=4)
    add(sched, "a", 3)  # one block; its next decode (token 4) still fits in it
    step(sched)
    assert sched.kv_manager.num_free_blocks == 1
    add(sched, "b", 3)
    out, _ = step(sched)
    assert "b" in [s.request_id for s in out.scheduled] and sched.kv_manager.num_free_blocks == 0


def test_update_skips_a_request_aborted_during_the_step_and_goes_on() -> None:
    sched = make()
    add(sched, "a", 2)
    add(sched, "b", 2)
    out = sched.schedule()
    assert [r.request_id for r in sched.finish_requests(["nope", "a"], RequestStatus.FINISHED_ABORTED)] == [
        "a"
    ]
    updates = sched.update(out, RunnerOutput({"a": 50, "b": 51}))
    assert [(u.request.request_id, u.new_token_ids, u.logprobs) for u in updates] == [("b", [51], None)]


def test_a_request_the_runner_gave_no_token_fails_alone_with_the_reason() -> None:
    sched = make()
    a, b = add(sched, "a", 2), add(sched, "b", 2)
    out = sched.schedule()
    lp = TokenLogprob(51, -0.5)
    updates = sched.update(out, RunnerOutput({"b": 51}, {"b": lp}))
    assert [(u.request.request_id, u.new_token_ids) for u in updates] == [("a", []), ("b", [51])]
    assert updates[1].logprobs == [lp]
    assert a.status is RequestStatus.FINISHED_ERROR
    assert a.error == "RuntimeError('the model runner returned no token for a request that had to sample')"
    assert b.status is RequestStatus.RUNNING and b.error is None


def test_eos_stops_on_the_min_tokens_th_token() -> None:
    sched = make()
    req = add(sched, "a", 2, min_tokens=2)
    step(sched, token=EOS)  # output token 1: below min_tokens, EOS does not stop
    assert req.status is RequestStatus.RUNNING
    step(sched, token=EOS)  # output token 2 == min_tokens: it may stop now
    assert req.status is RequestStatus.FINISHED_STOPPED and req.num_output_tokens == 2


def test_preemptions_are_counted_and_a_rehit_does_not_rewrite_the_first_hit() -> None:
    # 3 blocks of 4: a (5 tokens) and b (4) fill them; a's growth preempts b (the newest) twice.
    sched = make(num_blocks=3, block_size=4)
    a = add(sched, "a", 5, max_tokens=20)
    b = add(sched, "b", 4, max_tokens=20)
    trace = []
    for _ in range(14):
        out, _ = step(sched)
        trace.append(
            [
                (s.request_id, s.num_computed_tokens, len(s.new_token_ids), s.num_output_tokens)
                for s in out.scheduled
            ]
        )
    assert trace[:5] == [
        [("a", 0, 5, 0), ("b", 0, 4, 0)],
        [("a", 5, 1, 1)],  # b preempted for a's second block
        [("a", 6, 1, 2), ("b", 4, 1, 1)],  # b back, its full first block found in the cache
        [("a", 7, 1, 3), ("b", 5, 1, 2)],
        [("a", 8, 1, 4)],  # preempted again
    ]
    assert b.num_preemptions == 2 and a.num_preemptions == 0
    assert sched.take_num_preemptions() == 2 and sched.take_num_preemptions() == 0
    # The hit reported is the one at first scheduling (none), not the re-admission's 4 cached tokens.
    assert b.num_cached_tokens == 0
    assert a.status is RequestStatus.FINISHED_LENGTH and b.status is RequestStatus.FINISHED_LENGTH


def test_a_scheduled_request_carries_its_grammar_to_the_runner() -> None:
    # The runner masks a constrained row's logits with the grammar it finds here (structured outputs).
    sched = make()
    free = add(sched, "free", 3)
    constrained = add(sched, "json", 3)
    constrained.grammar = object()  # type: ignore[assignment]  # the scheduler only hands it on
    out = sched.schedule()
    grammars = {s.request_id: s.grammar for s in out.scheduled}
    assert grammars == {"free": None, "json": constrained.grammar} and free.grammar is None


def test_check_invariants_names_each_corruption() -> None:
    sched = make()
    add(sched, "a", 3)
    add(sched, "b", 3)
    step(sched)
    sched.check_invariants()
    sched._num_running["ghost"] += 1
    with pytest.raises(AssertionError, match="^per-owner running counts drifted$"):
        sched.check_invariants()
    sched._num_running["ghost"] -= 1
    sched._num_running += type(sched._num_running)()  # drop the zero count again
    lost = sched.running.pop()
    with pytest.raises(AssertionError):
        sched.check_invariants()
    sched.running.append(lost)
    sched.check_invariants()
    sched.max_num_seqs = 2  # exactly full is fine, one more running than allowed is not
    sched.check_invariants()
    sched.max_num_seqs = 1
    with pytest.raises(AssertionError):
        sched.check_invariants()
    sched.max_num_seqs = 8
    sched.requests["ghost"] = sched.requests["a"]  # in neither queue
    with pytest.raises(AssertionError, match="^a request is lost or in two queues$"):
        sched.check_invariants()


def test_a_scheduler_without_max_model_len_is_refused_with_the_reason() -> None:
    config = EngineConfig(max_num_seqs=8, max_num_batched_tokens=64, max_model_len=None)
    with pytest.raises(ValueError) as e:
        Scheduler(KVCacheManager(16, 4), config, eos_token_ids=[EOS])
    assert str(e.value) == "the scheduler needs max_model_len (EngineCore fills in the model's)"


def test_unreported_finishes_are_false_until_a_request_ends_and_false_again_after_a_schedule() -> None:
    # EngineCore.has_work() reads this: True on a fresh or idle engine would spin empty steps.
    sched = make()
    assert sched.has_unreported_finishes() is False
    add(sched, "r", 4, max_tokens=1)
    step(sched)  # prefill and its one token: r finishes
    assert sched.has_unreported_finishes() is True
    out = sched.schedule()
    assert out.scheduled == [] and sched.has_unreported_finishes() is False
