"""Engine core with the fake runner: length limits at their exact edges, min_tokens against EOS and stop
strings, a request whose output processing raises, and prefix-cache stats for a request that waits."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
from engine_fakes import ByteTokenizer, FakeRunner, RecordingLogger, collect, make_core, run_to_completion

from engine.engine_core import EngineCore
from engine.outputs import FinishReason
from engine.sampling_params import SamplingParams


def greedy(max_tokens: int | None = 8, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, **kw)


def prompt(n: int, start: int = 1) -> list[int]:
    return [(start + i) % 250 + 1 for i in range(n)]


def script(data: bytes, then: int = 100):
    def next_token(context: list[int], num_prompt_tokens: int, seed: int | None) -> int:
        i = len(context) - num_prompt_tokens
        return data[i] if i < len(data) else then

    return next_token


def run_one(core: EngineCore, ids: list[int], params: SamplingParams) -> dict:
    assert core.add_request("r", ids, params) == []
    return collect(run_to_completion(core), "r")[0]


def test_max_model_len_ends_generation_with_length_at_exactly_the_limit():
    core = make_core(FakeRunner(num_blocks=64, block_size=4), max_model_len=16)
    seq = run_one(core, prompt(10), greedy(None))
    assert len(seq["token_ids"]) == 6 and seq["finish_reason"] is FinishReason.LENGTH
    # One token short of the limit: exactly one token; a prompt that fills it leaves no room for any.
    seq = run_one(core, prompt(15), greedy(None))
    assert len(seq["token_ids"]) == 1 and seq["finish_reason"] is FinishReason.LENGTH
    with pytest.raises(ValueError, match="maximum context length is 16"):
        core.check_request(prompt(16), greedy(None))
    (out,) = core.add_request("full", prompt(16), greedy(1))
    assert out.finished and out.outputs[0].finish_reason is FinishReason.ERROR
    assert not core.has_work()


def test_a_prompt_that_fills_the_whole_kv_pool_runs_after_the_others_and_gets_one_token():
    runner = FakeRunner(num_blocks=4, block_size=4)
    core = make_core(runner)
    core.add_request("small", prompt(5, start=90), greedy(3))
    core.add_request("full", prompt(16), greedy(5))
    outputs = run_to_completion(core)
    full = collect(outputs, "full")[0]
    assert len(full["token_ids"]) == 1 and full["finish_reason"] is FinishReason.LENGTH
    assert collect(outputs, "small")[0]["finish_reason"] is FinishReason.LENGTH
    assert [s.request_id for out in runner.steps for s in out.scheduled][-1] == "full"


def test_min_tokens_holds_off_eos_stop_tokens_and_stop_strings():
    # Script: "a", EOS, "." then "b", stop token 98 ("b"), "." and "c" forever.
    data = b"a\x00.b.c"

    def run(params: SamplingParams) -> dict:
        return run_one(make_core(FakeRunner(next_token=script(data, then=99))), prompt(3), params)

    assert run(greedy(10))["token_ids"] == [97, 0]
    assert run(greedy(10, min_tokens=3, stop=["."]))["text"] == "a"  # the 3rd token may stop it
    eos_late = run(greedy(10, min_tokens=4, stop=["."]))
    # EOS at 2 and "." at 3 are too early; the "." at 5 stops it, and is not in the text.
    assert eos_late["token_ids"] == [97, 0, 46, 98, 46] and eos_late["text"] == "a.b"
    assert eos_late["finish_reason"] is FinishReason.STOP and eos_late["stop_reason"] == "."
    stop_tok = run(greedy(10, min_tokens=5, ignore_eos=True, stop_token_ids=[98]))
    assert stop_tok["token_ids"][:4] == [97, 0, 46, 98] and stop_tok["finish_reason"] is FinishReason.LENGTH
    exact = run(greedy(10, min_tokens=4, ignore_eos=True, stop_token_ids=[46]))
    assert exact["token_ids"] == [97, 0, 46, 98, 46] and exact["stop_reason"] == 46


def test_a_stop_string_spanning_tokens_is_held_back_then_released_when_it_does_not_complete():
    # The last len("STOP") - 1 characters are held (they may become "STOP"); at the limit everything is
    # released, "ST" included.
    core = make_core(FakeRunner(next_token=script(b"abSTxy")))
    core.add_request("r", prompt(3), greedy(6, stop=["STOP"]))
    outputs = run_to_completion(core)
    deltas = [c.text for o in outputs for c in o.outputs]
    assert deltas == ["", "", "", "a", "b", "STxy"]
    assert outputs[-1].outputs[0].finish_reason is FinishReason.LENGTH


class FailingDecode(ByteTokenizer):
    """Decoding byte 255 raises, as a tokenizer might on an id it does not know."""

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        if 255 in token_ids:
            raise KeyError("unknown token id 255")
        return super().decode(token_ids, skip_special_tokens)


def poison_after(marker: int, at: int):
    """Requests whose prompt starts with `marker` produce 255 as their `at`-th token."""

    def next_token(context: list[int], num_prompt_tokens: int, seed: int | None) -> int:
        i = len(context) - num_prompt_tokens
        return 255 if context[0] == marker and i == at else 65 + (i + (seed or 0)) % 26

    return next_token


def test_an_exception_in_one_requests_detokenization_fails_only_that_request():
    runner = FakeRunner(num_blocks=64, block_size=4, next_token=poison_after(200, 2))
    core = EngineCore(runner, FailingDecode())
    core.add_request("good", [1, 2, 3], greedy(6))
    core.add_request("bad", [200, 2, 3], SamplingParams(n=2, max_tokens=6, seed=0))
    outputs = []
    for _ in range(3):
        outputs += core.step()
        core.kv_manager.check_invariants()
    bad = [o for o in outputs if o.request_id == "bad"]
    assert bad[-1].finished and "255" in bad[-1].error
    assert sorted((c.index, c.finish_reason) for c in bad[-1].outputs) == [
        (0, FinishReason.ERROR),
        (1, FinishReason.ERROR),
    ]
    # Both sequences' blocks went back at once; only "good" still holds any.
    assert set(core.scheduler.requests) == {"good"}
    outputs += run_to_completion(core)
    good = collect(outputs, "good")[0]
    assert good["text"] == "ABCDEF" and good["finish_reason"] is FinishReason.LENGTH
    assert sum(o.finished for o in outputs if o.request_id == "bad") == 1


def test_a_request_waiting_for_blocks_is_counted_once_in_the_prefix_cache_stats():
    log = RecordingLogger()
    runner = FakeRunner(num_blocks=4, block_size=4)
    core = make_core(runner, stat_loggers=[log])
    core.add_request("big", prompt(12), greedy(4))  # 3 blocks, then a 4th: "next" cannot fit meanwhile
    core.add_request("next", prompt(8, start=100), greedy(2))
    run_to_completion(core)
    waited = [s.request_id for out in runner.steps for s in out.scheduled].index("next")
    assert waited > 1  # it was looked at and refused in several steps
    sched = [s for s, _ in log.records]
    assert sum(s.prefix_cache.queries for s in sched) == 12 + 8
    assert sum(s.prefix_cache.requests for s in sched) == 2
    assert sum(s.prefix_cache.preempted_queries for s in sched) == 0


@pytest.mark.parametrize("limit", ["max_num_seqs", "max_num_batched_tokens"])
def test_a_zero_batch_limit_is_refused_instead_of_never_scheduling(limit):
    with pytest.raises(ValueError, match=f"{limit} must be at least 1"):
        make_core(FakeRunner(), **{limit: 0})
