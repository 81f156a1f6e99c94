"""Turns the scheduler's token updates into the `RequestOutput` deltas a caller sees.

Per request (one `add`, n sequences): detokenizes each sequence (`TextStream`), applies stop strings, leaves a
stop token's text out, merges the n sequences' deltas into one `RequestOutput` per step, and records a
`FinishedRequestStats` when the last sequence ends.

It never calls the scheduler. A sequence it ends (a stop string, an abort, a failure) comes back as a `Stop`
beside the outputs, and `EngineCore` applies the stops (`Scheduler.finish`: status set, blocks freed) before
anything else reads the scheduler. The processor reads the status it decided from its own record of the
group until then.

Failure rule: an exception while handling one request's output fails that request only (all its sequences
end with finish reason "error" and `RequestOutput.error` set); the others carry on.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

from engine.detokenizer import Decode, TextStream
from engine.outputs import CompletionOutput, RequestOutput, TokenLogprob
from engine.request import Request, RequestStatus
from engine.scheduler import RequestUpdate
from metrics.stats import FinishedRequestStats, IterationStats

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class Stop:
    """A sequence the output processor ended: the engine finishes it in the scheduler with this status."""

    request: Request
    status: RequestStatus
    error: str | None = None


@dataclass(slots=True)
class Processed:
    """What one call gives the engine: the callers' outputs, and the sequences to finish in the scheduler."""

    outputs: list[RequestOutput]
    stops: list[Stop]


@dataclass(slots=True)
class _Group:
    """One add_request call: its n sequences and what has been sent for them."""

    request_id: str
    prompt_token_ids: list[int]
    children: list[Request]
    streams: list[TextStream]
    num_cached_tokens: int = 0
    sent_prompt_logprobs: bool = False
    # Sequence index -> how it ended, as this processor saw it (the scheduler learns of its own stops first,
    # of the processor's from the `Stop`s once the call returns).
    ended: dict[int, RequestStatus] = field(default_factory=dict)
    error: str | None = None  # the first failure that ended the group's sequences


class OutputProcessor:
    def __init__(self, decode: Decode) -> None:
        self.decode = decode
        self._groups: dict[str, _Group] = {}
        self._child_group: dict[str, tuple[_Group, int]] = {}  # child request id -> (group, index)
        # Requests finished since the last process() (aborts happen between steps): for the next record.
        self._finished_stats: list[FinishedRequestStats] = []
        self._stops: list[Stop] = []  # decided during the current call, handed back by it

    def add(self, request_id: str, prompt_token_ids: list[int], children: list[Request]) -> None:
        """Registers a request's sequences; ValueError if any id is in use (nothing is registered then)."""
        if request_id in self._groups:
            raise ValueError(f"request id {request_id!r} is already in use")
        for child in children:
            if child.request_id in self._child_group:  # e.g. a user id "0_x" next to "x" with n > 1
                raise ValueError(f"request id {child.request_id!r} is already in use")
        # Only seeds differ between the sequences: the first one's params describe the text for all.
        streams = [TextStream(self.decode, prompt_token_ids, c.sampling_params) for c in children]
        group = _Group(request_id, prompt_token_ids, children, streams)
        self._groups[request_id] = group
        for i, child in enumerate(children):
            self._child_group[child.request_id] = (group, i)

    def finish(self, request_id: str, status: RequestStatus, error: str | None = None) -> Processed:
        """Ends every sequence of a request now: its final output, and the stops that free its blocks.
        Unknown ids: nothing."""
        group = self._groups.get(request_id)
        if group is None:
            return Processed([], [])
        output = self._group_output(group, self._finish_children(group, status, error))
        return Processed([output], self._take_stops())

    def process(self, updates: list[RequestUpdate], iteration: IterationStats) -> Processed:
        """A step's updates as outputs, plus the sequences the step's text ended (stop strings, failures)."""
        now = time.monotonic()
        touched: dict[str, tuple[_Group, dict[int, CompletionOutput]]] = {}
        for upd in updates:
            req = upd.request
            if req.request_id not in self._child_group:
                continue  # its group already failed earlier in this loop
            group, index = self._child_group[req.request_id]
            entry = touched.setdefault(group.request_id, (group, {}))
            if req.status is RequestStatus.FINISHED_ERROR:
                # The scheduler failed this sequence for a reason it already put into words (a grammar over
                # the mask budget, no finite logit): one line, since a traceback here would show only this
                # loop, never where the failure happened.
                logger.warning("request %s failed: %s", group.request_id, req.error)
                self._fail_group(group, entry[1], req.error or "the request failed")
                continue
            try:
                # Stamped before _completion, which may finish the group and take its stats at once.
                if upd.new_token_ids:
                    if req.first_token_time is None:
                        req.first_token_time = now
                        iteration.ttfts.append(now - req.arrival_time)
                    else:
                        iteration.inter_token_latencies.append(now - (req.last_token_time or now))
                    req.last_token_time = now
                completion = self._completion(group, index, upd)  # may cut new_token_ids at a stop string
                iteration.num_generation_tokens += len(upd.new_token_ids)
            except Exception as exc:  # e.g. a token id the tokenizer cannot decode: fail this request only
                logger.exception("request %s failed while processing its output", group.request_id)
                self._fail_group(group, entry[1], str(exc) or repr(exc))
                continue
            if completion is not None:
                entry[1][index] = completion
        outputs = []
        for group, completions in touched.values():
            outputs.append(self._group_output(group, list(completions.values())))
        iteration.finished.extend(self._finished_stats)
        self._finished_stats.clear()
        return Processed(outputs, self._take_stops())

    def _fail_group(self, group: _Group, completions: dict[int, CompletionOutput], error: str) -> None:
        """Ends every sequence of `group` with finish reason "error", into this step's `completions`."""
        for completion in self._finish_children(group, RequestStatus.FINISHED_ERROR, error):
            earlier = completions.get(completion.index)
            if earlier is not None:  # keep the delta it already got in this step
                earlier.finish_reason = completion.finish_reason
            else:
                completions[completion.index] = completion

    def _take_stops(self) -> list[Stop]:
        stops, self._stops = self._stops, []
        return stops

    def _completion(self, group: _Group, index: int, upd: RequestUpdate) -> CompletionOutput | None:
        req, stream = upd.request, group.streams[index]
        # Several tokens come at once from speculative decoding (engine.spec_decode); only the last one can
        # have ended the sequence as a stop token.
        last = len(upd.new_token_ids) - 1
        status = req.status
        for i, token in enumerate(upd.new_token_ids):
            # A stop token / EOS that ended the sequence is not part of its text.
            ended_by_token = (
                i == last
                and req.status is RequestStatus.FINISHED_STOPPED
                and req.stop_reason in (None, token)
            )
            if ended_by_token and not req.sampling_params.include_stop_str_in_output:
                stream.add_token(token, skip_text=True)
            elif stream.add_token(token) is not None:
                # A stop string wins over "length" when the last allowed token completes it (as in vLLM).
                req.stop_reason = stream.stopped_by
                # Tokens after it in this update would not exist without speculation: gone, before the
                # blocks are freed.
                req.truncate_output(req.num_output_tokens - (last - i))
                del upd.new_token_ids[i + 1 :]
                if upd.logprobs is not None:
                    del upd.logprobs[i + 1 :]
                status = RequestStatus.FINISHED_STOPPED
                self._stops.append(Stop(req, status, req.error))
                break
        if req.num_cached_tokens >= 0 and index == 0:
            group.num_cached_tokens = req.num_cached_tokens
        finished = status.is_finished
        if finished:
            self._mark_child_finished(group, index, status)
        text = stream.take_delta(finished)
        if not (text or upd.new_token_ids or finished):
            return None
        return CompletionOutput(
            index=req.index,
            text=text,
            token_ids=list(upd.new_token_ids),
            logprobs=upd.logprobs if req.sampling_params.logprobs is not None else None,
            finish_reason=status.finish_reason if finished else None,
            stop_reason=req.stop_reason if finished else None,
            num_output_tokens=req.num_output_tokens,
        )

    def _group_output(self, group: _Group, completions: list[CompletionOutput]) -> RequestOutput:
        finished = len(group.ended) == len(group.children)
        prompt_logprobs: list[TokenLogprob | None] | None = None
        if not group.sent_prompt_logprobs and group.children[0].prompt_logprobs is not None:
            prompt_logprobs = group.children[0].prompt_logprobs
            group.sent_prompt_logprobs = True
        if finished:
            self._groups.pop(group.request_id, None)
        return RequestOutput(
            request_id=group.request_id,
            outputs=sorted(completions, key=lambda c: c.index),
            prompt_token_ids=group.prompt_token_ids,
            num_cached_tokens=max(0, group.num_cached_tokens),
            finished=finished,
            prompt_logprobs=prompt_logprobs,
            error=group.error or next((c.error for c in group.children if c.error), None),
        )

    def _finish_children(
        self, group: _Group, status: RequestStatus, error: str | None = None
    ) -> list[CompletionOutput]:
        """Ends every unfinished sequence of a group now (a `Stop` each); returns their last deltas."""
        if error is not None and group.error is None:
            group.error = error
        completions = []
        for i, child in enumerate(group.children):
            if i in group.ended:
                continue
            self._stops.append(Stop(child, status, error))
            self._mark_child_finished(group, i, status)
            completions.append(
                CompletionOutput(
                    index=child.index,
                    text="",
                    token_ids=[],
                    logprobs=None,
                    finish_reason=status.finish_reason,
                    num_output_tokens=child.num_output_tokens,
                )
            )
        return completions

    def _mark_child_finished(self, group: _Group, index: int, status: RequestStatus) -> None:
        if index in group.ended:
            return
        group.ended[index] = status
        self._child_group.pop(group.children[index].request_id, None)
        if len(group.ended) == len(group.children):
            self._finished_stats.append(_finished_stats(group))


def _finished_stats(group: _Group) -> FinishedRequestStats:
    """One record per request (all n sequences). Token timings are per sequence, as the TTFT histogram is fed
    (one observation per sequence, like vLLM's n child requests)."""
    now = time.monotonic()
    children = group.children
    first = children[0]
    first_tokens = [c.first_token_time for c in children if c.first_token_time is not None]
    scheduled = [c.first_scheduled_time for c in children if c.first_scheduled_time is not None]
    reason = group.ended[0].finish_reason
    return FinishedRequestStats(
        finish_reason=reason.value if reason is not None else "abort",
        num_prompt_tokens=first.num_prompt_tokens,
        num_generation_tokens=sum(c.num_output_tokens for c in children),
        num_cached_tokens=max(0, first.num_cached_tokens),
        e2e_latency=now - first.arrival_time,
        # Never scheduled (aborted while waiting): no queue time, as vLLM records none for a request that did
        # not reach scheduling; 0.0 would land in the histogram as an instant start.
        queue_time=min(scheduled) - first.arrival_time if scheduled else None,
        ttft=min(first_tokens) - first.arrival_time if first_tokens else None,
        mean_times_per_output_token=[t for t in map(_mean_time_per_output_token, children) if t is not None],
    )


def _mean_time_per_output_token(seq: Request) -> float | None:
    """First to last token of one sequence over its tokens after the first (None below 2 tokens). Ends at the
    last token, not at the finish: a sequence aborted long after its last token did not decode slower."""
    if seq.num_output_tokens < 2 or seq.first_token_time is None or seq.last_token_time is None:
        return None
    return (seq.last_token_time - seq.first_token_time) / (seq.num_output_tokens - 1)


def error_output(request_id: str, prompt: list[int], n: int, error: str) -> RequestOutput:
    """The only output of a request that failed before it ran."""
    finish = [CompletionOutput(i, "", [], None, RequestStatus.FINISHED_ERROR.finish_reason) for i in range(n)]
    return RequestOutput(request_id, finish, prompt, 0, finished=True, error=error)
