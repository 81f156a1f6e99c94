"""Build the registered model class (`models.registry`) from a local Hugging Face directory (config.json +
*.safetensors), its linears in the fastest weight format the CPU runs: a GGUF's blocks as stored (`quantize`,
where the architecture declares it), else weights packed for oneDNN (`layers.linear`). Which format each
linear gets is decided from the files before the model is built (`layers.linear_plan.LinearPlan`), and the
model applies it itself once its weights are loaded (`LlamaForCausalLM.finish_loading`).

Parameters are created on the meta device and filled straight from the safetensors files in the target
dtype, so loading never runs random initialisation and never holds two copies of the weights. The HF names
are mapped onto our fused layout (q/k/v -> qkv_proj, gate/up -> gate_up_proj). Loading is strict: a missing
tensor, an unexpected one, or a shape mismatch raises with the tensor's name.
"""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path

import torch
from safetensors import safe_open

from engine.model.config import ModelConfig, load_config
from engine.model.kernels.build import Kernels
from engine.model.kernels.build import load as load_kernels
from engine.model.kernels.invariance import NotInvariantError
from engine.model.layers.linear import packing_supported
from engine.model.layers.linear_plan import LinearPlan, QuantParts
from engine.model.loading.quantize import quantizable_gguf, quantized_parts
from engine.model.models import registry
from engine.model.models.llama import LlamaForCausalLM, TiedHead

logger = logging.getLogger(__name__)

_LAYER_RE = re.compile(r"model\.layers\.(\d+)\.(.+)")
# HF suffix -> (our suffix, index of the shard in the fused parameter)
_FUSED = {
    "self_attn.q_proj": ("self_attn.qkv_proj", 0),
    "self_attn.k_proj": ("self_attn.qkv_proj", 1),
    "self_attn.v_proj": ("self_attn.qkv_proj", 2),
    "mlp.gate_proj": ("mlp.gate_up_proj", 0),
    "mlp.up_proj": ("mlp.gate_up_proj", 1),
}


def safetensors_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [model_dir / n for n in names]
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{model_dir} has no *.safetensors weights")
    return files


def _target(name: str, cfg: ModelConfig) -> tuple[str, int | None] | None:
    """Our parameter name and fused shard index for a checkpoint tensor; None to skip it."""
    for theirs, llamas in cfg.arch.weight_renames:
        if name.startswith(theirs):
            name = llamas + name.removeprefix(theirs)
            break
    if name == "lm_head.weight" and cfg.tie_word_embeddings:
        return None  # some tied checkpoints still store the copy
    if name.endswith("rotary_emb.inv_freq"):
        return None
    if name.startswith("model.") and not name.startswith("model.layers."):
        return name.removeprefix("model."), None
    m = _LAYER_RE.fullmatch(name)
    if m:
        layer, rest = m.groups()
        module, _, kind = rest.rpartition(".")
        if module in _FUSED:
            fused, shard = _FUSED[module]
            return f"layers.{layer}.{fused}.{kind}", shard
        return f"layers.{layer}.{rest}", None
    return name, None


def _fused_module(ours: str) -> str | None:
    """'layers.3.self_attn.qkv_proj.bias' -> 'self_attn.qkv_proj'; None for unfused parameters."""
    module = ours.split(".", 2)[-1].rsplit(".", 1)[0]
    return module if module in ("self_attn.qkv_proj", "mlp.gate_up_proj") else None


def empty_model(
    model_dir: Path,
    cfg: ModelConfig,
    device: torch.device,
    dtype: torch.dtype,
    pack: bool,
    batch_invariant: bool,
    quantized: bool,
    quantize_activations: str = "none",
) -> tuple[LlamaForCausalLM, LinearPlan]:
    """The registry's model for `cfg`, built on the meta device with its linear plan and then given
    uninitialised storage on `device`, and that plan: the caller fills every weight, then calls
    `finish_loading`."""
    spec = registry.lookup(cfg.architecture)
    plan = linear_plan(
        model_dir,
        cfg,
        spec.capabilities.quantized_linears,
        device,
        dtype,
        pack=pack,
        batch_invariant=batch_invariant,
        quantized=quantized,
        quantize_activations=quantize_activations,
    )
    with torch.device("meta"):
        model = spec.model_class(cfg, spec.capabilities, plan)
    return model.to(dtype=dtype).to_empty(device=device), plan


def load_model(
    model_dir: Path | str,
    device: torch.device,
    dtype: torch.dtype,
    pack: bool = True,
    batch_invariant: bool = True,
    quantized: bool = True,
    quantize_activations: str = "none",
) -> LlamaForCausalLM:
    """`pack`: on CPU, pack the linear weights for oneDNN (see layers.linear). `batch_invariant`: pad each
    linear's rows as this machine's probe says (see kernels.invariance). `quantized`: a model converted from a
    GGUF runs the file's quantized linears as stored, where the CPU can and the architecture declares
    `quantized_linears` (see loading.quantize); the other linears are packed. `quantize_activations`:
    "q8" makes those linears, but the output head, quantize their inputs to Q8 per block (csrc/quant_q8.h);
    "auto" does where the kernels' tier measured faster with it (Q8_AUTO_TIERS); "none" never."""
    model_dir = Path(model_dir)
    cfg = load_config(model_dir)
    model, plan = empty_model(
        model_dir, cfg, device, dtype, pack, batch_invariant, quantized, quantize_activations
    )
    params = dict(model.named_parameters())
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    shard_sizes = {"self_attn.qkv_proj": [q, kv, kv], "mlp.gate_up_proj": [cfg.intermediate_size] * 2}
    filled: dict[str, int] = {}  # parameter -> shards loaded
    for path in safetensors_files(model_dir):
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not a dict
                target = _target(name, cfg)
                if target is None:
                    continue
                ours, shard = target
                if ours not in params:
                    raise ValueError(f"unexpected tensor {name!r} in {path.name} for {cfg.architecture}")
                param, tensor = params[ours], f.get_tensor(name)
                dest = param.data
                if shard is not None and (module := _fused_module(ours)) is not None:
                    sizes = shard_sizes[module]
                    dest = dest.narrow(0, sum(sizes[:shard]), sizes[shard])
                if dest.shape != tensor.shape:
                    raise ValueError(
                        f"{name}: checkpoint shape {tuple(tensor.shape)}, expected {tuple(dest.shape)}"
                    )
                dest.copy_(tensor.to(dtype))
                filled[ours] = filled.get(ours, 0) + 1
    for ours in params:
        fused = _fused_module(ours)
        if filled.get(ours, 0) != (len(shard_sizes[fused]) if fused else 1):
            raise ValueError(f"checkpoint in {model_dir} is missing weights for {ours!r}")
    model.finish_loading(device)
    if pack and batch_invariant and not plan.pack and device.type == "cpu" and _dense_linears(model):
        # Plain torch linears round a row by what shares its product: never silently (DESIGN.md).
        raise NotInvariantError(
            f"dtype {str(dtype).removeprefix('torch.')}: this CPU and torch build run its dense linears only "
            "as plain torch matmuls, whose rows round by the batch they share, so Brine cannot promise the "
            "same answer alone or batched; use --dtype float32 (or auto), or --no-batch-invariant"
        )
    return model


# The kernel tiers where `--quantize-activations auto` turns Q8 activations on: those it made faster, prefill and
# decode (docs/benchmarks.md#q8-activations). Not AVX512-BF16, whose bfloat16 dot products are nearly as fast
# (1.08x), nor the portable build, whose plain integer loops are no faster than its float ones (0.5-1.1x).
Q8_AUTO_TIERS = frozenset({"avx512-vnni", "avx512", "avx2"})


def linear_plan(
    model_dir: Path,
    cfg: ModelConfig,
    declares_quantized: bool,
    device: torch.device,
    dtype: torch.dtype,
    *,
    pack: bool,
    batch_invariant: bool,
    quantized: bool,
    quantize_activations: str = "none",
) -> LinearPlan:
    """How each linear will run, from the files and this machine, before the model is built (load_model's
    arguments say what is asked for). A tied head gets its own packed copy of the embedding matrix."""
    parts: dict[str, QuantParts] = {}
    kernels: Kernels | None = None
    if quantized and not declares_quantized:
        logger.info("%s declares no quantized linears: its GGUF weights run dequantized", cfg.architecture)
    elif quantized and (gguf := quantizable_gguf(model_dir, device, dtype)) is not None:
        kernels, _ = load_kernels()
        assert kernels is not None
        parts = quantized_parts(gguf, cfg)
    if quantize_activations not in ("auto", "none", "q8"):
        raise ValueError(f"quantize_activations must be auto, none or q8, got {quantize_activations!r}")
    q8 = quantize_activations == "q8" or (
        quantize_activations == "auto"
        and kernels is not None
        and bool(parts)
        and kernels.tier in Q8_AUTO_TIERS
    )
    if quantize_activations == "q8" and not parts:
        raise ValueError(
            "--quantize-activations q8 applies to the linears that run a GGUF's weights as stored: this model "
            f"has none here (a GGUF model on the CPU, with --quantization auto; {cfg.architecture}, {device})"
        )
    return LinearPlan(
        parts,
        kernels,
        pack=pack and packing_supported(device, dtype),
        probe=batch_invariant,
        q8_activations=q8,
    )


def _dense_linears(model: LlamaForCausalLM) -> bool:
    """Whether any linear (or a tied head without its own copy) still runs as a plain torch matmul."""
    return isinstance(model.lm_head, TiedHead) or any(isinstance(m, torch.nn.Linear) for m in model.modules())
