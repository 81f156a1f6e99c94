"""Whose fault a failed step was: when the runner raises for a step of several requests, each is run again
alone. Those that raise alone fail (`RunnerOutput.errors`, their blocks freed by the scheduler); the others get
the results of their solo run, which are the bits the batch would have given them (batch invariance). Only a
fault no request can be blamed for is fatal: every request passes alone (the batch itself broke), or every
one fails alone (the model is broken for everyone, e.g. out of memory).

Running a request again is safe: a step only writes its own new tokens' KV (the same values at the same
slots again), block copies read cached blocks that no step writes, and nothing advances a request's state
(grammar, tokens) before the scheduler applies the results.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from typing import Protocol, cast

from engine.outputs import RunnerOutput, SchedulerOutput

logger = logging.getLogger(__name__)


class Executes(Protocol):
    def execute(self, out: SchedulerOutput) -> RunnerOutput: ...


class Pauses(Protocol):
    """A runner that calls a hook between two decoder layers (model_runner.ModelRunner on CPU)."""

    def execute(
        self, out: SchedulerOutput, between_layers: Callable[[], None] | None = None
    ) -> RunnerOutput: ...


def execute_attributing(
    runner: Executes, out: SchedulerOutput, between_layers: Callable[[], None] | None = None
) -> RunnerOutput:
    """`runner.execute(out)`; on an exception with several requests scheduled, the solo reruns above. Raises
    the step's own exception when the fault cannot be attributed. `between_layers`: handed to the first run
    only (the runner must be one that `Pauses`); the solo reruns never pause."""
    try:
        if between_layers is not None:
            return cast(Pauses, runner).execute(out, between_layers)
        return runner.execute(out)
    except Exception as batch_error:
        if len(out.scheduled) < 2:
            raise
        merged = RunnerOutput({})
        failed: list[str] = []
        for sr in out.scheduled:
            alone = dataclasses.replace(out, scheduled=[sr], num_batched_tokens=len(sr.new_token_ids))
            try:
                result = runner.execute(alone)
            except Exception as exc:
                failed.append(sr.request_id)
                merged.errors[sr.request_id] = f"the model failed on this request: {exc!r}"
                continue
            for f in dataclasses.fields(RunnerOutput):  # every field is a dict keyed by request id
                getattr(merged, f.name).update(getattr(result, f.name))
        if not failed or len(failed) == len(out.scheduled):
            raise batch_error
        # The request ids are opaque; the log never names a tenant or what a request asked.
        logger.warning(
            "a step of %d requests failed (%r); %d of them fail alone and the rest go on",
            len(out.scheduled),
            batch_error,
            len(failed),
        )
        return merged
