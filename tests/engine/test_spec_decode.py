"""Speculative decoding's state rules, on a fake runner that verifies drafts the way the real one does.

`SpecFakeRunner` writes every scheduled token, drafts included, into its slot, then reads each request's
known tokens back through the block table (a rejected draft's slot that was not overwritten before it was
read again would show there), and takes the "model's" token at every verified position from the context up
to that position; `engine.spec_verify.accept` keeps the drafts. So a request emits exactly the tokens plain
decoding would: these tests compare everything a client or a router sees with speculation on and off.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
from engine_fakes import ByteTokenizer, FakeRunner, collect, run_to_completion, scripted

from engine.config import EngineConfig
from engine.engine_core import EngineCore
from engine.ngram_proposer import NgramIndex
from engine.outputs import RunnerOutput, SchedulerOutput, TokenLogprob, VerifiedDrafts
from engine.sampler import INVALID_TOKEN
from engine.sampling_params import SamplingParams
from engine.spec_config import SpeculativeConfig
from engine.spec_decode import RequestSpec, SpecDecoder
from engine.spec_verify import accept
from kv_cache.stats import BlockStored


@dataclass
class SpecFakeRunner(FakeRunner):
    def execute(self, out: SchedulerOutput) -> RunnerOutput:
        self.steps.append(out)
        bs = self.block_size
        for s in out.scheduled:
            for i, tok in enumerate(s.new_token_ids):
                pos = s.num_computed_tokens + i
                self.slots[s.block_ids[pos // bs] * bs + pos % bs] = tok
        result = RunnerOutput({})
        for s in out.scheduled:
            end = s.num_computed_tokens + len(s.new_token_ids)
            context = [self.slots.get(s.block_ids[p // bs] * bs + p % bs, -1) for p in range(end)]
            k = len(s.draft_token_ids)
            known = end - k
            assert context[:known] == s.all_token_ids[:known], f"{s.request_id}: KV holds the wrong tokens"
            assert context[known:] == s.draft_token_ids
            if not s.sample:
                continue
            seed = s.sampling_params.seed
            sampled = [self.next_token(context[: known + j], s.num_prompt_tokens, seed) for j in range(k + 1)]
            lps = [TokenLogprob(t, -0.5, [(t, -0.5)]) for t in sampled]
            if k:
                outcome = accept(s.draft_token_ids, sampled, lps)
                assert not isinstance(outcome, str)
                result.verified[s.request_id] = outcome
            else:
                result.sampled_token_ids[s.request_id] = sampled[0]
                result.logprobs[s.request_id] = lps[0]
        return result


# A fixed threshold: "auto" measures it from the steps' wall time, which these tests' draft counts must not
# depend on (tests/engine/test_spec_cost.py tests the measured one).
SPEC = SpeculativeConfig(
    num_speculative_tokens=4, prompt_lookup_max=4, prompt_lookup_min=2, min_draft_acceptance=0.3
)
# Repeats itself (drafts get accepted) and drifts off the repetition now and then (drafts get rejected).
TEXT = "the cat sat on the mat. the cat sat on the hat. the cat ran off the mat. the dog sat on the cat."


def run(
    spec: SpeculativeConfig | None, prompts: dict[str, str], num_blocks: int = 96, **params
) -> tuple[dict, list, EngineCore]:
    """Room for every request at once unless `num_blocks` says otherwise: no preemption, so no eviction, so the
    same blocks are stored whatever the step structure (their order differs: requests interleave otherwise)."""
    events: list = []
    runner = SpecFakeRunner(num_blocks=num_blocks, block_size=4, next_token=scripted(TEXT * 3))
    core = EngineCore(
        runner,
        ByteTokenizer(),
        EngineConfig(speculative_config=spec, max_num_batched_tokens=32),
        kv_event_sink=events.extend,
    )
    for rid, prompt in prompts.items():
        core.add_request(rid, list(prompt.encode()), SamplingParams(**{"max_tokens": 60, **params}))
    outs = run_to_completion(core)
    return {rid: collect(outs, rid)[0] for rid in prompts} | {"_outs": outs}, events, core


def stored(events: list) -> list[tuple[int, ...]]:
    """The tokens of every block a router hears of, in order (hashes are seeded per process)."""
    out = []
    for e in events:
        if isinstance(e, BlockStored):
            bs = e.block_size
            out += [tuple(e.token_ids[i * bs : (i + 1) * bs]) for i in range(len(e.block_hashes))]
    return out


def seqs(result: dict) -> dict:
    return {k: v for k, v in result.items() if not k.startswith("_")}


def test_same_tokens_text_events_and_cached_blocks_with_and_without_drafts() -> None:
    prompts = {"a": "the cat sat", "b": "the dog", "c": "on the mat."}
    plain, plain_events, plain_core = run(None, prompts, logprobs=1)
    spec, spec_events, spec_core = run(SPEC, prompts, logprobs=1)
    assert seqs(spec) == seqs(plain)
    assert sorted(stored(spec_events)) == sorted(stored(plain_events))
    assert spec_core.kv_manager.num_cached_blocks == plain_core.kv_manager.num_cached_blocks
    # It did speculate, and some drafts were rejected (their slots were then overwritten: checked per step).
    steps = spec_core.runner.steps
    drafted = [s for out in steps for s in out.scheduled if s.draft_token_ids]
    assert drafted
    assert len(steps) < len(plain_core.runner.steps)
    # A stream got several tokens in one output.
    assert any(len(c.token_ids) > 1 for o in spec["_outs"] for c in o.outputs)


def test_no_cached_block_or_event_holds_a_rejected_draft() -> None:
    prompts = {"a": "the cat sat", "b": "a dog ran"}
    spec, events, _ = run(SPEC, prompts, num_blocks=40)  # tight: preemption and eviction too
    sequences = [list(p.encode()) + spec[rid]["token_ids"] for rid, p in prompts.items()]
    for tokens in stored(events):
        # each block's tokens are a block of some request's real sequence
        assert any(
            tuple(seq[i : i + len(tokens)]) == tokens for seq in sequences for i in range(0, len(seq), 4)
        ), tokens


@pytest.mark.parametrize("stop", ["sat on the m", "mat. the c", "n the h"])
def test_a_stop_string_inside_an_accepted_draft_ends_the_output_where_it_would(stop: str) -> None:
    prompts = {"a": "the cat sat on the mat. the cat sat"}
    plain, plain_events, _ = run(None, prompts, stop=[stop], logprobs=0, max_tokens=120)
    spec, spec_events, core = run(SPEC, prompts, stop=[stop], logprobs=0, max_tokens=120)
    assert plain["a"]["finish_reason"].value == "stop"
    assert seqs(spec) == seqs(plain)
    assert sorted(stored(spec_events)) == sorted(stored(plain_events))
    last = [c for o in spec["_outs"] for c in o.outputs][-1]
    assert last.num_output_tokens == len(plain["a"]["token_ids"])
    assert len(last.token_ids) > 1, "the stop string was meant to end inside accepted drafts"


def test_max_tokens_and_eos_inside_drafts() -> None:
    for params in ({"max_tokens": 23}, {"max_tokens": 60, "ignore_eos": False}):
        prompts = {"a": "the cat sat on the mat."}
        runner_text = "the cat sat on the mat. the cat sat on the mat.\x00 more"
        outs = []
        for spec in (None, SPEC):
            runner = SpecFakeRunner(num_blocks=48, block_size=4, next_token=scripted(runner_text))
            core = EngineCore(runner, ByteTokenizer(), EngineConfig(speculative_config=spec))
            core.add_request("a", list(prompts["a"].encode()), SamplingParams(**params))
            outs.append(collect(run_to_completion(core), "a")[0])
        assert outs[0] == outs[1]


def test_preemption_with_drafts_gives_the_same_tokens() -> None:
    prompts = {f"r{i}": f"the cat {i} sat on the mat. the cat" for i in range(4)}
    got = []
    for spec in (None, SPEC):
        runner = SpecFakeRunner(num_blocks=30, block_size=4, next_token=scripted(TEXT))
        core = EngineCore(runner, ByteTokenizer(), EngineConfig(speculative_config=spec))
        for rid, p in prompts.items():
            core.add_request(rid, list(p.encode()), SamplingParams(max_tokens=40))
        outs = run_to_completion(core)
        got.append({rid: collect(outs, rid)[0] for rid in prompts})
    assert got[0] == got[1]


def test_constrained_requests_never_draft() -> None:
    runner = SpecFakeRunner(num_blocks=48, block_size=4, next_token=scripted(TEXT))
    core = EngineCore(runner, ByteTokenizer(), EngineConfig(speculative_config=SPEC))
    core.add_request("a", list(b"the cat sat on the mat. the cat"), SamplingParams(max_tokens=30))
    req = core.scheduler.requests["a"]
    req.grammar = object()  # what the scheduler looks at; the fake runner never reads it
    for _ in range(10):
        out = core.scheduler.schedule()
        assert all(not s.draft_token_ids for s in out.scheduled)
        core.scheduler.update(out, core.runner.execute(out))
    core.abort_request("a")


def test_accept_keeps_the_longest_agreeing_prefix_plus_the_next_token() -> None:
    assert accept([5, 6, 7], [5, 6, 9, 1], None) == VerifiedDrafts([5, 6, 9], None, 2)
    assert accept([5, 6, 7], [5, 6, 7, 1], None) == VerifiedDrafts([5, 6, 7, 1], None, 3)
    assert accept([5], [4, 3], None) == VerifiedDrafts([4], None, 0)
    # Nothing to sample where the drafts stop agreeing: the accepted ones only; the next step fails there.
    assert accept([5, 6], [5, INVALID_TOKEN, 2], None) == VerifiedDrafts([5], None, 1)
    assert isinstance(accept([5], [INVALID_TOKEN, 3], None), str)


def test_ngram_index_proposes_what_followed_the_latest_longest_match() -> None:
    tokens = [1, 2, 3, 4, 9, 9, 2, 3, 5, 6, 7, 1, 2, 3]
    idx = NgramIndex(2)
    # suffix [2, 3]: at 1..2 (then 4) and 6..7 (then 5); [1, 2, 3] matches the first one longer
    assert idx.propose(tokens, 3, 4) == [4, 9, 9]
    assert idx.propose(tokens, 3, 2) == [5, 6, 7]  # lookup capped at 2: the latest occurrence wins
    tokens += [8]
    assert idx.propose(tokens, 3, 4) == []  # [3, 8] never occurred before
    assert NgramIndex(3).propose([1, 2, 3], 4, 4) == []
    assert NgramIndex(2).propose([7, 7, 7, 7], 2, 4) == [7]  # overlapping repetition: what followed


def test_speculative_config_parses_vllm_shape_and_refuses_bad_values() -> None:
    c = SpeculativeConfig.from_json(
        '{"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 6, "prompt_lookup_min": 3}'
    )
    assert (c.num_speculative_tokens, c.prompt_lookup_max, c.prompt_lookup_min) == (5, 6, 3)
    assert SpeculativeConfig.from_json('{"prompt_lookup_max": 1}').prompt_lookup_min == 1
    assert SpeculativeConfig.from_json('{"min_draft_acceptance": 0}').min_draft_acceptance == 0.0
    assert SpeculativeConfig.from_json('{"min_draft_acceptance": "auto"}').min_draft_acceptance is None
    assert SpeculativeConfig.from_json('{"min_draft_acceptance": null}').min_draft_acceptance is None
    assert SpeculativeConfig.from_json("{}").min_draft_acceptance is None  # measured unless given
    for bad, word in [
        ('{"method": "eagle"}', "method"),
        ('{"num_speculative_tokens": 0}', "num_speculative_tokens"),
        ('{"num_speculative_tokens": true}', "num_speculative_tokens"),
        ('{"prompt_lookup_min": 5, "prompt_lookup_max": 2}', "prompt_lookup_min"),
        ('{"draft_model": "x"}', "draft_model"),
        ('{"min_draft_acceptance": 1.0}', "min_draft_acceptance"),
        ('{"min_draft_acceptance": "0.3"}', "min_draft_acceptance"),
        ("[1]", "object"),
        ("{", "JSON"),
    ]:
        with pytest.raises(ValueError, match=word):
            SpeculativeConfig.from_json(bad)


def _spec_state(config: SpeculativeConfig) -> tuple[SpecDecoder, RequestSpec]:
    return SpecDecoder(config, 1024), RequestSpec(None, NgramIndex(2))  # type: ignore[arg-type]


def _best_k(rate: float, cost: float, most: int) -> int:
    """The K in 1..most with the most expected tokens per step cost, (1 + rate + .. + rate^K) / (1 + K cost),
    by brute force."""
    per_cost = [sum(rate**j for j in range(k + 1)) / (1 + k * cost) for k in range(most + 1)]
    return max(1, max(range(most + 1), key=lambda k: (per_cost[k], -k)))


def test_k_follows_the_chance_that_each_draft_token_is_accepted() -> None:
    """K is what makes the most tokens per step cost at the request's rate, a draft row costing the threshold
    (0.3) of a sequence's row: a fresh request (3 of 4) drafts 2 (.75 .56, then .42 < .3 x 1.45 tokens per
    cost), a fully rejected draft brings it to 1, accepted ones raise it to K; never below one."""
    spec, state = _spec_state(SpeculativeConfig(num_speculative_tokens=8))
    assert state.rate() == 0.75 and spec.num_drafts(state.rate()) == 2
    for rate in (0.05, 0.2, 0.3, 0.45, 0.6, 0.75, 0.9, 0.99):
        assert spec.num_drafts(rate) == _best_k(rate, 0.3, 8), rate
    spec.adapt(state, 4, 0)  # 2.55 of 4.4: .58, then .34 < .3 x 1.22
    assert spec.num_drafts(state.rate()) == 1 and state.skip == 0  # still worth drafting: no skip
    for _ in range(6):
        spec.adapt(state, 4, 4)
    assert state.rate() > 0.86 and spec.num_drafts(state.rate()) == 8
    spec.adapt(state, 8, 3)  # a partial acceptance costs one rejected token's worth, not all of K
    assert spec.num_drafts(state.rate()) >= 6
    assert spec.num_drafts(0.01) == 1  # a probe
    assert SpecDecoder(SpeculativeConfig(min_draft_acceptance=0.0), 1024).num_drafts(0.01) == 4


def test_drafts_that_keep_failing_space_out_their_lookups() -> None:
    spec, state = _spec_state(SpeculativeConfig(num_speculative_tokens=4))
    skips = []
    for _ in range(8):
        spec.adapt(state, spec.num_drafts(state.rate()), 0)
        skips.append(state.skip)
    # worth drafting after three failures (rate .58, .46, .37), then .30 and below: skipped 1, 2, 4 .. steps
    assert skips == [0, 0, 0, 1, 2, 4, 8, 16]
    state.skip = 0  # those lookups skipped, the next probe is accepted: looked up every step again
    spec.adapt(state, 1, 1)
    assert state.skip == 0 and state.misses == 0


def test_a_request_that_copies_its_prompt_drafts_k_tokens_a_step() -> None:
    """On the fake runner a request whose output repeats its prompt gets every draft accepted: once its rate
    has risen it drafts num_speculative_tokens a step, and its tokens are those of plain decoding."""
    spec = SpeculativeConfig(
        num_speculative_tokens=6, prompt_lookup_max=4, prompt_lookup_min=2, min_draft_acceptance=0.3
    )
    runner = SpecFakeRunner(num_blocks=96, block_size=4, next_token=scripted(TEXT * 3))
    core = EngineCore(
        runner, ByteTokenizer(), EngineConfig(speculative_config=spec, max_num_batched_tokens=32)
    )
    core.add_request("a", list((TEXT * 2).encode()), SamplingParams(max_tokens=90))
    outs = run_to_completion(core)
    drafts = [len(s.draft_token_ids) for out in runner.steps for s in out.scheduled if s.sample]
    # (6 drafts pay for themselves only from a rate of ~.93: num_drafts; the last step is cut by max_tokens)
    assert max(drafts) == 6 and drafts[-6:-1].count(6) >= 4, drafts
    plain, _, _ = run(None, {"a": TEXT * 2}, max_tokens=90)
    assert collect(outs, "a")[0] == plain["a"]
