"""The reference paged attention on `scaled_dot_product_attention`, for CPU and CUDA alike.

A request with no cached context runs causal SDPA on its new k/v directly, decode steps (one query each) are
batched by context length into one gathered SDPA, and other chunks gather their context through the block
table. Not batch-invariant (three paths that round differently): CPU's backend only with
`--no-batch-invariant` where the native kernel does not build, and the fallback of the others.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from engine.model.attention.base import AttentionMetadata
from engine.model.transfer import index_tensor, to_device


def _next_pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


@dataclass(slots=True)
class _DecodeGroup:
    token_idx: torch.Tensor  # [B] positions of the decode tokens in the flat batch
    block_table: torch.Tensor  # [B, nb] padded with block 0 (masked)
    context_lens: torch.Tensor  # [B, 1, 1, 1]
    key_pos: torch.Tensor  # [1, 1, 1, nb * block_size]
    masks: dict[int | None, torch.Tensor] = field(default_factory=dict)  # per sliding window

    def mask(self, window: int | None) -> torch.Tensor:
        if window not in self.masks:
            m = self.key_pos < self.context_lens
            if window is not None:
                m &= self.key_pos > self.context_lens - 1 - window
            self.masks[window] = m
        return self.masks[window]


@dataclass(slots=True)
class _Chunk:
    start: int
    query_len: int
    context_len: int
    blocks: torch.Tensor  # [ceil(context_len / block_size)]
    masks: dict[int | None, torch.Tensor | None] = field(default_factory=dict)


@dataclass(slots=True)
class SdpaPlan:
    fresh: list[tuple[int, int]]  # (start, query_len): no cached context, attend over the new k/v only
    decode_groups: list[_DecodeGroup]
    chunks: list[_Chunk]
    is_causal: bool


def _chunk_mask(
    query_len: int, context_len: int, window: int | None, is_causal: bool, device: torch.device
) -> torch.Tensor | None:
    """[query_len, context_len] bool, True where allowed; None when everything is allowed."""
    if not is_causal:
        return None
    q_pos = torch.arange(context_len - query_len, context_len, device=device)[:, None]
    k_pos = torch.arange(context_len, device=device)[None, :]
    allowed = k_pos <= q_pos
    if window is not None:
        allowed &= k_pos > q_pos - window
    return allowed


class SdpaBackend:
    """Reference paged attention on `scaled_dot_product_attention` (any device)."""

    name = "sdpa"
    reads_keys_from_cache = False  # the fresh prefills attend over their new k/v
    failed: str | None = None

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def plan(self, meta: AttentionMetadata) -> SdpaPlan:
        fresh: list[tuple[int, int]] = []
        decodes: dict[int, list[int]] = {}  # padded block count -> request indices
        chunks: list[_Chunk] = []
        bs = meta.block_size
        for i, (n, ctx) in enumerate(zip(meta.query_lens, meta.context_lens, strict=True)):
            start = meta.query_starts[i]
            if n == ctx:
                fresh.append((start, n))
            elif n == 1:
                # Group decodes whose contexts need a similar number of blocks: padding stays under 2x.
                decodes.setdefault(_next_pow2(-(-ctx // bs)), []).append(i)
            else:
                nb = -(-ctx // bs)
                blocks = index_tensor(meta.block_tables[i][:nb], self.device)
                chunks.append(_Chunk(start, n, ctx, blocks))
        groups = [self._decode_group(meta, rows, nb) for nb, rows in sorted(decodes.items())]
        return SdpaPlan(fresh, groups, chunks, meta.is_causal)

    def _decode_group(self, meta: AttentionMetadata, rows: list[int], nb: int) -> _DecodeGroup:
        nb = min(nb, max(len(meta.block_tables[i]) for i in rows))
        table = [(meta.block_tables[i][:nb] + [0] * nb)[:nb] for i in rows]
        # One copy: token index, context length and block table of every row side by side.
        host = torch.tensor(
            [[meta.query_starts[i], meta.context_lens[i], *t] for i, t in zip(rows, table, strict=True)],
            dtype=torch.int64,
        )
        dev = to_device(host, self.device)
        return _DecodeGroup(
            token_idx=dev[:, 0].contiguous(),
            block_table=dev[:, 2:].contiguous(),
            context_lens=dev[:, 1].view(-1, 1, 1, 1),
            key_pos=torch.arange(nb * meta.block_size, device=self.device).view(1, 1, 1, -1),
        )

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        plan: SdpaPlan,
        sliding_window: int | None,
        scale: float,
    ) -> torch.Tensor:
        out = torch.empty_like(q)
        for start, n in plan.fresh:
            out[start : start + n] = self._prefill(
                q[start : start + n],
                k[start : start + n],
                v[start : start + n],
                plan.is_causal,
                sliding_window,
                scale,
            )
        for group in plan.decode_groups:
            out.index_copy_(
                0, group.token_idx, self._decode(q, k_cache, v_cache, group, sliding_window, scale)
            )
        for chunk in plan.chunks:
            out[chunk.start : chunk.start + chunk.query_len] = self._chunk(
                q, k_cache, v_cache, chunk, plan.is_causal, sliding_window, scale
            )
        return out

    @staticmethod
    def _prefill(
        q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool, window: int | None, scale: float
    ) -> torch.Tensor:
        # 4-D [1, heads, tokens, head_dim] views: the 3-D form falls back to the slow math kernel on CPU.
        n = q.shape[0]
        mask = _chunk_mask(n, n, window, is_causal, q.device) if window is not None and window < n else None
        o = F.scaled_dot_product_attention(
            q.transpose(0, 1)[None],
            k.transpose(0, 1)[None],
            v.transpose(0, 1)[None],
            attn_mask=mask,
            is_causal=is_causal and mask is None,
            scale=scale,
            enable_gqa=True,
        )
        return o[0].transpose(0, 1)

    @staticmethod
    def _decode(
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        group: _DecodeGroup,
        window: int | None,
        scale: float,
    ) -> torch.Tensor:
        b, nb = group.block_table.shape
        _, bs, kv_heads, dim = k_cache.shape
        # One query per request: fold each kv head's query heads into the query-length axis, so SDPA
        # sees [B, kv_heads, group, dim] against [B, kv_heads, context, dim] and needs no GQA expansion.
        qg = q.index_select(0, group.token_idx).view(b, kv_heads, -1, dim)
        # index_select on whole blocks is a plain row copy: several times faster than advanced indexing.
        flat = group.block_table.view(-1)
        kc = k_cache.index_select(0, flat).view(b, nb * bs, kv_heads, dim).transpose(1, 2)
        vc = v_cache.index_select(0, flat).view(b, nb * bs, kv_heads, dim).transpose(1, 2)
        o = F.scaled_dot_product_attention(qg, kc, vc, attn_mask=group.mask(window), scale=scale)
        return o.reshape(b, -1, dim)

    @staticmethod
    def _chunk(
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        chunk: _Chunk,
        is_causal: bool,
        window: int | None,
        scale: float,
    ) -> torch.Tensor:
        _, bs, kv_heads, dim = k_cache.shape
        if window not in chunk.masks:
            chunk.masks[window] = _chunk_mask(chunk.query_len, chunk.context_len, window, is_causal, q.device)
        kc = k_cache.index_select(0, chunk.blocks).view(-1, kv_heads, dim)[: chunk.context_len]
        vc = v_cache.index_select(0, chunk.blocks).view(-1, kv_heads, dim)[: chunk.context_len]
        qc = q[chunk.start : chunk.start + chunk.query_len]
        o = F.scaled_dot_product_attention(
            qc.transpose(0, 1)[None],
            kc.transpose(0, 1)[None],
            vc.transpose(0, 1)[None],
            attn_mask=chunk.masks[window],
            scale=scale,
            enable_gqa=True,
        )
        return o[0].transpose(0, 1)
