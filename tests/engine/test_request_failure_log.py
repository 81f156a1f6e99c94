"""A request the step fails for a reason already in words (a grammar over the mask budget, no finite logit) is
logged as one line naming the request and the reason, not a traceback; the request still ends with that error
and finish reason "error", and the request beside it goes on."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from engine_fakes import FakeRunner, collect, make_core, run_to_completion

from engine.outputs import FinishReason, RunnerOutput
from engine.sampling_params import SamplingParams
from engine.scheduler import SchedulerOutput
from engine.structured_spec import GrammarTooSlowError

REASON = str(GrammarTooSlowError(0.031, 0.010, 1))


@dataclass
class FailingRunner(FakeRunner):
    """Fails `victim` in the runner's result on its third step (as the sampler or a mask budget would)."""

    victim: str = "slow"
    failed: list[str] = field(default_factory=list)

    def execute(self, out: SchedulerOutput) -> RunnerOutput:
        result = super().execute(out)
        if len(self.steps) == 3 and any(s.request_id == self.victim for s in out.scheduled):
            result.sampled_token_ids.pop(self.victim, None)
            result.errors[self.victim] = REASON
            self.failed.append(self.victim)
        return result


def test_a_request_failed_by_the_step_logs_one_line_and_ends_with_its_error(caplog):
    runner = FailingRunner()
    core = make_core(runner)
    core.add_request("slow", [1, 2, 3], SamplingParams(max_tokens=8, ignore_eos=True))
    core.add_request("other", [4, 5, 6], SamplingParams(max_tokens=8, ignore_eos=True))
    with caplog.at_level(logging.DEBUG, logger="engine"):
        outs = run_to_completion(core)  # every block back, the failed request's too
    assert runner.failed == ["slow"]
    (failed,) = collect(outs, "slow").values()
    assert failed["finish_reason"] is FinishReason.ERROR
    assert [o.error for o in outs if o.request_id == "slow" and o.finished] == [REASON]
    (other,) = collect(outs, "other").values()
    assert other["finish_reason"] is FinishReason.LENGTH and len(other["token_ids"]) == 8
    about = [r for r in caplog.records if "slow" in r.getMessage()]
    assert len(about) == 1, [r.getMessage() for r in about]
    (record,) = about
    assert record.exc_info is None and record.exc_text is None  # no traceback
    assert REASON in record.getMessage() and record.levelno == logging.WARNING
