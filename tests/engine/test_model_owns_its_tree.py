"""Nothing outside the model sets attributes on it (issue 34): the model builds its own linears.

Every `nn.Module.__setattr__` made while the loader builds a model (dense and packed linears on a tiny Llama,
the GGUF's quantized blocks on the default model), while LoRA is enabled on it, and while the runner
assembles it with its attention backend is recorded with the code that made it: the innermost caller outside
torch. A call on a module of the finished model's tree passes only where that caller is the module itself
(its own `__init__` or method) or the model's code (`engine/model/models/`). The loader swapping in packed or
quantized linears, or LoRA wrapping them from its own package, fails here.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from torch import nn

from engine.lora.manager import LoRAManager
from engine.model.layers.linear import PackedLinear, packing_supported
from engine.model.layers.lora import LoRALinear
from engine.model.layers.quant_linear import QuantLinear
from engine.model.loading.loader import load_model

ROOT = Path(__file__).resolve().parents[2]
TORCH = str(Path(torch.__file__).parent)
MODEL_CODE = str(ROOT / "engine" / "model" / "models")
CPU = torch.device("cpu")


@dataclass(slots=True)
class SetAttr:
    target: nn.Module
    name: str
    caller: str  # file:function of the innermost frame outside torch
    by_itself: bool  # that frame's `self` is the target


@pytest.fixture
def recorded(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[SetAttr]]:
    calls: list[SetAttr] = []
    original = nn.Module.__setattr__

    def spy(self: nn.Module, name: str, value: object) -> None:
        frame = sys._getframe(1)
        while frame is not None and frame.f_code.co_filename.startswith(TORCH):
            frame = frame.f_back
        if frame is not None:
            where = f"{frame.f_code.co_filename}:{frame.f_code.co_name}"
            calls.append(SetAttr(self, name, where, frame.f_locals.get("self") is self))
        original(self, name, value)

    monkeypatch.setattr(nn.Module, "__setattr__", spy)
    yield calls


def from_outside(calls: list[SetAttr], model: nn.Module) -> list[str]:
    """The recorded calls on the model's tree made by code that is neither the module itself nor the model's."""
    tree = {id(m): name or "model" for name, m in model.named_modules()}
    return sorted(
        {
            f"{tree[id(c.target)]}.{c.name} by {c.caller.removeprefix(str(ROOT) + '/')}"
            for c in calls
            if id(c.target) in tree and not c.by_itself and not c.caller.startswith(MODEL_CODE)
        }
    )


def enable_lora(model) -> LoRAManager:
    return LoRAManager(model, CPU, max_loras=2, max_lora_rank=8)


def test_loading_packed_linears_and_enabling_lora_set_nothing_on_the_model(tiny_model, recorded):
    if not packing_supported(CPU, torch.float32):
        pytest.skip("this torch build has no packed oneDNN linears")
    model = load_model(tiny_model("llama").path, CPU, torch.float32)
    manager = enable_lora(model)
    # What the checks below are about did happen: the linears became packed, then wrapped.
    layer = model.layers[0].self_attn.qkv_proj
    assert isinstance(layer, LoRALinear) and isinstance(layer.base, PackedLinear)
    assert isinstance(model.lm_head, PackedLinear)  # the tied head's packed copy
    assert manager.num_wrapped == 4 * model.cfg.num_layers
    assert any(c.target is model.layers[0].self_attn for c in recorded)  # the spy saw the swaps
    assert from_outside(recorded, model) == []


def test_loading_a_ggufs_quantized_linears_sets_nothing_on_the_model(recorded):
    from engine.errors import ModelNotFoundError
    from engine.model.kernels.build import load as load_kernels
    from engine.model.loading.files import resolve_model

    kernels, why = load_kernels()
    if kernels is None or kernels.quant_linear is None:
        pytest.skip(f"no quantized-linear kernel here: {why}")
    try:
        path = resolve_model(None).path
    except ModelNotFoundError as exc:
        pytest.skip(f"default model not available here: {exc}")
    model = load_model(path, CPU, torch.bfloat16)
    enable_lora(model)
    layer = model.layers[0].mlp.down_proj
    assert isinstance(layer, LoRALinear) and isinstance(layer.base, QuantLinear)
    assert isinstance(model.lm_head, QuantLinear)
    assert from_outside(recorded, model) == []


def test_the_runner_assembling_model_backend_and_lora_sets_nothing_on_the_model(tiny_model, recorded):
    from engine.config import EngineConfig
    from engine.model_runner import ModelRunner

    path = str(tiny_model("llama").path)
    runner = ModelRunner(
        EngineConfig(model=path, device="cpu", dtype="float32", num_blocks=16, enable_lora=True)
    )
    assert runner.lora is not None and isinstance(runner.model.layers[0].mlp.gate_up_proj, LoRALinear)
    assert from_outside(recorded, runner.model) == []


def test_the_spy_sees_a_module_set_from_outside(tiny_model, recorded):
    """The check can fail: an attribute set on the model from a test (any code outside it) is reported."""
    model = load_model(tiny_model("llama").path, CPU, torch.float32, pack=False)
    model.layers[1].mlp.down_proj = nn.Identity()
    assert from_outside(recorded, model) == [
        f"layers.1.mlp.down_proj by {Path(__file__).relative_to(ROOT)}:{sys._getframe().f_code.co_name}"
    ]
