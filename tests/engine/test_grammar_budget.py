"""The grammar mask budget (--grammar-mask-budget-ms) is a request's own: the masks of all its n sequences
for one token are summed against it, never another request's, and only that sum decides whether the
request is refused up front (a 400) or failed on the way (finish_reason "error" with an error that names
the budget). CPU time is faked (6 ms per mask against a 10 ms budget) so that the verdicts do not depend on
this machine's speed."""

from __future__ import annotations

import itertools
import time
from types import SimpleNamespace

import pytest
import xgrammar as xgr

from engine import grammar_compile, grammar_state
from engine.async_engine import AsyncEngine
from engine.config import EngineConfig
from engine.engine_core import EngineCore
from engine.outputs import FinishReason, RequestOutput, RunnerOutput, SchedulerOutput
from engine.sampling_params import SamplingParams
from engine.structured_output import GrammarCompiler
from engine.structured_spec import StructuredOutputError, StructuredOutputSpec, is_mask_budget_error
from tests.engine.engine_fakes import ByteTokenizer, FakeRunner, collect, run_to_completion, scripted

BUDGET_S = 0.010
MASK_S = 0.006  # one sequence's mask: under the budget alone, over it two by two
LETTERS = StructuredOutputSpec("regex", "a+")


def _info() -> xgr.TokenizerInfo:
    # The byte tokenizer's ids: id b is the character b (0 is EOS).
    vocab = ["<eos>"] + [chr(b) for b in range(1, 256)]
    return xgr.TokenizerInfo(vocab, vocab_type=xgr.VocabType.RAW, vocab_size=256, stop_token_ids=[0])


def _fake_cpu_clock(module: object, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every mask `module` times costs MASK_S of CPU: its clock moves MASK_S per reading, and a mask is timed
    by two readings in a row (nothing else there reads thread_time)."""
    readings = itertools.count()
    clock = SimpleNamespace(thread_time=lambda: next(readings) * MASK_S, perf_counter=time.perf_counter)
    monkeypatch.setattr(module, "time", clock)


class MaskingRunner(FakeRunner):
    """A fake runner that fills each constrained row's mask before its token, as the real runner's mask
    thread does; its 'model' writes letters the grammar allows."""

    def execute(self, out: SchedulerOutput) -> RunnerOutput:
        bitmask = xgr.allocate_token_bitmask(1, 256)
        for s in out.scheduled:
            if s.sample and s.grammar is not None and s.grammar.active:
                s.grammar.fill_mask(bitmask, 0)
        return super().execute(out)


def test_n_sequences_spend_one_budget_and_fail_together_while_a_lone_one_goes_on(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    grammar = GrammarCompiler(_info(), mask_budget_s=BUDGET_S).compile(LETTERS)
    _fake_cpu_clock(grammar_state, monkeypatch)
    core = EngineCore(MaskingRunner(next_token=scripted("a" * 64)), ByteTokenizer(), EngineConfig())
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    core.add_request("lone", [1, 2, 3], params, grammar=grammar)
    core.add_request("pair", [1, 2, 3], SamplingParams(n=2, max_tokens=8, ignore_eos=True), grammar=grammar)
    outputs: list[RequestOutput] = run_to_completion(core)  # every block comes back
    lone = collect(outputs, "lone")[0]
    assert lone["finish_reason"] is FinishReason.LENGTH and lone["text"] == "a" * 8  # 6 ms: within its own
    pair = collect(outputs, "pair")
    assert {s["finish_reason"] for s in pair.values()} == {FinishReason.ERROR}  # 2 x 6 ms a token: over
    errors = {o.error for o in outputs if o.request_id == "pair" and o.error is not None}
    assert len(errors) == 1
    error = errors.pop()
    assert is_mask_budget_error(error) and "across its 2 sequences" in error and "10 ms" in error
    assert not any(o.error for o in outputs if o.request_id == "lone")


def _async_engine(grammars: GrammarCompiler) -> AsyncEngine:
    core = EngineCore(FakeRunner(next_token=scripted("aaaa")), ByteTokenizer(), EngineConfig())
    return AsyncEngine(core, core.tokenizer, model_name="fake", grammars=grammars)


async def test_a_request_whose_sequences_first_masks_together_are_over_budget_is_refused_up_front(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _fake_cpu_clock(grammar_compile, monkeypatch)  # the first mask, timed when it compiles: 6 ms
    grammars = GrammarCompiler(_info(), mask_budget_s=BUDGET_S)
    engine = _async_engine(grammars)
    try:
        one = SamplingParams(max_tokens=2, temperature=0, structured=LETTERS)
        async for _ in engine.generate([1, 2, 3], one):
            pass
        for n in (2, 3):  # compiled then, a cache hit now: refused either way, before it is queued
            with pytest.raises(StructuredOutputError, match=rf"{n} sequences.*--grammar-mask-budget-ms"):
                async for _ in engine.generate(
                    [1, 2, 3], SamplingParams(n=n, max_tokens=2, structured=LETTERS)
                ):
                    pass
        assert grammars.compiles == 1
    finally:
        engine.shutdown()
