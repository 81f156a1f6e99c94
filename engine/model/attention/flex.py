"""Paged attention on FlexAttention: reads K/V in place through a block-sparse mask (the CUDA path).

Requests with no cached context run causal SDPA on their new k/v (flash kernels, nothing to gather). All other
requests (decodes, chunks after a prefix hit or an earlier chunk) go through one `flex_attention` call over the
whole KV cache viewed as a single sequence of `num_blocks * block_size` slots:

- Each such request's queries are padded to a multiple of `Q_BLOCK` rows, so every query tile belongs to one
  request. A tile lists exactly the cache blocks it may see: blocks entirely visible to every row of the tile
  go to `full_kv_indices` (no mask evaluated), the diagonal / window-edge / last blocks to `kv_indices`.
  Nothing outside the request's block table is ever read, and nothing is copied.
- `mask_mod` needs a slot's position in its sequence. A cached block always sits at the same logical index in
  every request that uses it (block hashes chain from block 0), so a single `block_pos[num_blocks]` table
  (physical block -> logical block index), refreshed for this step's partial blocks, is enough.

The mask functions close over persistent buffers, so the compiled kernel is reused across steps. The host
planning (`plan_tiles`) is plain numpy and is tested on CPU against a dense mask.

Batch invariance (the default; see `kernels.invariance` and `attention.tiled`): every request, fresh ones included,
goes through the one flex call, and every visible block is listed as partial, in logical order. The kernel
then walks each query row's blocks in the same order with the same online-softmax steps whatever the tile's
other rows are (a full/partial split would depend on them: a decode row and the same row inside a prefill
tile would accumulate in different orders). The tile sizes are fixed (`BLOCK_M` = Q_BLOCK, `BLOCK_N` the key
tile), and FORCE_USE_FLEX_ATTENTION rules out the split-KV decoding kernel, whose split count depends on the
batch. `batch_invariant=False` keeps the faster split: SDPA for fresh prefills, unmasked full blocks.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import torch

from engine.model.attention.base import AttentionMetadata
from engine.model.attention.sdpa import SdpaBackend, SdpaPlan
from engine.model.transfer import index_tensor, to_device

if TYPE_CHECKING:  # imported lazily at run time (see FlexBackend.__init__)
    from torch.nn.attention.flex_attention import BlockMask, FlexKernelOptions

logger = logging.getLogger(__name__)

Q_BLOCK = 16  # query rows per tile: small, so a decode (1 real row) wastes little


def _device_fault(exc: BaseException) -> bool:
    """True for an error raised by the device itself (sticky on CUDA), not by compiling or planning."""
    accelerator_error = getattr(torch, "AcceleratorError", None)
    if accelerator_error is not None and isinstance(exc, accelerator_error):
        return True
    return "CUDA error" in str(exc) or "CUDA driver error" in str(exc)


def cuda_kv_tile(block_size: int) -> int | None:
    """Keys per Triton tile for a cache block size: a power of two from 16 (tl.dot's minimum) to 64 that
    divides the block; None when there is none (block sizes that are not a multiple of 16)."""
    tile = min(block_size & -block_size, 64)  # largest power of two dividing block_size
    return tile if tile >= 16 else None


def kernel_options(device: torch.device, block_size: int) -> FlexKernelOptions | None:
    """The fixed tiles flex runs with on CUDA (BLOCK_M = Q_BLOCK, BLOCK_N = the block's key tile), so that a
    row's reduction order never depends on the step; None elsewhere. ValueError for a block size with no tile."""
    if device.type != "cuda":
        return None
    tile = cuda_kv_tile(block_size)
    if tile is None:
        raise ValueError(
            f"FlexAttention on CUDA needs a block size that is a multiple of 16, not {block_size}"
        )
    return {"FORCE_USE_FLEX_ATTENTION": True, "BLOCK_M": Q_BLOCK, "BLOCK_N": tile}


@dataclass(slots=True)
class TilePlan:
    """Host-side block lists for one request and one sliding window."""

    full: list[np.ndarray]  # per query tile: physical blocks fully visible to all its rows
    partial: list[np.ndarray]  # per query tile: physical blocks needing the mask
    partial_logical: dict[int, int]  # physical block -> logical index, for the partial blocks


def plan_tiles(
    first_pos: int,
    query_len: int,
    context_len: int,
    table: list[int],
    block_size: int,
    is_causal: bool,
    window: int | None,
    q_block: int = Q_BLOCK,
    split_full: bool = True,
) -> TilePlan:
    """Block lists for a request whose queries sit at positions first_pos .. first_pos + query_len - 1.
    `split_full=False` lists every visible block as partial (the batch-invariant order)."""
    tiles = np.arange(-(-query_len // q_block))
    p0 = first_pos + tiles * q_block  # first and last query position of each tile
    p1 = np.minimum(p0 + q_block - 1, first_pos + query_len - 1)
    lim0, lim1 = (p0, p1) if is_causal else (np.full_like(p0, context_len - 1),) * 2
    j = np.arange(-(-context_len // block_size))
    lo, hi = j * block_size, j * block_size + block_size - 1
    visible = lo[None, :] <= lim1[:, None]
    full = hi[None, :] <= lim0[:, None]  # lim0 <= context_len - 1: full blocks are filled
    if window is not None:
        visible &= hi[None, :] > (p0 - window)[:, None]
        full &= lo[None, :] > (p1 - window)[:, None]
    if not split_full:
        full = np.zeros_like(full)
    partial = visible & ~full
    phys = np.asarray(table[: len(j)], dtype=np.int64)
    used = partial.any(axis=0)
    return TilePlan(
        full=[phys[row] for row in full],
        partial=[phys[row] for row in partial],
        partial_logical={int(p): int(i) for p, i in zip(phys[used], j[used], strict=True)},
    )


def _pack(rows: list[np.ndarray], num_tiles: int, min_cols: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Left-packed [num_tiles, cols] int32 indices (cols a power of two) and [num_tiles] counts."""
    counts = np.zeros(num_tiles, dtype=np.int32)
    width = max((len(r) for r in rows), default=0)
    cols = max(1 << max(0, width - 1).bit_length(), min_cols)
    out = np.zeros((num_tiles, cols), dtype=np.int32)
    for t, r in enumerate(rows):
        out[t, : len(r)] = r
        counts[t] = len(r)
    return out, counts


@dataclass(slots=True)
class FlexPlan:
    sdpa: SdpaPlan  # the requests with no cached context
    num_rows: int  # padded query rows given to flex_attention
    q_src: torch.Tensor | None  # [num_rows] flat token feeding each row
    out_rows: torch.Tensor | None  # rows holding real queries ...
    out_tokens: torch.Tensor | None  # ... and the flat tokens they answer
    requests: list[tuple[int, int, int, list[int]]]  # (first_pos, query_len, context_len, table) per request
    is_causal: bool
    meta: AttentionMetadata  # kept for the reference fallback
    block_masks: dict[int | None, BlockMask] = field(default_factory=dict)
    fallback: SdpaPlan | None = None


class FlexBackend:
    """FlexAttention over the paged cache; falls back to `SdpaBackend` if flex cannot run here."""

    name = "flex"
    reads_keys_from_cache = False  # fresh prefills (without batch invariance) attend over their new k/v

    def __init__(
        self,
        device: torch.device,
        num_blocks: int,
        block_size: int,
        max_rows: int = 8192,
        compile: bool | None = None,
        batch_invariant: bool = True,
    ) -> None:
        from torch.nn.attention.flex_attention import flex_attention

        self.device = device
        self.batch_invariant = batch_invariant
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.sdpa = SdpaBackend(device)
        self.block_pos = torch.zeros(num_blocks, dtype=torch.int32, device=device)
        self._alloc_rows(max_rows)
        use_compile = device.type == "cuda" if compile is None else compile
        if use_compile:
            # mask_mod is exact only inside the blocks the BlockMask lists, so flex must never run eagerly,
            # which is what dynamo does once a function hits its recompile limit: allow more variants
            # (shapes, dtypes, windows), and make hitting the limit an error, which forward() turns into
            # the SDPA fallback.
            import torch._dynamo.config as dynamo_config

            limit = "recompile_limit" if hasattr(dynamo_config, "recompile_limit") else "cache_size_limit"
            setattr(dynamo_config, limit, max(getattr(dynamo_config, limit), 64))
            if hasattr(dynamo_config, "fail_on_recompile_limit_hit"):
                dynamo_config.fail_on_recompile_limit_hit = True
        # fullgraph: a graph break would run flex eagerly, which densifies the whole cache.
        self._flex = torch.compile(flex_attention, fullgraph=True) if use_compile else flex_attention
        self._kernel_options = kernel_options(device, block_size)
        self.failed: str | None = None  # set when flex could not run; the reference path serves instead
        self.succeeded = False  # flex ran at least once

    def _alloc_rows(self, rows: int) -> None:
        rows = 1 << max(0, rows - 1).bit_length()
        self._q_pos = torch.zeros(rows, dtype=torch.int32, device=self.device)
        self._q_lim = torch.full((rows,), -1, dtype=torch.int32, device=self.device)
        self._mask_mods: dict[int | None, object] = {}  # closures over the buffers above

    def _mask_mod(self, window: int | None):
        if window not in self._mask_mods:
            q_pos, q_lim, block_pos, bs = self._q_pos, self._q_lim, self.block_pos, self.block_size

            def mask_mod(b, h, q_idx, kv_idx):
                kv_pos = block_pos[kv_idx // bs] * bs + kv_idx % bs
                ok = kv_pos <= q_lim[q_idx]
                if window is not None:
                    ok = ok & (kv_pos > q_pos[q_idx] - window)
                return ok

            self._mask_mods[window] = mask_mod
        return self._mask_mods[window]

    def plan(self, meta: AttentionMetadata) -> FlexPlan:
        fresh = [i for i, (n, c) in enumerate(zip(meta.query_lens, meta.context_lens, strict=True)) if n == c]
        if self.batch_invariant:
            fresh = []  # one path for every request (see the module docstring)
        fresh_set = set(fresh)
        paged = [i for i in range(len(meta.query_lens)) if i not in fresh_set]
        sdpa = SdpaPlan([(meta.query_starts[i], meta.query_lens[i]) for i in fresh], [], [], meta.is_causal)
        if not paged:
            return FlexPlan(sdpa, 0, None, None, None, [], meta.is_causal, meta)
        q_src, q_pos, q_lim, out_rows, out_tokens, requests = [], [], [], [], [], []
        rows = 0
        for i in paged:
            n, ctx, start = meta.query_lens[i], meta.context_lens[i], meta.query_starts[i]
            first = ctx - n
            padded = -(-n // Q_BLOCK) * Q_BLOCK
            local = np.minimum(np.arange(padded), n - 1)  # pad rows repeat the last query; output dropped
            out_rows.append(rows + np.arange(n))
            out_tokens.append(start + np.arange(n))
            q_src.append(start + local)
            q_pos.append(first + local)
            q_lim.append(first + local if meta.is_causal else np.full(padded, ctx - 1))
            requests.append((first, n, ctx, meta.block_tables[i]))
            rows += padded
        num_rows = -(-rows // (8 * Q_BLOCK)) * 8 * Q_BLOCK  # fewer distinct shapes for the compiler
        if num_rows > self._q_pos.numel():
            self._alloc_rows(num_rows)
        pad = num_rows - rows
        src = torch.from_numpy(np.concatenate([*q_src, np.zeros(pad, dtype=np.int64)]))
        pos = np.concatenate([*q_pos, np.zeros(pad, dtype=np.int64)]).astype(np.int32)
        lim = np.concatenate([*q_lim, np.full(pad, -1, dtype=np.int64)]).astype(np.int32)
        # copy_ from the device copies: the persistent buffers stay the ones mask_mod closes over.
        self._q_pos[:num_rows].copy_(to_device(torch.from_numpy(pos), self.device))
        self._q_lim[:num_rows].copy_(to_device(torch.from_numpy(lim), self.device))
        idx = to_device(
            torch.from_numpy(np.stack([np.concatenate(out_rows), np.concatenate(out_tokens)])), self.device
        )
        return FlexPlan(
            sdpa,
            num_rows,
            to_device(src, self.device),
            idx[0],
            idx[1],
            requests,
            meta.is_causal,
            meta,
        )

    def _block_mask(self, plan: FlexPlan, window: int | None):
        from torch.nn.attention.flex_attention import BlockMask

        full: list[np.ndarray] = []
        partial: list[np.ndarray] = []
        logical: dict[int, int] = {}
        for first, n, ctx, table in plan.requests:
            tp = plan_tiles(
                first,
                n,
                ctx,
                table,
                self.block_size,
                plan.is_causal,
                window,
                split_full=not self.batch_invariant,
            )
            full += tp.full
            partial += tp.partial
            for phys, j in tp.partial_logical.items():
                if logical.setdefault(phys, j) != j:
                    raise RuntimeError(f"block {phys} is used at logical indices {logical[phys]} and {j}")
        num_tiles = plan.num_rows // Q_BLOCK
        # The CPU (C++) kernel insists on a column per cache block; the CUDA kernel reads only `num` of them.
        min_cols = self.num_blocks if self.device.type == "cpu" else 0
        kv_idx, kv_num = _pack(partial, num_tiles, min_cols)
        full_idx, full_num = _pack(full, num_tiles, min_cols)
        if logical:
            upd = index_tensor([*logical, *logical.values()], self.device).view(2, -1)
            self.block_pos.index_copy_(0, upd[0], upd[1].to(torch.int32))

        def dev(a: np.ndarray) -> torch.Tensor:
            return to_device(torch.from_numpy(a), self.device)[None, None]

        kwargs = dict(
            full_kv_num_blocks=dev(full_num),
            full_kv_indices=dev(full_idx),
            BLOCK_SIZE=(Q_BLOCK, self.block_size),
            mask_mod=self._mask_mod(window),
            seq_lengths=(plan.num_rows, self.num_blocks * self.block_size),
        )
        try:
            return BlockMask.from_kv_blocks(dev(kv_num), dev(kv_idx), compute_q_blocks=False, **kwargs)
        except TypeError:  # torch < 2.9 has no compute_q_blocks
            return BlockMask.from_kv_blocks(dev(kv_num), dev(kv_idx), **kwargs)

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        plan: FlexPlan,
        sliding_window: int | None,
        scale: float,
    ) -> torch.Tensor:
        if self.failed is not None:
            if plan.fallback is None:
                plan.fallback = self.sdpa.plan(plan.meta)
            return self.sdpa.forward(q, k, v, k_cache, v_cache, plan.fallback, sliding_window, scale)
        out = self.sdpa.forward(q, k, v, k_cache, v_cache, plan.sdpa, sliding_window, scale)
        if plan.q_src is None or plan.out_rows is None or plan.out_tokens is None:  # all set or none
            return out
        try:
            o = self._paged(q, k_cache, v_cache, plan, sliding_window, scale)
        except Exception as exc:  # no Triton, a compile error on a new shape...: keep serving, loudly
            if _device_fault(exc):
                # A kernel fault (illegal address...) poisons the CUDA context: every later kernel fails,
                # the fallback included, so falling back would only hide where it happened.
                raise
            self.failed = f"{type(exc).__name__}: {exc}"
            logger.warning(
                "FlexAttention failed (%s); using the SDPA reference backend", self.failed, exc_info=exc
            )
            return self.forward(q, k, v, k_cache, v_cache, plan, sliding_window, scale)
        self.succeeded = True
        out.index_copy_(0, plan.out_tokens, o.index_select(0, plan.out_rows).to(out.dtype))
        return out

    def _paged(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        plan: FlexPlan,
        window: int | None,
        scale: float,
    ) -> torch.Tensor:
        if window not in plan.block_masks:
            plan.block_masks[window] = self._block_mask(plan, window)
        _, _, kv_heads, dim = k_cache.shape
        assert plan.q_src is not None  # forward() calls this only for a plan with paged rows
        qf = q.index_select(0, plan.q_src).transpose(0, 1)[None]  # [1, heads, rows, dim]
        kf = k_cache.view(1, -1, kv_heads, dim).transpose(1, 2)  # [1, kv_heads, slots, dim]: a view
        vf = v_cache.view(1, -1, kv_heads, dim).transpose(1, 2)
        o = self._flex(
            qf,
            kf,
            vf,
            block_mask=plan.block_masks[window],
            scale=scale,
            enable_gqa=kv_heads != q.shape[1],
            kernel_options=self._kernel_options,
        )
        return o[0].transpose(0, 1)  # [rows, heads, dim]
