"""Batch-invariant paged attention, the CPU default: one path for prefill, chunks after a prefix hit, and decodes.

Every query row attends over its request's cache in fixed tiles of `KV_TILE` key positions, counted from
position 0, whatever the query count, the batch, the padding or how the prompt was chunked:

    scores   S_t = (q * scale) . K_t^T       one [M, D] x [D, KV_TILE] product per tile (float32)
    max      m   = max over every visible score of the row (exact: max does not round)
    weights  P_t = exp(S_t - m), masked keys give exactly 0
    sums     l_t = sum_k P_t,  O_t = P_t @ V_t   (a [M, KV_TILE] x [KV_TILE, D] product per tile)
    output   sum_t O_t / sum_t l_t,  the sums over t a fixed pairwise tree on the tile index

The row's own tiles sit at the same tree positions in every batch, and the tiles a batch adds past them
(another request's longer context, a later query of the same chunk) are exact zeros, which leave a pairwise
tree's result unchanged: so a row's bits depend only on its own query and context. The products' row counts
still change with the batch; they are padded to the multiple that `invariance.row_multiple` measured for this
CPU's matmul. (SDPA, the previous default, ran three differently-rounding paths and is kept for
`--no-batch-invariant`.)

Longer chunks are cut into slices of `QUERY_SLICE` tokens, which bounds the float32 score buffer. Slices (of
any requests) with the same query count and tile count share one product; decodes share one per power of two
of their tile count (padding stays under 2x). None of this changes any result.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from engine.model.attention.base import AttentionMetadata
from engine.model.kernels.invariance import row_multiple
from engine.model.transfer import index_tensor, to_device

KV_TILE = 64  # key positions per tile; part of the numerics (changing it changes results, not invariance)
QUERY_SLICE = 64  # query tokens per item of a long chunk: keeps each item's scores small; results unchanged


def tree_sum(x: torch.Tensor, dim: int) -> torch.Tensor:
    """Sum over `dim` in a fixed pairwise order: as if padded with zeros to a power of two P, then halved
    (element i + element i + P/2) until one is left. Trailing zeros never change the result."""
    n = x.shape[dim]
    while n > 1:
        half = 1 << ((n - 1).bit_length() - 1)  # P / 2 for the next power of two P >= n
        head = x.narrow(dim, 0, half).clone()
        head.narrow(dim, 0, n - half).add_(x.narrow(dim, half, n - half))
        x, n = head, half
    return x.squeeze(dim)


def scores(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """q: [BH, 1, M, D], k: [BH, T, KV_TILE, D] float32 -> [BH, T, M, KV_TILE]."""
    return torch.matmul(q, k.transpose(-1, -2))


def weighted(p: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """p: [BH, T, M, KV_TILE], v: [BH, T, KV_TILE, D] float32 -> [BH, T, M, D]."""
    return torch.matmul(p, v)


@functools.cache
def attention_row_multiple(head_dim: int) -> int:
    """Row multiple that makes both attention products batch-invariant on this machine (float32)."""
    g = torch.Generator().manual_seed(0)
    k = torch.randn(1, 2, KV_TILE, head_dim, generator=g)
    v = torch.randn(1, 2, KV_TILE, head_dim, generator=g)
    rows = 308

    def qk(x: torch.Tensor) -> torch.Tensor:  # [M, D] -> [M, 2, KV_TILE]
        return scores(x[None, None], k)[0].transpose(0, 1)

    def pv(x: torch.Tensor) -> torch.Tensor:  # [M, 2 * KV_TILE] -> [M, 2, D]
        return weighted(x.view(-1, 2, KV_TILE).transpose(0, 1)[None], v)[0].transpose(0, 1)

    return max(
        row_multiple(qk, torch.randn(rows, head_dim, generator=g), f"attention scores, head_dim {head_dim}"),
        row_multiple(
            pv, torch.rand(rows, 2 * KV_TILE, generator=g), f"attention values, head_dim {head_dim}"
        ),
    )


@dataclass(slots=True)
class _Unit:
    """Query rows that attend in one product: B requests with n query tokens each, over T key tiles."""

    token_idx: torch.Tensor  # [B * n] flat batch index of each query token
    blocks: torch.Tensor  # [B, ceil(T * KV_TILE / block_size)] block ids, padded with block 0 (masked)
    num_tiles: int
    n: int
    q0: list[int]  # per request: position of its first query (the others follow it)
    ctx: list[int]  # per request: context length
    # window -> (first tile with a hidden key, [B, 1, T - that tile, Mp, KV_TILE] bool, True where hidden):
    # tiles before it are visible to every row, so masking skips them (it would change nothing there).
    masks: dict[int | None, tuple[int, torch.Tensor]] = field(default_factory=dict)


@dataclass(slots=True)
class TiledPlan:
    units: list[_Unit]
    is_causal: bool


class TiledBackend:
    """Batch-invariant paged attention (see the module docstring). Works on any device; CPU's default."""

    name = "tiled"
    # It reads only the caches too, but it runs where the kernels do not build, so the fused write never
    # applies: not declared, the model writes with torch, as the tiled numerics were checked.
    reads_keys_from_cache = False
    failed: str | None = None

    def __init__(self, device: torch.device, head_dim: int | None = None) -> None:
        self.device = device
        self.row_multiple = attention_row_multiple(head_dim) if head_dim else 16

    def plan(self, meta: AttentionMetadata) -> TiledPlan:
        # Items: a decode, or a slice of up to QUERY_SLICE queries of one request. Items with as many queries
        # and a similar tile count run as one product: decodes by the tile count's power of two (few ops per
        # layer, padding < 2x), slices by the exact count (their padding would cost more than the ops saved).
        groups: dict[tuple[int, int], list[tuple[int, int, int, int]]] = {}  # -> (request, start, q0, keys)
        for i, (n, ctx) in enumerate(zip(meta.query_lens, meta.context_lens, strict=True)):
            first, start = ctx - n, meta.query_starts[i]
            for a in range(0, n, QUERY_SLICE):
                b = min(n, a + QUERY_SLICE)
                keys = first + b if meta.is_causal else ctx  # keys the slice may see: [0, keys)
                tiles = -(-keys // KV_TILE)
                bucket = 1 << (tiles - 1).bit_length() if b - a == 1 else tiles
                groups.setdefault((b - a, bucket), []).append((i, start + a, first + a, keys))
        units = [self._unit(meta, items, n) for (n, _), items in sorted(groups.items())]
        return TiledPlan(units, meta.is_causal)

    def _unit(self, meta: AttentionMetadata, items: list[tuple[int, int, int, int]], n: int) -> _Unit:
        reqs = [i for i, _, _, _ in items]
        token_idx = [t for _, start, _, _ in items for t in range(start, start + n)]
        q0 = [q for _, _, q, _ in items]
        tiles = -(-max(k for *_, k in items) // KV_TILE)
        bs = meta.block_size
        nb = -(-(tiles * KV_TILE) // bs)
        table = [(meta.block_tables[i][:nb] + [0] * nb)[:nb] for i in reqs]
        blocks = index_tensor([b for t in table for b in t], self.device).view(len(reqs), nb)
        ctx = [meta.context_lens[i] for i in reqs]
        return _Unit(index_tensor(token_idx, self.device), blocks, tiles, n, q0, ctx)

    def _mask(self, unit: _Unit, group: int, window: int | None, is_causal: bool) -> tuple[int, torch.Tensor]:
        """(t0, [B, 1, T - t0, Mp, KV_TILE] bool): True where a row may not see a key, from tile t0 on. Rows
        are (token, head in group); every key before tile t0 is visible to every row."""
        if window not in unit.masks:
            # Planned from host ints (never by reading a tensor back: on CUDA that would wait for the GPU).
            if window is not None and max(unit.q0) + unit.n - 1 - window >= 0:
                t0 = 0  # some row's window starts past key 0
            elif is_causal:
                t0 = (min(unit.q0) + 1) // KV_TILE  # the earliest query sees every key of the tiles before
            else:
                t0 = min(unit.ctx) // KV_TILE
            t0 = min(t0, unit.num_tiles)
            # [1, 1, keys from tile t0 on]
            k_pos = torch.arange(t0 * KV_TILE, unit.num_tiles * KV_TILE).view(1, 1, -1)
            q_pos = (torch.tensor(unit.q0)[:, None] + torch.arange(unit.n)[None, :])[:, :, None]  # [B, n, 1]
            if is_causal:
                hidden = k_pos > q_pos
            else:
                hidden = (k_pos >= torch.tensor(unit.ctx)[:, None, None]).expand(-1, unit.n, -1)
            if window is not None:
                hidden = hidden | (k_pos <= q_pos - window)
            b = hidden.shape[0]
            rows = hidden[:, :, None, :].expand(-1, -1, group, -1).reshape(b, unit.n * group, -1)
            # Pad rows repeat the last real row's mask, so they stay finite; their outputs are dropped.
            pad = -(unit.n * group) % self.row_multiple
            rows = torch.cat([rows, rows[:, -1:].expand(-1, pad, -1)], dim=1)  # [B, Mp, keys from t0]
            tiled = rows.view(b, rows.shape[1], unit.num_tiles - t0, KV_TILE).transpose(1, 2).contiguous()
            unit.masks[window] = (t0, to_device(tiled, self.device)[:, None])
        return unit.masks[window]

    def forward(
        self,
        q: torch.Tensor,  # [num_tokens, H, D]
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
        v_cache: torch.Tensor,
        plan: TiledPlan,
        sliding_window: int | None,
        scale: float,
    ) -> torch.Tensor:
        out = torch.empty_like(q)
        for unit in plan.units:
            o = self._attend(q, k_cache, v_cache, unit, plan.is_causal, sliding_window, scale)
            out.index_copy_(0, unit.token_idx, o.to(out.dtype))
        return out

    def _attend(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        unit: _Unit,
        is_causal: bool,
        window: int | None,
        scale: float,
    ) -> torch.Tensor:  # [B * n, H, D] float32
        _, _, hkv, d = k_cache.shape
        h = q.shape[1]
        group, (b, nb), t, n = h // hkv, unit.blocks.shape, unit.num_tiles, unit.n
        # Queries: [B, n, Hkv, g, D] -> rows (token, head in group) per kv head, padded: [B * Hkv, 1, Mp, D]
        qu = q.index_select(0, unit.token_idx).view(b, n, hkv, group, d).permute(0, 2, 1, 3, 4)
        # The scale is applied to q (a few rows) rather than to the scores (many): the same for every row.
        qu = qu.reshape(b * hkv, n * group, d).float().mul_(scale)
        m_rows = n * group
        qu = F.pad(qu, (0, 0, 0, -m_rows % self.row_multiple))
        mp = qu.shape[1]
        # Keys and values of the first T * KV_TILE positions: [B * Hkv, T, KV_TILE, D]
        flat = unit.blocks.view(-1)

        def tiles(cache: torch.Tensor) -> torch.Tensor:
            x = cache.index_select(0, flat).view(b, nb * cache.shape[1], hkv, d)[:, : t * KV_TILE]
            # One pass from the gathered blocks to per-head float32 tiles (`.float().reshape()` of the
            # permuted view made two: the cast kept the permuted strides, so the reshape copied again).
            out = torch.empty((b, hkv, t, KV_TILE, d), dtype=torch.float32, device=cache.device)
            out.copy_(x.view(b, t, KV_TILE, hkv, d).permute(0, 3, 1, 2, 4))
            return out.view(b * hkv, t, KV_TILE, d)

        s = scores(qu[:, None], tiles(k_cache))  # [B * Hkv, T, Mp, KV_TILE]
        t0, blocked = self._mask(unit, group, window, is_causal)
        if t0 < t:
            s.view(b, hkv, t, mp, KV_TILE)[:, :, t0:].masked_fill_(blocked, -torch.inf)
        m = s.amax(dim=3).amax(dim=1)  # [B * Hkv, Mp]
        p = s.sub_(m[:, None, :, None]).exp_()
        o = tree_sum(weighted(p, tiles(v_cache)), 1)  # [B * Hkv, Mp, D]
        o = o / tree_sum(p.sum(-1), 1)[..., None]
        o = o[:, :m_rows].reshape(b, hkv, n, group, d).permute(0, 2, 1, 3, 4)
        return o.reshape(b * n, h, d)
