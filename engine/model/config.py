"""What the model code needs from a HF `config.json`, read without transformers.

Owns how each supported architecture's config reads (`ARCHITECTURES`: what each of the Llama family (Llama,
Mistral, Qwen2, Qwen3) does differently: which projections carry a bias, whether q/k are RMS-normed per head,
which layers use a sliding window, the checkpoint's tensor names), and how RoPE is scaled. The class that runs
an architecture, and the native paths it declares, are `models.registry`'s: a new Llama-like architecture is
an entry in each. Anything we cannot reproduce exactly raises
`UnsupportedModelError` with a message that names the offending field, rather than silently computing
something different from the reference implementation.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


@dataclass(slots=True, frozen=True)
class Architecture:
    """How one architecture differs from Llama's defaults."""

    qkv_bias: bool | None = None  # None: the config's `attention_bias`
    o_bias: bool | None = None
    qk_norm: bool = False  # RMSNorm over head_dim on q and k before RoPE
    # Which layers `sliding_window` applies to: "none"; "all"; "qwen": per `layer_types`, else the layers from
    # `max_window_layers` on, and only with `use_sliding_window` or `layer_types`.
    sliding_window: str = "none"
    # Checkpoint tensor-name prefixes renamed to Llama's before loading, e.g. (("transformer.h.", "model.layers."),).
    weight_renames: tuple[tuple[str, str], ...] = ()


ARCHITECTURES: dict[str, Architecture] = {
    "LlamaForCausalLM": Architecture(),
    "MistralForCausalLM": Architecture(sliding_window="all"),
    # Qwen2 always has q/k/v biases and never an o bias, whatever `attention_bias` says.
    "Qwen2ForCausalLM": Architecture(qkv_bias=True, o_bias=False, sliding_window="qwen"),
    "Qwen3ForCausalLM": Architecture(qk_norm=True, sliding_window="qwen"),
}


class UnsupportedModelError(ValueError):
    """The checkpoint's architecture or one of its settings is outside what engine/model implements."""


@dataclass(slots=True, frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    rope_theta: float
    rope_type: str  # one of SUPPORTED_ROPE_TYPES
    rope_params: tuple[tuple[str, float], ...]  # extra scaling parameters (factor, low_freq_factor, ...)
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool  # Qwen3: RMSNorm over head_dim on q and k before RoPE
    sliding_windows: tuple[int | None, ...]  # per layer; None: full attention
    is_causal: bool
    eos_token_ids: tuple[int, ...]
    checkpoint_dtype: str | None  # "bfloat16", "float32", ... as saved; None when absent

    @property
    def rope(self) -> dict[str, float]:
        return dict(self.rope_params)

    @property
    def arch(self) -> Architecture:
        return ARCHITECTURES[self.architecture]


def load_config(model_dir: Path) -> ModelConfig:
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"{model_dir} has no config.json: not a Hugging Face model directory")
    raw = json.loads(path.read_text())
    gen_path = Path(model_dir) / "generation_config.json"
    gen = json.loads(gen_path.read_text()) if gen_path.is_file() else {}
    return parse_config(raw, gen)


def _get(raw: dict[str, Any], key: str, default: Any = None) -> Any:
    value = raw.get(key, default)
    return default if value is None else value


def parse_config(raw: dict[str, Any], generation: dict[str, Any] | None = None) -> ModelConfig:
    archs = raw.get("architectures") or []
    arch = archs[0] if archs else ""
    if arch not in ARCHITECTURES:
        raise UnsupportedModelError(
            f"unsupported architecture {arch or '(none given)'!r} (model_type {raw.get('model_type')!r}); "
            f"supported: {', '.join(ARCHITECTURES)}"
        )
    traits = ARCHITECTURES[arch]
    act = _get(raw, "hidden_act", "silu")
    if act != "silu":
        raise UnsupportedModelError(f"unsupported hidden_act {act!r}: only 'silu' is implemented")

    hidden = int(raw["hidden_size"])
    num_heads = int(raw["num_attention_heads"])
    num_kv_heads = int(_get(raw, "num_key_value_heads", num_heads))
    head_dim = int(_get(raw, "head_dim", hidden // num_heads))
    num_layers = int(raw["num_hidden_layers"])
    if num_heads % num_kv_heads:
        raise UnsupportedModelError(f"num_attention_heads {num_heads} is not a multiple of {num_kv_heads}")

    rope_theta, rope_type, rope_params = _parse_rope(raw)
    attention_bias = bool(_get(raw, "attention_bias", False))
    eos = _eos_ids(raw, generation or {})
    is_causal = bool(_get(raw, "is_causal", True)) and not bool(
        _get(raw, "use_bidirectional_attention", False)
    )
    windows = _sliding_windows(raw, traits.sliding_window, num_layers)
    if not is_causal and any(windows):
        raise UnsupportedModelError("a bidirectional (is_causal false) model with a sliding window")
    return ModelConfig(
        architecture=arch,
        vocab_size=int(raw["vocab_size"]),
        hidden_size=hidden,
        intermediate_size=int(raw["intermediate_size"]),
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        rms_norm_eps=float(_get(raw, "rms_norm_eps", 1e-6)),
        max_position_embeddings=int(_get(raw, "max_position_embeddings", 2048)),
        tie_word_embeddings=bool(_get(raw, "tie_word_embeddings", False)),
        rope_theta=rope_theta,
        rope_type=rope_type,
        rope_params=rope_params,
        qkv_bias=attention_bias if traits.qkv_bias is None else traits.qkv_bias,
        o_bias=attention_bias if traits.o_bias is None else traits.o_bias,
        mlp_bias=bool(_get(raw, "mlp_bias", False)),
        qk_norm=traits.qk_norm,
        sliding_windows=windows,
        is_causal=is_causal,
        eos_token_ids=eos,
        checkpoint_dtype=raw.get("dtype") or raw.get("torch_dtype"),
    )


def _parse_rope(raw: dict[str, Any]) -> tuple[float, str, tuple[tuple[str, float], ...]]:
    # transformers >= 5 saves `rope_parameters` (theta inside); older configs have rope_theta + rope_scaling.
    params = dict(raw.get("rope_parameters") or raw.get("rope_scaling") or {})
    if "full_attention" in params and isinstance(params["full_attention"], dict):
        params = dict(params["full_attention"])
    theta = float(params.pop("rope_theta", None) or _get(raw, "rope_theta", 10000.0))
    rope_type = params.pop("rope_type", None) or params.pop("type", None) or "default"
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise UnsupportedModelError(
            f"unsupported RoPE scaling {rope_type!r}; supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
        )
    partial = float(params.pop("partial_rotary_factor", None) or _get(raw, "partial_rotary_factor", 1.0))
    if partial != 1.0:
        raise UnsupportedModelError(f"unsupported partial_rotary_factor {partial}")
    needed = {
        "default": (),
        "linear": ("factor",),
        "llama3": ("factor", "low_freq_factor", "high_freq_factor"),
    }
    for key in needed[rope_type]:
        if key not in params:
            raise UnsupportedModelError(f"RoPE type {rope_type!r} needs {key!r} in the config")
    if rope_type == "llama3":
        params.setdefault("original_max_position_embeddings", raw.get("max_position_embeddings", 8192))
    kept = tuple(sorted((k, float(v)) for k, v in params.items() if isinstance(v, int | float)))
    return theta, rope_type, kept


def _sliding_windows(raw: dict[str, Any], rule: str, num_layers: int) -> tuple[int | None, ...]:
    window = raw.get("sliding_window")
    if rule == "all":
        return (int(window) if window else None,) * num_layers
    if rule == "qwen":
        layer_types = raw.get("layer_types")
        if not window or not (raw.get("use_sliding_window") or layer_types):
            return (None,) * num_layers
        if layer_types:
            return tuple(int(window) if t == "sliding_attention" else None for t in layer_types)
        first = int(_get(raw, "max_window_layers", num_layers))
        return tuple(int(window) if i >= first else None for i in range(num_layers))
    return (None,) * num_layers


def _eos_ids(raw: dict[str, Any], gen: dict[str, Any]) -> tuple[int, ...]:
    ids: list[int] = []
    for source in (gen.get("eos_token_id"), raw.get("eos_token_id")):
        for tok in source if isinstance(source, list) else [source]:
            if isinstance(tok, int) and tok not in ids:
                ids.append(tok)
    return tuple(ids)
