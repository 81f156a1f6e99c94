"""An architecture's native paths are declared, not guessed (issue 34): a Llama variant registered with one
Python change gets that change on CPU with the GGUF's quantized weights, because it declares only the native
paths that still match its code, and the others step aside.

The variant: Gemma's RMSNorm, (1 + w) where Llama has w, in every norm. The fused norm kernels and the native
decoder stack read the norm weights themselves, so where they ran they would compute Llama's norm and silently
drop the change (the last test shows it: declared, the change is gone, bit for bit).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch

from engine.model.config import ARCHITECTURES, Architecture
from engine.model.layers.norm import RMSNorm
from engine.model.layers.quant_linear import QuantLinear
from engine.model.models import registry
from engine.model.models.capabilities import ALL, Capabilities
from engine.model.models.llama import LlamaForCausalLM

VARIANT = "UnitOffsetNormLlamaForCausalLM"
PROMPT = [1, 504, 3458, 282, 4649, 314, 2385, 30] * 5


class UnitOffsetRMSNorm(RMSNorm):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (1 + self.weight) * xf.to(x.dtype)  # the one line that differs from Llama's


class UnitOffsetNormLlama(LlamaForCausalLM):
    norm_class = UnitOffsetRMSNorm


def test_every_readable_architecture_has_a_model_and_llama_declares_every_path():
    assert set(registry.MODELS) == set(ARCHITECTURES)
    assert registry.lookup("LlamaForCausalLM").capabilities == ALL
    assert Capabilities().describe() == "none"
    with pytest.raises(ValueError, match="no model class"):
        registry.lookup("GPT2LMHeadModel")


@pytest.fixture(scope="module")
def default_dir() -> Path:
    from engine.errors import ModelNotFoundError
    from engine.model.loading.files import resolve_model

    try:
        return resolve_model(None).path
    except ModelNotFoundError as exc:
        pytest.skip(f"default model not available here: {exc}")


def _variant_dir(default: Path, dest: Path) -> Path:
    """The default model's converted directory under the variant's architecture name: the same weights, and
    the same GGUF behind them (its `complete` marker), so the quantized linears apply."""
    dest.mkdir()
    for f in default.iterdir():
        if f.name != "config.json":
            (dest / f.name).symlink_to(f)
    config = json.loads((default / "config.json").read_text())
    (dest / "config.json").write_text(json.dumps({**config, "architectures": [VARIANT]}))
    return dest


def _logits(path: Path, quantization: str = "auto"):
    """Every prompt row's next-token logits [len(PROMPT), vocab] through the runner, and the runner."""
    from engine.config import EngineConfig
    from engine.model_runner import ModelRunner
    from engine.outputs import ScheduledRequest
    from engine.sampling_params import SamplingParams

    config = EngineConfig(
        model=str(path), device="cpu", dtype="float32", num_blocks=8, quantization=quantization
    )
    runner = ModelRunner(config)
    params = SamplingParams(temperature=0.0, prompt_logprobs=1)
    req = ScheduledRequest("r", PROMPT, 0, [0, 1, 2], True, params, PROMPT, len(PROMPT), 0)
    return runner._run(runner._prepare([req])), runner


def _register(monkeypatch, caps: Capabilities) -> None:
    monkeypatch.setitem(ARCHITECTURES, VARIANT, Architecture())
    monkeypatch.setitem(registry.MODELS, VARIANT, registry.ModelSpec(UnitOffsetNormLlama, caps))


@pytest.mark.slow
def test_a_variant_s_python_change_holds_on_cpu_with_quantized_weights(
    default_dir, tmp_path, monkeypatch, caplog
):
    # It declares the quantized linears (drop-in linears: its change is not in them) and nothing else.
    _register(monkeypatch, Capabilities(quantized_linears=True))
    path = _variant_dir(default_dir, tmp_path / "variant")
    with caplog.at_level(logging.INFO, logger="engine.model_runner"):
        fast, runner = _logits(path)
    assert any(isinstance(m, QuantLinear) for m in runner.model.modules())  # the GGUF's blocks as stored
    assert runner.layer_stack is None
    assert f"from Python ({VARIANT} declares no native decoder stack)" in caplog.text
    del runner
    # The plain Python path of the same variant: dequantized weights, every layer from Python.
    reference, _ = _logits(path, quantization="none")
    llama, _ = _logits(default_dir)
    # Quantized blocks as stored against the same values dequantized: float32 rounding apart.
    scale = reference.abs().max().item()
    assert (fast - reference).abs().max().item() <= 1e-3 * scale
    # ... while Llama's norm on the same weights gives another model entirely.
    assert (fast - llama).abs().max().item() > 0.1 * scale
    assert (fast.argmax(-1) != llama.argmax(-1)).any()


@pytest.mark.slow
def test_declared_paths_that_do_not_match_the_code_would_drop_the_change(default_dir, tmp_path, monkeypatch):
    # What a guessed fast path did: the variant declaring Llama's paths runs Llama's norm, bit for bit.
    _register(monkeypatch, ALL)
    path = _variant_dir(default_dir, tmp_path / "variant")
    wrong, runner = _logits(path)
    assert runner.layer_stack is not None
    del runner
    llama, _ = _logits(default_dir)
    assert torch.equal(wrong, llama)
