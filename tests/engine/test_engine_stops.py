"""Flows go one way: the output processor reports the sequences it ends (`Stop`s), and the engine applies them.

The processor never holds the scheduler: a stop string, an abort or a failure it finds comes back as a record,
the request's status stays the scheduler's to write, and `EngineCore` frees the blocks.
"""

from __future__ import annotations

from engine_fakes import ByteTokenizer, FakeRunner, collect, make_core, run_to_completion, scripted

from engine.output_processor import OutputProcessor, Stop
from engine.outputs import FinishReason
from engine.request import Request, RequestStatus
from engine.sampling_params import SamplingParams
from engine.scheduler import RequestUpdate
from metrics.stats import IterationStats


def running(request_id: str, params: SamplingParams, index: int = 0) -> Request:
    req = Request(request_id, [1, 2, 3], params, index=index)
    req.status = RequestStatus.RUNNING
    return req


def test_a_stop_string_comes_back_as_a_stop_and_the_status_stays_the_schedulers():
    processor = OutputProcessor(ByteTokenizer().decode)  # no scheduler to call
    req = running("r", SamplingParams(max_tokens=10, stop=["b"]))
    processor.add("r", [1, 2, 3], [req])
    tokens = [ord("a"), ord("b"), ord("c")]  # speculation can bring several at once
    for t in tokens:
        req.append_output_token(t)
    iteration = IterationStats()
    got = processor.process([RequestUpdate(req, list(tokens), None)], iteration)
    assert got.stops == [Stop(req, RequestStatus.FINISHED_STOPPED, None)]
    assert req.status is RequestStatus.RUNNING  # the engine applies the stop, not the processor
    (out,) = got.outputs
    c = out.outputs[0]
    assert out.finished and c.text == "a" and c.finish_reason is FinishReason.STOP and c.stop_reason == "b"
    assert c.token_ids == [ord("a"), ord("b")] and req.output_token_ids == [ord("a"), ord("b")]
    # The request's record says how it ended although the scheduler has not been told yet.
    assert [f.finish_reason for f in iteration.finished] == ["stop"]


def test_an_abort_ends_every_sequence_through_stops():
    processor = OutputProcessor(ByteTokenizer().decode)
    params = SamplingParams(max_tokens=10)
    children = [running(f"{i}_r", params, index=i) for i in range(3)]
    processor.add("r", [1, 2, 3], children)
    got = processor.finish("r", RequestStatus.FINISHED_ABORTED)
    assert got.stops == [Stop(c, RequestStatus.FINISHED_ABORTED) for c in children]
    assert all(c.status is RequestStatus.RUNNING for c in children)
    (out,) = got.outputs
    assert out.finished and [c.finish_reason for c in out.outputs] == [FinishReason.ABORT] * 3
    assert processor.finish("r", RequestStatus.FINISHED_ABORTED).stops == []  # gone once ended


def test_the_engine_applies_the_stops_in_the_same_step():
    core = make_core(FakeRunner(next_token=scripted("hello world")))
    core.add_request("r", [1, 2], SamplingParams(max_tokens=50, stop=["o w"], n=2, seed=1))
    outs = run_to_completion(core)  # checks that every block came back
    seqs = collect(outs, "r")
    assert [s["text"] for s in seqs.values()] == ["hell"] * 2
    assert {s["finish_reason"] for s in seqs.values()} == {FinishReason.STOP}
    assert not core.scheduler.requests
