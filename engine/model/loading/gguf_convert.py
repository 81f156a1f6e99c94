"""One-time conversion of a llama-architecture GGUF file into a Hugging Face-format directory.

The weights are dequantized to float32 safetensors (dequantized Q4/Q8 values are not exactly representable in
16 bits, and both our model and `transformers` must read the very same numbers), the config comes from the GGUF
metadata, and the tokenizer (with its chat template) from transformers' GGUF tokenizer conversion.

llama.cpp's converter permutes the rows of the Q and K projections (interleaved rotary pairs); we undo that so the
result uses the Hugging Face layout (rotate-half rotary).
"""

from __future__ import annotations

import hashlib
import json
import shutil
import tempfile
from pathlib import Path

from engine.errors import ModelNotFoundError

# Bump when the conversion output changes so stale caches are rebuilt.
CONVERTER_VERSION = 1

_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}


def converted_dir_for(gguf_path: Path, cache: Path) -> Path:
    """A cache key that is cheap to compute (no read of the whole file) yet changes when the file does."""
    st = gguf_path.stat()
    key = f"{gguf_path.resolve()}|{st.st_size}|{st.st_mtime_ns}|v{CONVERTER_VERSION}"
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    return cache / f"{gguf_path.stem.lower()}-{digest}"


def gguf_source(model_dir: Path) -> Path | None:
    """The GGUF file a converted directory was made from (its `complete` marker names it), if still there."""
    try:
        source = Path((model_dir / "complete").read_text().strip())
    except OSError:
        return None
    return source if source.suffix == ".gguf" and source.is_file() else None


def hf_tensor_name(gguf_name: str) -> str | None:
    base, _, suffix = gguf_name.rpartition(".")  # suffix: weight / bias
    if base in _GLOBAL_NAMES:
        return f"{_GLOBAL_NAMES[base]}.{suffix}"
    parts = base.split(".")
    if len(parts) == 3 and parts[0] == "blk" and parts[2] in _LAYER_NAMES:
        return f"model.layers.{parts[1]}.{_LAYER_NAMES[parts[2]]}.{suffix}"
    return None  # e.g. rope_freqs: refused by _rope_scaling, never silently dropped


def unpermute_rotary(weight, num_heads: int):
    """Inverse of llama.cpp's `permute` for Q/K projection rows: [out, in] -> [out, in]."""
    out = weight.shape[0]
    rest = weight.shape[1:]
    # llama.cpp grouped rows as (head, 2, half) -> (head, half, 2); swap them back.
    return weight.reshape(num_heads, out // num_heads // 2, 2, *rest).swapaxes(1, 2).reshape(weight.shape)


def _field(reader, key: str, default=None):
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def _rope_scaling(reader, prefix: str, tensor_names: set[str]) -> dict | None:
    """The config's rope_scaling for the GGUF's RoPE settings; refuses what we would silently get wrong."""
    if "rope_freqs.weight" in tensor_names:
        # Llama 3.1-style scaling is stored as per-frequency factors, not as the parameters that made them.
        raise ModelNotFoundError(
            "this GGUF scales RoPE with per-frequency factors (rope_freqs, as Llama 3.1 does), which cannot be "
            "mapped back to a config; pass the model's Hugging Face directory instead"
        )
    kind = _field(reader, prefix + "rope.scaling.type")
    if kind in (None, "none"):
        return None
    if kind == "linear":
        return {"rope_type": "linear", "factor": float(_field(reader, prefix + "rope.scaling.factor"))}
    raise ModelNotFoundError(f"GGUF RoPE scaling {kind!r} is not supported (supported: none, linear)")


def _config(reader, tensor_names: set[str]) -> dict:
    arch = _field(reader, "general.architecture")
    if arch != "llama":
        raise ModelNotFoundError(f"GGUF architecture '{arch}' is not supported (supported: llama)")
    p = f"{arch}."
    num_heads = int(_field(reader, p + "attention.head_count"))
    hidden = int(_field(reader, p + "embedding_length"))
    vocab = _field(reader, p + "vocab_size") or len(reader.fields["tokenizer.ggml.tokens"].data)
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": hidden,
        "intermediate_size": int(_field(reader, p + "feed_forward_length")),
        "num_hidden_layers": int(_field(reader, p + "block_count")),
        "num_attention_heads": num_heads,
        "num_key_value_heads": int(_field(reader, p + "attention.head_count_kv", num_heads)),
        "head_dim": int(_field(reader, p + "rope.dimension_count", hidden // num_heads)),
        "max_position_embeddings": int(_field(reader, p + "context_length")),
        "rms_norm_eps": float(_field(reader, p + "attention.layer_norm_rms_epsilon")),
        "rope_theta": float(_field(reader, p + "rope.freq_base", 10000.0)),
        "rope_scaling": _rope_scaling(reader, p, tensor_names),
        "vocab_size": int(vocab),
        "hidden_act": "silu",
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "attention_bias": False,
        "mlp_bias": False,
        "bos_token_id": _field(reader, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": _field(reader, "tokenizer.ggml.eos_token_id"),
        "torch_dtype": "float32",
    }
    return config


def convert_gguf(gguf_path: Path, target: Path) -> Path:
    """Dequantize `gguf_path` into `target` (written atomically: a half-written cache is never used)."""
    import gguf
    import numpy as np
    from safetensors.numpy import save_file
    from tqdm import tqdm

    reader = gguf.GGUFReader(str(gguf_path))
    names = {t.name for t in reader.tensors}
    config = _config(reader, names)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=target.name + ".tmp-", dir=target.parent))
    try:
        tensors: dict[str, np.ndarray] = {}
        for t in tqdm(reader.tensors, desc=f"dequantizing {gguf_path.name}", unit="tensor"):
            name = hf_tensor_name(t.name)
            if name is None:
                continue
            array = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32)
            array = array.reshape([int(d) for d in reversed(t.shape)])  # GGML dims are innermost-first
            if t.name.endswith("attn_q.weight"):
                array = unpermute_rotary(array, config["num_attention_heads"])
            elif t.name.endswith("attn_k.weight"):
                array = unpermute_rotary(array, config["num_key_value_heads"])
            tensors[name] = np.ascontiguousarray(array)
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        (tmp / "config.json").write_text(json.dumps(config, indent=2))
        generation = {"bos_token_id": config["bos_token_id"], "eos_token_id": config["eos_token_id"]}
        (tmp / "generation_config.json").write_text(json.dumps(generation, indent=2))
        _save_tokenizer(gguf_path, tmp)
        (tmp / "complete").write_text(str(gguf_path.resolve()))
        if target.exists():
            shutil.rmtree(target)
        tmp.rename(target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return target


def _save_tokenizer(gguf_path: Path, out: Path) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    tokenizer.save_pretrained(str(out))
