"""Reading a PEFT adapter: what is refused (with the reason, a 400 for the server) and what the fingerprint is."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from lora_helpers import target_shapes, write_adapter
from safetensors.torch import load_file, save_file

from engine.lora.peft_format import LoRAError, TargetShape, load_peft

SHAPES = target_shapes(16, 2, 1, 8, 32)
MODEL = {t: TargetShape(i, o) for t, (i, o) in SHAPES.items()}


def adapter(tmp_path: Path, **kw) -> Path:
    return write_adapter(tmp_path / "ad", 2, SHAPES, rank=4, **kw)


def edit_config(path: Path, **changes) -> None:
    config = json.loads((path / "adapter_config.json").read_text())
    (path / "adapter_config.json").write_text(json.dumps({**config, **changes}))


def test_weights_and_scaling(tmp_path):
    path = adapter(tmp_path, alpha=8.0)
    got = load_peft(str(path), MODEL, 2, 8)
    tensors = load_file(str(path / "adapter_model.safetensors"))
    a, b = got.weights[(1, "down_proj")]
    key = "base_model.model.model.layers.1.mlp.down_proj"
    assert torch.equal(a, tensors[f"{key}.lora_A.weight"])
    torch.testing.assert_close(b, tensors[f"{key}.lora_B.weight"] * 2.0)  # alpha 8 / r 4
    assert got.rank == 4 and len(got.weights) == 14
    edit_config(path, use_rslora=True)
    assert load_peft(str(path), MODEL, 2, 8).scaling == 8.0 / 2.0  # alpha / sqrt(r)


def test_fingerprint_follows_the_bytes(tmp_path):
    one = load_peft(str(adapter(tmp_path, seed=1)), MODEL, 2, 8).fingerprint
    assert load_peft(str(tmp_path / "ad"), MODEL, 2, 8).fingerprint == one
    other = load_peft(str(write_adapter(tmp_path / "ad", 2, SHAPES, rank=4, seed=2)), MODEL, 2, 8)
    assert other.fingerprint != one


@pytest.mark.parametrize(
    "change, why",
    [
        (dict(use_dora=True), "DoRA is not supported"),
        (dict(bias="all"), "train biases"),
        (dict(modules_to_save=["lm_head"]), "modules_to_save"),
        (dict(rank_pattern={"q_proj": 2}), "rank_pattern"),
        (dict(peft_type="IA3"), "only LoRA"),
        (dict(r=0), "r must be a positive integer"),
    ],
)
def test_unsupported_configs_are_refused(tmp_path, change, why):
    path = adapter(tmp_path)
    edit_config(path, **change)
    with pytest.raises(LoRAError, match=why):
        load_peft(str(path), MODEL, 2, 8)


def test_bad_files_are_refused(tmp_path):
    path = adapter(tmp_path)
    with pytest.raises(LoRAError, match="past the model's 1 layers"):
        load_peft(str(path), MODEL, 1, 8)
    with pytest.raises(LoRAError, match="above --max-lora-rank 2"):
        load_peft(str(path), MODEL, 2, 2)
    (path / "adapter_config.json").write_text("{not json")
    with pytest.raises(LoRAError, match="not valid JSON"):
        load_peft(str(path), MODEL, 2, 8)
    path = adapter(tmp_path)
    tensors = load_file(str(path / "adapter_model.safetensors"))
    key = "base_model.model.model.layers.0.self_attn.q_proj"
    for bad, why in (
        ({k: v for k, v in tensors.items() if k != f"{key}.lora_B.weight"}, "needs both lora_A and lora_B"),
        ({**tensors, f"{key}.lora_A.weight": torch.full((4, 16), float("nan"))}, "must be finite"),
        ({**tensors, "base_model.model.lm_head.lora_A.weight": torch.zeros(4, 16)}, "not a decoder-layer"),
        ({**tensors, f"{key}.lora_A.weight": torch.zeros(3, 16)}, "do not fit"),
    ):
        save_file(bad, str(path / "adapter_model.safetensors"))
        with pytest.raises(LoRAError, match=why):
            load_peft(str(path), MODEL, 2, 8)
    (path / "adapter_model.safetensors").write_bytes(b"garbage")
    with pytest.raises(LoRAError, match="cannot read adapter_model.safetensors"):
        load_peft(str(path), MODEL, 2, 8)
