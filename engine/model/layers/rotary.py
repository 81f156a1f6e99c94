"""Rotate-half RoPE: the inverse frequencies (with linear or llama3 scaling), the cos/sin table, the rotation."""

from __future__ import annotations

import math

import torch

from engine.model.config import ModelConfig


def rope_inv_freq(cfg: ModelConfig) -> torch.Tensor:
    """[D / 2] inverse frequencies, with linear or llama3 scaling applied."""
    dim = cfg.head_dim
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    p = cfg.rope
    if cfg.rope_type == "linear":
        inv = inv / p["factor"]
    elif cfg.rope_type == "llama3":
        factor, low, high = p["factor"], p["low_freq_factor"], p["high_freq_factor"]
        old_len = p["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > old_len / low, inv / factor, inv)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
        inv = torch.where(medium, smoothed, scaled)
    return inv


class Rotary:
    """Rotate-half RoPE with a float32 cos/sin table for every position up to max_position_embeddings."""

    def __init__(self, cfg: ModelConfig) -> None:
        self.cfg = cfg
        self.cos = self.sin = torch.empty(0)

    def build(self, device: torch.device) -> None:
        # Not a buffer: the model is created on the meta device and this table is computed, not loaded.
        pos = torch.arange(self.cfg.max_position_embeddings, dtype=torch.float32)
        freqs = torch.outer(pos, rope_inv_freq(self.cfg))  # [max_pos, D / 2]
        self.cos, self.sin = freqs.cos().to(device), freqs.sin().to(device)

    def lookup(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin: [T, 1, D / 2] in `dtype` (cast before multiplying, as transformers does). Once per step."""
        cos, sin = self.cos.index_select(0, positions), self.sin.index_select(0, positions)
        return cos.to(dtype)[:, None, :], sin.to(dtype)[:, None, :]


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [T, heads, D], rotate-half layout."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
