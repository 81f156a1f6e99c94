"""Request: block hashes follow the tokens, statuses map to finish reasons, prompt logprobs are deduplicated."""

from __future__ import annotations

from engine.outputs import FinishReason, TokenLogprob
from engine.request import Request, RequestStatus
from engine.sampling_params import SamplingParams
from kv_cache.manager import KVCacheManager
from kv_cache.namespace import CacheNamespace


def test_block_hashes_grow_with_generated_tokens_and_match_a_fresh_request():
    kv = KVCacheManager(16, 4)
    req = Request("r", [1, 2, 3, 4, 5, 6], SamplingParams(), hasher=kv.make_hasher())
    assert len(req.block_hashes) == 1
    for tok in (7, 8, 9):
        req.append_output_token(tok)
    assert req.num_tokens == 9 and req.output_token_ids == [7, 8, 9] and len(req.block_hashes) == 2
    # The same tokens given as a prompt hash the same: generated blocks are reusable by later requests.
    same = Request("s", list(range(1, 10)), SamplingParams(), hasher=kv.make_hasher())
    assert same.block_hashes == req.block_hashes


def test_salt_changes_every_block_hash_and_caching_off_hashes_nothing():
    kv = KVCacheManager(16, 4)
    salt = CacheNamespace(salt="tenant")
    plain = Request("a", list(range(12)), SamplingParams(), hasher=kv.make_hasher())
    salted = Request("b", list(range(12)), SamplingParams(), salt, hasher=kv.make_hasher(salt))
    assert not set(plain.block_hashes) & set(salted.block_hashes)
    off = KVCacheManager(16, 4, enable_caching=False)
    assert Request("c", list(range(12)), SamplingParams(), hasher=off.make_hasher()).block_hashes == []


def test_prompt_is_copied_and_statuses_map_to_finish_reasons():
    prompt = [5, 6]
    req = Request("r", prompt, SamplingParams())
    req.append_output_token(9)
    assert prompt == [5, 6] and req.prompt_token_ids == [5, 6] and req.all_token_ids == [5, 6, 9]
    assert not RequestStatus.PREEMPTED.is_finished and RequestStatus.PREEMPTED.finish_reason is None
    assert RequestStatus.FINISHED_LENGTH.finish_reason is FinishReason.LENGTH
    assert RequestStatus.FINISHED_ABORTED.is_finished


def test_prompt_logprobs_keep_each_position_once():
    req = Request("r", [1, 2, 3, 4, 5], SamplingParams(prompt_logprobs=0))
    assert req.skip_reading_prefix_cache
    lp = [TokenLogprob(t, -1.0) for t in (2, 3)]
    req.add_prompt_logprobs(0, lp)  # positions 1, 2
    req.add_prompt_logprobs(0, lp)  # a recompute after preemption repeats them
    req.add_prompt_logprobs(2, [TokenLogprob(4, -1.0), TokenLogprob(5, -1.0), TokenLogprob(9, -1.0)])
    assert req.prompt_logprobs[0] is None and [e.token_id for e in req.prompt_logprobs[1:]] == [2, 3, 4, 5]
    assert Request("q", [1], SamplingParams()).prompt_logprobs is None
