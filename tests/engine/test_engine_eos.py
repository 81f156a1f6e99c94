"""One EOS set: the ids the scheduler stops on are the ids the sampler masks under min_tokens.

vLLM's set: the tokenizer's EOS plus the generation config's `eos_token_id` (generation_config.json, or
config.json where there is none). Before, the scheduler stopped on the tokenizer's set and the sampler masked
the model config's, so a model whose tokenizer and config name different EOS tokens could emit an EOS inside
min_tokens (unmasked, it did not stop either) and then run past an EOS it had masked.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine.config import EngineConfig
from engine.engine_core import EngineCore
from engine.outputs import FinishReason
from engine.sampling_params import SamplingParams
from engine.tokenizer import Tokenizer
from tests.server.tiny_qwen import build_tiny_qwen

CONFIG_EOS = 0  # config.json's EOS: a byte token, the tokenizer's own EOS is <|im_end|>


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny model whose every logit is 0 (the final norm's weight zeroed), so greedy takes the lowest id
    left unmasked: id 0, config.json's EOS, whenever it may."""
    path = build_tiny_qwen(tmp_path_factory.mktemp("eos"))
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "eos_token_id": CONFIG_EOS}))
    (path / "generation_config.json").unlink(missing_ok=True)
    weights = load_file(path / "model.safetensors")
    weights["model.norm.weight"] = torch.zeros_like(weights["model.norm.weight"])
    save_file(weights, path / "model.safetensors", metadata={"format": "pt"})
    return path


def test_the_eos_set_is_the_tokenizers_and_the_generation_configs(model_dir: Path, tmp_path: Path) -> None:
    tok = Tokenizer(model_dir)
    im_end = tok.hf.convert_tokens_to_ids("<|im_end|>")
    assert tok.eos_token_ids == {im_end, CONFIG_EOS}  # no generation_config.json: config.json's
    (tmp_path / "m").mkdir()
    for f in model_dir.iterdir():
        (tmp_path / "m" / f.name).symlink_to(f)
    (tmp_path / "m" / "generation_config.json").write_text(json.dumps({"eos_token_id": [5, 6]}))
    assert Tokenizer(tmp_path / "m").eos_token_ids == {im_end, 5, 6}  # generation_config.json wins


def test_min_tokens_masks_exactly_the_eos_ids_that_stop(model_dir: Path) -> None:
    from engine.model_runner import ModelRunner

    config = EngineConfig(model=str(model_dir), device="cpu", dtype="float32", block_size=4, num_blocks=32)
    tok = Tokenizer(model_dir)
    core = EngineCore(ModelRunner(config), tok, config)
    params = SamplingParams(temperature=0.0, min_tokens=3, max_tokens=12)
    core.add_request("r", [10, 11, 12], params)
    tokens: list[int] = []
    finish = None
    while core.has_work():
        for out in core.step():
            for c in out.outputs:
                tokens += c.token_ids
                finish = c.finish_reason or finish
    # Inside min_tokens every EOS id is masked (the lowest id left is 1); then id 0 is sampled and stops.
    assert tokens == [1, 1, 1, CONFIG_EOS] and finish is FinishReason.STOP
    assert core.kv_manager.num_free_blocks == core.kv_manager.num_blocks
