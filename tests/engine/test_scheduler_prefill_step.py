"""A new owner's prefill in a step of its own (issue 28, section 4): beside a large running batch, the first
chunk of an owner that runs nothing is scheduled ahead of the batch, never twice in a row, and the running
sequences keep advancing at least every other step however many new owners arrive. Step compositions with the
fake runner (the same on every machine), then the real default model: the split changes no token or logprob.
"""

from __future__ import annotations

import pytest
from engine_fakes import FakeRunner, collect, make_core, run_to_completion

from engine.engine_core import EngineCore
from engine.outputs import RequestOutput, SchedulerOutput
from engine.request import Origin
from engine.sampling_params import SamplingParams
from engine.scheduler import PREFILL_STEP_MIN_RUNNING
from kv_cache.namespace import CacheNamespace

FLOOD = Origin(CacheNamespace(salt="a"))


def params(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


def prompt(n: int, start: int) -> list[int]:
    return [(start + i) % 250 + 1 for i in range(n)]


def decoding_core(running: int) -> tuple[EngineCore, FakeRunner]:
    """`running` sequences of one salt, all past their prefill and decoding."""
    runner = FakeRunner(num_blocks=4096, block_size=4)
    core = make_core(runner, max_num_seqs=64, max_num_batched_tokens=256)
    for i in range(running):
        core.add_request(f"flood-{i}", prompt(6, start=i), params(200), origin=FLOOD)
    for _ in range(3):
        core.step()
    assert len(core.scheduler.running) == running
    assert all(r.num_tokens - r.num_computed_tokens == 1 for r in core.scheduler.running)
    return core, runner


def ids(out: SchedulerOutput) -> set[str]:
    return {sr.request_id for sr in out.scheduled}


def test_a_new_owners_prefill_runs_alone_then_the_batch_runs_with_its_decode() -> None:
    core, runner = decoding_core(PREFILL_STEP_MIN_RUNNING)
    flood = {r.request_id for r in core.scheduler.running}
    core.add_request("victim", prompt(5, start=200), params(3), origin=Origin(CacheNamespace(salt="b")))
    seen: list[RequestOutput] = core.step()
    # Its own step: the victim's whole prompt and nothing else, so its first token is out after it.
    assert ids(runner.steps[-1]) == {"victim"}
    assert runner.steps[-1].num_batched_tokens == 5
    assert collect(seen, "victim")[0]["token_ids"]
    seen += core.step()  # then the batch, the victim's decode in it
    assert ids(runner.steps[-1]) == flood | {"victim"}
    seen += run_to_completion(core)
    assert len(collect(seen, "victim")[0]["token_ids"]) == 3
    assert core.kv_manager.num_free_blocks == core.kv_manager.num_blocks


def test_below_the_threshold_the_prefill_joins_the_batch() -> None:
    core, runner = decoding_core(PREFILL_STEP_MIN_RUNNING - 1)
    flood = {r.request_id for r in core.scheduler.running}
    core.add_request("victim", prompt(5, start=200), params(3), origin=Origin(CacheNamespace(salt="b")))
    core.step()
    assert ids(runner.steps[-1]) == flood | {"victim"}
    run_to_completion(core)


def test_an_owner_already_running_waits_for_the_batch_step() -> None:
    # Another request of the flood's own salt is not a new owner: it is admitted with the batch, as before.
    core, runner = decoding_core(PREFILL_STEP_MIN_RUNNING)
    flood = {r.request_id for r in core.scheduler.running}
    core.add_request("more", prompt(5, start=200), params(3), origin=FLOOD)
    core.step()
    assert ids(runner.steps[-1]) == flood | {"more"}
    run_to_completion(core)


def test_under_a_stream_of_new_owners_running_decodes_advance_every_other_step() -> None:
    """A client rotating salts sends a new owner every step: the split steps alternate with batch steps, so
    every running sequence gets a token at least every second step, and every new owner still gets its
    first token within two steps of arriving."""
    core, runner = decoding_core(PREFILL_STEP_MIN_RUNNING * 2)
    flood = {r.request_id for r in core.scheduler.running}
    last_step: dict[str, int] = {rid: len(runner.steps) for rid in flood}
    first_token: dict[str, int] = {}
    seen: list[RequestOutput] = []
    splits = 0
    for k in range(40):
        rid = f"rotated-{k}"
        core.add_request(rid, prompt(20, start=k), params(2), origin=Origin(CacheNamespace(salt=rid)))
        arrived = len(runner.steps)
        outputs = core.step()
        core.kv_manager.check_invariants()
        core.scheduler.check_invariants()
        seen += outputs
        step = runner.steps[-1]
        n = len(runner.steps)
        if not ids(step) & flood:
            splits += 1
        for rid_ in ids(step) & flood:
            assert n - last_step[rid_] <= 2, f"{rid_} waited {n - last_step[rid_]} steps"
            last_step[rid_] = n
        for o in outputs:
            if o.request_id.startswith("rotated-") and o.outputs[0].token_ids:
                first_token.setdefault(o.request_id, n - arrived)
    # Every split step is followed by a batch step: never two in a row.
    kinds = [bool(ids(s) & flood) for s in runner.steps]
    assert not any(not a and not b for a, b in zip(kinds, kinds[1:], strict=False))
    assert splits >= 15  # the split did happen, about every other step
    assert all(first_token.get(f"rotated-{k}", 99) <= 2 for k in range(39)), first_token
    seen += run_to_completion(core)
    assert all(len(collect(seen, f"rotated-{k}")[0]["token_ids"]) == 2 for k in range(40))
    assert core.kv_manager.num_free_blocks == core.kv_manager.num_blocks


@pytest.mark.slow
def test_the_split_step_changes_no_token_or_logprob_on_the_real_model() -> None:
    from engine.config import EngineConfig
    from engine.model.loading.files import resolve_model
    from engine.model_runner import ModelRunner
    from engine.tokenizer import Tokenizer

    files = resolve_model(None)
    config = EngineConfig(model=str(files.path), device="cpu", num_blocks=256, max_num_seqs=32)
    core = EngineCore(ModelRunner(config), Tokenizer(files.path), config)
    victim = SamplingParams(max_tokens=4, temperature=0.0, logprobs=2, ignore_eos=True)
    victim_prompt = [504, 3458, 282, 4649, 314]

    def answer(outputs: list[RequestOutput]) -> list[tuple[int, float]]:
        got = []
        for o in outputs:
            if o.request_id == "victim":
                for c in o.outputs:
                    got += [(t, lp.logprob) for t, lp in zip(c.token_ids, c.logprobs or [], strict=True)]
        return got

    core.add_request("victim", victim_prompt, victim, origin=Origin(CacheNamespace(salt="b")))
    alone = answer(run_to_completion(core))
    for i in range(PREFILL_STEP_MIN_RUNNING):
        core.add_request(f"flood-{i}", prompt(7, start=10 * i), params(12), origin=FLOOD)
    for _ in range(2):
        core.step()
    core.reset_prefix_cache()  # cold, as alone was (its blocks are cached under salt b)
    scheduled: list[SchedulerOutput] = []
    schedule = core.scheduler.schedule

    def spy() -> SchedulerOutput:
        scheduled.append(schedule())
        return scheduled[-1]

    core.scheduler.schedule = spy  # type: ignore[method-assign]
    core.add_request("victim", victim_prompt, victim, origin=Origin(CacheNamespace(salt="b")))
    beside = answer(run_to_completion(core))
    assert ids(scheduled[0]) == {"victim"}  # it did get a step of its own
    assert len(alone) == 4 and beside == alone
    assert core.num_used_blocks() == 0
