"""The measured draft threshold (engine.spec_cost): what a draft row costs over a sequence's row, per batch
size, from decode steps' wall time; and that the engine feeds it only decode-only steps."""

from __future__ import annotations

import time
from dataclasses import dataclass
from types import SimpleNamespace

from engine_fakes import ByteTokenizer, run_to_completion, scripted
from test_spec_decode import TEXT, SpecFakeRunner

from engine.config import EngineConfig
from engine.engine_core import EngineCore
from engine.outputs import RunnerOutput, SchedulerOutput
from engine.sampling_params import SamplingParams
from engine.spec_config import SpeculativeConfig
from engine.spec_cost import FALLBACK, HIGHEST, LOWEST, DraftCost
from engine.spec_decode import SpecDecoder

MIN_STEPS = 10  # steps that are surely enough for a line (engine.spec_cost.MIN_WEIGHT)


def feed(
    cost: DraftCost, seqs: int, per_seq: float, per_draft: float, drafts: list[int], rounds: int = 5
) -> None:
    """Steps of `seqs` sequences: a plain one, then one with each of `drafts`, `rounds` times, each taking
    per_seq per sequence plus per_draft per draft token."""
    for _ in range(rounds):
        cost.observe(seqs, 0, seqs * per_seq)
        for d in drafts:
            cost.observe(seqs, d, seqs * per_seq + d * per_draft)


def test_the_threshold_is_a_draft_rows_cost_over_a_sequences_per_batch_size() -> None:
    cost = DraftCost()
    assert cost.threshold(1) == FALLBACK  # nothing measured yet
    feed(cost, 1, 0.012, 0.0008, [1, 2, 4])  # one sequence: 12 ms a step, 0.8 ms a draft (an AMX Xeon's)
    assert abs(cost.threshold(1) - 0.0667) < 1e-3
    assert cost.threshold(16) == FALLBACK  # another class: not measured by one sequence's steps
    feed(cost, 16, 0.004, 0.001, [16, 32, 64])  # 16 sequences: 4 ms of a step each, a draft 1 ms
    assert abs(cost.threshold(16) - 0.25) < 1e-3 and abs(cost.threshold(31) - 0.25) < 1e-3
    assert abs(cost.threshold(1) - 0.0667) < 1e-3  # unchanged by the other class
    feed(cost, 40, 0.002, 0.004, [40, 80])  # where a draft costs twice a sequence's row: held below 1
    assert cost.threshold(64) == HIGHEST


def test_drafts_in_every_step_still_measure_and_a_stall_is_left_out() -> None:
    """No step without drafts is needed: the line through steps of 2 and 4 drafts has the same intercept."""
    cost = DraftCost()
    for _ in range(4):  # 8 steps: not yet enough
        cost.observe(1, 2, 0.011)
        cost.observe(1, 4, 0.012)
    assert cost.threshold(1) == FALLBACK
    for _ in range(2):
        cost.observe(1, 2, 0.011)
        cost.observe(1, 4, 0.012)
    assert abs(cost.threshold(1) - 0.05) < 1e-6
    cost.observe(1, 4, 5.0)  # a step stalled by something else for 5 s: left out
    assert abs(cost.threshold(1) - 0.05) < 1e-6 and cost.classes[0].steps == 12
    for _ in range(40):  # then only steps of 4 drafts: too alike for a line; the last threshold holds
        cost.observe(1, 4, 0.012)
    assert abs(cost.threshold(1) - 0.05) < 1e-6
    cost.observe(1, 0, 0.0)  # nothing measured: ignored
    cost.observe(0, 3, 0.01)
    assert cost.classes[0].steps == 52


def test_the_decoder_drafts_by_the_measured_threshold_unless_one_is_given() -> None:
    auto = SpecDecoder(SpeculativeConfig(num_speculative_tokens=8), 1024)
    fixed = SpecDecoder(SpeculativeConfig(num_speculative_tokens=8, min_draft_acceptance=0.3), 1024)
    for spec in (auto, fixed):
        for _ in range(MIN_STEPS):
            spec.observe_step(1, 0, 0.010)
            spec.observe_step(1, 4, 0.0104)  # a draft row: 0.01 of a sequence's
        spec.begin_step([SimpleNamespace(num_tokens=9, num_computed_tokens=8)], 0, {})  # type: ignore[list-item]
    assert fixed.threshold == 0.3 and fixed.num_drafts(0.5) == 1  # .5 | .25
    assert auto.threshold == LOWEST  # measured 0.01, held at the lowest
    # .5 .25 .125 .0625, each at least .02 x the tokens per cost before it; .031 < .02 x 1.79
    assert auto.num_drafts(0.5) == 4


@dataclass
class SlowDraftRunner(SpecFakeRunner):
    """A step takes 2 ms, plus 1 ms per draft token: a draft row costs half a sequence's."""

    def execute(self, out: SchedulerOutput) -> RunnerOutput:
        time.sleep(0.002 + 0.001 * sum(len(s.draft_token_ids) for s in out.scheduled))
        return super().execute(out)


def test_the_engine_times_its_decode_steps_for_the_threshold() -> None:
    spec = SpeculativeConfig(num_speculative_tokens=4, prompt_lookup_max=4, prompt_lookup_min=2)
    runner = SlowDraftRunner(num_blocks=96, block_size=4, next_token=scripted(TEXT * 3))
    core = EngineCore(
        runner, ByteTokenizer(), EngineConfig(speculative_config=spec, max_num_batched_tokens=32)
    )
    core.add_request("a", list((TEXT * 2).encode()), SamplingParams(max_tokens=80))
    run_to_completion(core)
    decoder = core.scheduler.spec
    assert decoder is not None and decoder.cost is not None
    decode_steps = sum(1 for out in runner.steps if out.decode_only())
    assert decode_steps >= 10 and decode_steps < len(runner.steps)  # the prompt's chunks ran too
    # every decode step was taken in (but for a few stalls left out on a loaded machine), and no prefill chunk was
    assert decode_steps - 5 <= decoder.cost.classes[0].steps <= decode_steps


@dataclass
class PausingSpecRunner(SpecFakeRunner):
    """Pauses once in every step, as the real runner does between layers (engine.express)."""

    yields_between_layers: bool = True

    def execute(self, out: SchedulerOutput, between_layers=None) -> RunnerOutput:  # type: ignore[override]
        if between_layers is not None:
            between_layers()
        return super().execute(out)


class SlowPause:
    """The driver's side of a pause (engine.express.Interjection), taking 150 ms."""

    def __init__(self) -> None:
        self.polls = 0

    def poll(self) -> None:
        self.polls += 1
        time.sleep(0.15)

    def emit(self, outputs: list) -> None:
        pass


def test_a_steps_pauses_are_not_counted_as_its_own_time() -> None:
    """A decode step of 16 sequences pauses for the express lane (engine.express); the threshold must see the
    step's own time, not the pause's."""
    spec = SpeculativeConfig(num_speculative_tokens=4, prompt_lookup_max=4, prompt_lookup_min=2)
    runner = PausingSpecRunner(num_blocks=400, block_size=4, next_token=scripted(TEXT * 3))
    core = EngineCore(
        runner, ByteTokenizer(), EngineConfig(speculative_config=spec, max_num_batched_tokens=256)
    )
    assert core.scheduler.express_enabled
    decoder = core.scheduler.spec
    assert decoder is not None
    seen: list[tuple[int, float]] = []
    decoder.observe_step = lambda seqs, drafts, seconds: seen.append((seqs, seconds))  # type: ignore[method-assign]
    for i in range(16):
        core.add_request(f"r{i}", list(TEXT[i : i + 12].encode()), SamplingParams(max_tokens=12))
    pause = SlowPause()
    while core.has_work():
        core.step(between=pause)
    sixteen = [s for n, s in seen if n == 16]
    assert pause.polls >= 3 and len(sixteen) >= 3  # decode steps of all 16 ran, and paused
    assert max(sixteen) < 0.1, sixteen  # each paused 150 ms: left out
