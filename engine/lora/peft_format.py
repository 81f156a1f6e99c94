"""One LoRA adapter in PEFT's file layout, read and checked against the base model.

A PEFT adapter directory holds `adapter_config.json` (rank `r`, `lora_alpha`, `target_modules`, ...) and
`adapter_model.safetensors`, whose tensors are named
`base_model.model.model.layers.{i}.{self_attn|mlp}.{q_proj|...}.lora_A.weight` ([r, in]) and `.lora_B.weight`
([out, r]). The delta of a target is `scaling * x A^T B^T`, `scaling = lora_alpha / r` (`lora_alpha / sqrt(r)`
with `use_rslora`).

What Brine cannot run exactly is refused with the reason instead of being approximated: DoRA, trained biases,
`modules_to_save`, per-module rank or alpha patterns, targets outside the decoder layers' seven linears
(embeddings, the output head). A refusal is a `LoRAError`, which the server turns into a 400.

The fingerprint is the SHA-256 of both files' bytes: it goes into the cache key beside the adapter's name, so
an adapter reloaded with other weights under the same name never reuses the KV computed with the old ones.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
# The decoder layers' linears, by their Hugging Face names (q/k/v and gate/up are fused in Brine's model).
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_KEY = re.compile(
    r"(?:base_model\.model\.)?model\.layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])(?:\.\w+)?\.weight"
)


class LoRAError(ValueError):
    """The adapter cannot be loaded; the message says why (never echoes tensor contents). `param`: the load
    request's field to blame (the path's files unless said otherwise)."""

    def __init__(self, message: str, param: str | None = "lora_path") -> None:
        super().__init__(message)
        self.param = param


@dataclass(slots=True)
class TargetShape:
    """What a target's delta must map: in_features -> out_features."""

    in_features: int
    out_features: int


@dataclass(slots=True)
class PeftAdapter:
    """An adapter's weights, checked: (layer, target) -> (A [r, in], B * scaling [out, r]), both float32."""

    path: str
    fingerprint: str
    rank: int
    scaling: float
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]


def fingerprint(config: bytes, weights: bytes) -> str:
    """SHA-256 over both files' bytes (each with its name and length, so no split of the bytes collides)."""
    digest = hashlib.sha256()
    for name, data in ((CONFIG_FILE, config), (WEIGHTS_FILE, weights)):
        digest.update(name.encode() + len(data).to_bytes(8, "little") + data)
    return digest.hexdigest()


def _read(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except OSError as exc:
        raise LoRAError(
            f"cannot read {path.name} in the adapter directory: {exc.__class__.__name__}"
        ) from None


def _config(raw: bytes) -> dict:
    try:
        config = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise LoRAError(
            f"cannot read {CONFIG_FILE} in the adapter directory: {exc.__class__.__name__}"
        ) from None
    except json.JSONDecodeError as exc:
        raise LoRAError(f"{CONFIG_FILE} is not valid JSON ({exc.msg}, line {exc.lineno})") from None
    if not isinstance(config, dict):
        raise LoRAError(f"{CONFIG_FILE} must hold a JSON object")
    if config.get("peft_type", "LORA") != "LORA":
        raise LoRAError(f"only LoRA adapters are supported, not peft_type {config.get('peft_type')!r}")
    for key, why in (
        ("use_dora", "DoRA"),
        ("modules_to_save", "modules_to_save"),
        ("rank_pattern", "per-module ranks (rank_pattern)"),
        ("alpha_pattern", "per-module alphas (alpha_pattern)"),
        ("fan_in_fan_out", "fan_in_fan_out weights"),
    ):
        if config.get(key):
            raise LoRAError(f"{why} is not supported")
    if config.get("bias", "none") != "none":
        raise LoRAError("adapters that train biases (bias != 'none') are not supported")
    r, alpha = config.get("r"), config.get("lora_alpha", config.get("r"))
    if not isinstance(r, int) or isinstance(r, bool) or r < 1:
        raise LoRAError(f"{CONFIG_FILE}: r must be a positive integer")
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool) or not math.isfinite(alpha):
        raise LoRAError(f"{CONFIG_FILE}: lora_alpha must be a number")
    return config


def load_peft(path: str, shapes: dict[str, TargetShape], num_layers: int, max_rank: int) -> PeftAdapter:
    """Reads and checks the adapter at `path` against the base model's `shapes` (by target name)."""
    from safetensors import SafetensorError
    from safetensors.torch import load

    directory = Path(path)
    if not directory.is_dir():
        raise LoRAError("the adapter path is not a directory")
    if not (directory / WEIGHTS_FILE).is_file():
        raise LoRAError(f"the adapter directory has no {WEIGHTS_FILE}")
    # Each file is read once: the fingerprint is of the very bytes the weights come from.
    raw_config, raw_weights = _read(directory / CONFIG_FILE), _read(directory / WEIGHTS_FILE)
    config = _config(raw_config)
    rank = int(config["r"])
    if rank > max_rank:
        raise LoRAError(f"the adapter's rank {rank} is above --max-lora-rank {max_rank}")
    scaling = float(config["lora_alpha"]) / (math.sqrt(rank) if config.get("use_rslora") else rank)
    try:
        tensors = load(raw_weights)
    except (SafetensorError, OSError, ValueError) as exc:
        raise LoRAError(f"cannot read {WEIGHTS_FILE}: {exc.__class__.__name__}") from None
    halves: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        m = _KEY.fullmatch(key)
        if m is None:
            raise LoRAError(f"{WEIGHTS_FILE}: tensor {key[:200]!r} is not a decoder-layer LoRA weight")
        layer, target, half = int(m.group(1)), m.group(2), m.group(3)
        if target not in shapes:
            raise LoRAError(f"{WEIGHTS_FILE}: target {target[:100]!r} is not one of {', '.join(TARGETS)}")
        if layer >= num_layers:
            raise LoRAError(f"{WEIGHTS_FILE}: layer {layer} is past the model's {num_layers} layers")
        halves.setdefault((layer, target), {})[half] = tensor
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = {}
    for (layer, target), pair in sorted(halves.items()):
        if set(pair) != {"A", "B"}:
            raise LoRAError(f"layer {layer} {target}: needs both lora_A and lora_B")
        a, b = pair["A"], pair["B"]
        shape = shapes[target]
        if tuple(a.shape) != (rank, shape.in_features) or tuple(b.shape) != (shape.out_features, rank):
            raise LoRAError(
                f"layer {layer} {target}: lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)} do not fit "
                f"rank {rank} and the model's {shape.in_features} -> {shape.out_features}"
            )
        if not (a.is_floating_point() and b.is_floating_point()):
            raise LoRAError(f"layer {layer} {target}: weights must be floating point")
        a64, b64 = a.double(), b.double() * scaling  # the scaling folded into B once, in float64
        if not (torch.isfinite(a64).all() and torch.isfinite(b64).all()):
            raise LoRAError(f"layer {layer} {target}: weights must be finite")
        weights[(layer, target)] = (a64.float().contiguous(), b64.float().contiguous())
    if not weights:
        raise LoRAError("the adapter has no LoRA weights")
    return PeftAdapter(str(directory), fingerprint(raw_config, raw_weights), rank, scaling, weights)
