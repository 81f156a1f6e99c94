"""A runner failure one request is to blame for fails that request alone; the others get the tokens they get
without it. A failure no request can be blamed for (the batch, or every request) is still fatal."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
from engine_fakes import FakeRunner, collect, make_core, run_to_completion

from engine.outputs import FinishReason, RunnerOutput, SchedulerOutput
from engine.sampling_params import SamplingParams

PARAMS = SamplingParams(max_tokens=6, temperature=0)


@dataclass
class PoisonRunner(FakeRunner):
    """Raises for any step that holds a poisoned request, or (batch_only) for any step of two or more."""

    poisoned: set[str] = field(default_factory=set)
    batch_only: bool = False
    raised: int = 0

    def execute(self, out: SchedulerOutput) -> RunnerOutput:
        ids = {sr.request_id for sr in out.scheduled}
        if ids & self.poisoned or (self.batch_only and len(ids) > 1):
            self.raised += 1
            raise RuntimeError("kernel fault")
        return super().execute(out)


def _answers(core, prompts: dict[str, list[int]]) -> dict[str, dict]:
    """Per request: its sequence 0 (collect) plus the error its last output carried. Blocks all back."""
    for rid, prompt in prompts.items():
        assert core.add_request(rid, prompt, PARAMS) == []
    outputs = run_to_completion(core)
    errors = {o.request_id: o.error for o in outputs if o.finished}
    return {rid: {**collect(outputs, rid)[0], "error": errors.get(rid)} for rid in prompts}


PROMPTS = {"a": [1, 2, 3], "bad": [4, 5, 6, 7], "b": [8, 9]}


def test_the_request_to_blame_fails_alone_and_the_others_answer_as_without_it():
    alone = _answers(make_core(FakeRunner()), {"a": PROMPTS["a"], "b": PROMPTS["b"]})
    runner = PoisonRunner(poisoned={"bad"})
    core = make_core(runner)
    got = _answers(core, PROMPTS)
    assert got["bad"]["finish_reason"] is FinishReason.ERROR and "kernel fault" in got["bad"]["error"]
    assert got["a"] == alone["a"] and got["b"] == alone["b"] and got["a"]["error"] is None
    assert runner.raised >= 2  # the batch, then the poisoned request alone


def test_a_fault_of_the_batch_itself_is_fatal():
    core = make_core(PoisonRunner(batch_only=True))
    for rid, prompt in PROMPTS.items():
        core.add_request(rid, prompt, PARAMS)
    with pytest.raises(RuntimeError, match="kernel fault"):
        run_to_completion(core)


def test_a_fault_of_every_request_is_fatal():
    core = make_core(PoisonRunner(poisoned=set(PROMPTS)))
    for rid, prompt in PROMPTS.items():
        core.add_request(rid, prompt, PARAMS)
    with pytest.raises(RuntimeError, match="kernel fault"):
        run_to_completion(core)
