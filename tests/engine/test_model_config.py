"""Config parsing, weight loading errors, and --device / --dtype resolution."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine.model.config import UnsupportedModelError, load_config, parse_config
from engine.model.device import cpu_has_native_bf16, resolve_device, resolve_dtype, resolve_kv_dtype
from engine.model.loading.loader import load_model

BASE = dict(
    architectures=["LlamaForCausalLM"],
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=128,
)


def test_unsupported_architecture_is_named():
    with pytest.raises(UnsupportedModelError, match="GPT2LMHeadModel.*supported: LlamaForCausalLM"):
        parse_config({**BASE, "architectures": ["GPT2LMHeadModel"]})


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "RoPE scaling 'yarn'"),
        ({"rope_scaling": {"type": "dynamic", "factor": 2.0}}, "RoPE scaling 'dynamic'"),
        ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "needs 'low_freq_factor'"),
        ({"hidden_act": "gelu"}, "hidden_act 'gelu'"),
        ({"num_key_value_heads": 3}, "not a multiple"),
    ],
)
def test_settings_we_cannot_reproduce_are_refused(change, match):
    with pytest.raises(UnsupportedModelError, match=match):
        parse_config({**BASE, **change})


def test_old_and_new_rope_formats_agree():
    old = parse_config({**BASE, "rope_theta": 5e5, "rope_scaling": {"type": "linear", "factor": 2.0}})
    new = parse_config({**BASE, "rope_parameters": {"rope_type": "linear", "rope_theta": 5e5, "factor": 2.0}})
    assert (old.rope_theta, old.rope_type, old.rope) == (new.rope_theta, new.rope_type, new.rope)
    assert new.rope == {"factor": 2.0}


def test_family_differences():
    qwen2 = parse_config({**BASE, "architectures": ["Qwen2ForCausalLM"]})
    assert (qwen2.qkv_bias, qwen2.o_bias, qwen2.qk_norm) == (True, False, False)
    qwen3 = parse_config({**BASE, "architectures": ["Qwen3ForCausalLM"], "head_dim": 32})
    assert (qwen3.qkv_bias, qwen3.qk_norm, qwen3.head_dim) == (False, True, 32)
    mistral = parse_config({**BASE, "architectures": ["MistralForCausalLM"], "sliding_window": 4096})
    assert mistral.sliding_windows == (4096, 4096)
    llama = parse_config(BASE)
    assert llama.sliding_windows == (None, None) and llama.head_dim == 16 and not llama.tie_word_embeddings


def test_qwen_sliding_window_layers():
    raw = {**BASE, "architectures": ["Qwen2ForCausalLM"], "sliding_window": 32}
    assert parse_config({**raw, "use_sliding_window": False}).sliding_windows == (None, None)
    assert parse_config({**raw, "use_sliding_window": True, "max_window_layers": 1}).sliding_windows == (
        None,
        32,
    )
    typed = {**raw, "layer_types": ["sliding_attention", "full_attention"]}
    assert parse_config(typed).sliding_windows == (32, None)


def test_non_causal_flag_and_eos_ids(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({**BASE, "is_causal": False, "eos_token_id": 2}))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [7, 2]}))
    cfg = load_config(tmp_path)
    assert cfg.is_causal is False
    assert cfg.eos_token_ids == (7, 2)
    assert parse_config(BASE).is_causal is True


def test_missing_and_unexpected_weights_are_named(tiny_model, tmp_path):
    tiny = tiny_model("qwen2")
    weights = load_file(tiny.path / "model.safetensors")
    (tmp_path / "config.json").write_text((tiny.path / "config.json").read_text())
    partial = {k: v for k, v in weights.items() if k != "model.layers.1.self_attn.k_proj.bias"}
    save_file(partial, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match=r"missing weights for 'layers.1.self_attn.qkv_proj.bias'"):
        load_model(tmp_path, torch.device("cpu"), torch.float32)
    save_file({**weights, "model.extra.weight": torch.zeros(2)}, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match="unexpected tensor 'model.extra.weight'"):
        load_model(tmp_path, torch.device("cpu"), torch.float32)
    bad = dict(weights)
    bad["model.norm.weight"] = torch.zeros(3)
    save_file(bad, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match="model.norm.weight: checkpoint shape"):
        load_model(tmp_path, torch.device("cpu"), torch.float32)


def test_loads_in_the_requested_dtype(tiny_model):
    model = load_model(tiny_model("llama").path, torch.device("cpu"), torch.bfloat16)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    # tied embeddings share the input matrix: the head (a packed copy of it here) loads no weight of its own
    assert not [name for name, _ in model.named_parameters() if name.startswith("lm_head")]


def test_resolve_device_and_dtype():
    cpu = torch.device("cpu")
    assert resolve_device("cpu") == cpu
    assert resolve_device("auto") == torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="CUDA is not available"):
            resolve_device("cuda")
    with pytest.raises(ValueError, match="unknown device"):
        resolve_device("tpu")
    assert resolve_dtype("auto", cpu) == (torch.bfloat16 if cpu_has_native_bf16() else torch.float32)
    assert resolve_dtype("bfloat16", cpu) == torch.bfloat16
    assert resolve_dtype("fp16", cpu) == torch.float16
    with pytest.raises(ValueError, match="unknown dtype"):
        resolve_dtype("int8", cpu)


def test_kv_cache_dtype_float16_is_for_float32_on_cpu_and_anything_else_a_clear_error(
    tiny_model, monkeypatch
):
    cpu = torch.device("cpu")
    assert resolve_kv_dtype("auto", torch.bfloat16, cpu) == torch.bfloat16
    assert resolve_kv_dtype("float16", torch.float32, cpu) == torch.float16
    assert resolve_kv_dtype("fp16", torch.float16, cpu) == torch.float16  # already its dtype
    with pytest.raises(ValueError, match="needs --dtype float32"):
        resolve_kv_dtype("float16", torch.bfloat16, cpu)
    with pytest.raises(ValueError, match="CPU only"):
        resolve_kv_dtype("float16", torch.float32, torch.device("cuda"))
    with pytest.raises(ValueError, match="unknown KV cache dtype 'fp8'"):
        resolve_kv_dtype("fp8", torch.float32, cpu)

    from engine.config import EngineConfig
    from engine.model_runner import ModelRunner

    path = str(tiny_model("llama").path)
    runner = ModelRunner(
        EngineConfig(model=path, device="cpu", dtype="float32", num_blocks=8, kv_cache_dtype="float16")
    )
    if runner.attention_backend != "native":
        pytest.skip(f"Brine's CPU attention is not available here ({runner.attention_backend})")
    assert runner.kv_store.pages.dtype == torch.float16 and runner.dtype == torch.float32
    monkeypatch.setenv(
        "BRINE_ATTENTION_BACKEND", "tiled"
    )  # an attention that would read the cache as float32
    with pytest.raises(ValueError, match="needs Brine's CPU attention"):
        ModelRunner(
            EngineConfig(model=path, device="cpu", dtype="float32", num_blocks=8, kv_cache_dtype="float16")
        )


@pytest.mark.cuda
def test_cuda_auto_dtype_is_bfloat16():
    assert resolve_dtype("auto", torch.device("cuda")) == torch.bfloat16
