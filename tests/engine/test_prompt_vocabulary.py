"""Token-id prompts are checked against the smaller of the model's and the tokenizer's vocabularies, before
the request is queued (issue 28, section 5): an id past the model's embedding would otherwise reach the
runner, which checks the whole batch at once."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
from engine_fakes import ByteTokenizer, FakeRunner, make_core, run_to_completion

from engine.config import EngineConfig
from engine.engine_core import EngineCore
from engine.errors import PromptTokenError
from engine.sampling_params import SamplingParams

PARAMS = SamplingParams(max_tokens=2, temperature=0.0)


@dataclass
class SmallModelRunner(FakeRunner):
    vocab_size: int = 200  # the byte tokenizer's is 256


class SizedTokenizer(ByteTokenizer):
    vocab_size = 150


def test_an_id_the_tokenizer_knows_but_the_model_does_not_is_refused_up_front() -> None:
    core = make_core(SmallModelRunner(num_blocks=64))
    assert core.vocab_size == 200
    with pytest.raises(PromptTokenError) as err:
        core.check_request([1, 2, 230], PARAMS)
    assert err.value.param == "prompt" and "0..199" in str(err.value)
    for bad in ([200], [-1, 5]):
        with pytest.raises(PromptTokenError):
            core.check_request(bad, PARAMS)
    core.check_request([0, 199], PARAMS)  # the bounds themselves are fine


def test_the_smaller_vocabulary_wins_whichever_it_is() -> None:
    core = EngineCore(SmallModelRunner(num_blocks=64), SizedTokenizer(), EngineConfig())
    assert core.vocab_size == 150
    with pytest.raises(PromptTokenError):
        core.check_request([170], PARAMS)


def test_a_bad_prompt_fails_alone_and_never_reaches_a_step() -> None:
    runner = SmallModelRunner(num_blocks=64)
    core = make_core(runner)
    core.add_request("good", [5, 6, 7], PARAMS)
    (out,) = core.add_request("bad", [5, 250], PARAMS)
    assert out.finished and out.error is not None and "vocabulary" in out.error
    outputs = run_to_completion(core)
    assert all(s.request_id == "good" for step in runner.steps for s in step.scheduled)
    assert any(o.request_id == "good" and o.finished for o in outputs)
