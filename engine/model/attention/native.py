"""Batch-invariant paged attention that reads the KV cache in place: the CPU default where it builds.

The tiled backend (`attention.tiled`) is made of torch ops, so every layer of every step gathers each
request's whole context out of the paged cache into contiguous float32 tiles before multiplying: a warm
request whose 2,000 tokens are cached paid for copying them 30 times per step, and a decode paid ~25 small
ops of dispatch per layer. This backend hands the cache, the block tables and the queries to one C++ kernel
per layer (`kernels/csrc/paged_attention.cpp`, built by `kernels.build`) that walks each request's blocks where
they lie, in float32 (scores and an exact max, then weights x values): the only cost that grows with cached
tokens is reading them.

Invariance holds by construction, not by probing: a row's arithmetic depends only on its own query, its own
visible keys and the block size (the kernel's header says how). Its numerics differ from the tiled
backend's in the last bits (another summation order); both agree with transformers within the model tests'
tolerances. Where the kernels cannot be built (no compiler), `attention.chooser` keeps the tiled one.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from engine.model.attention.base import AttentionMetadata
from engine.model.kernels.build import DTYPE_CODES, Kernels, kv_dtype_runs

MAX_ITEM_TOKENS = 16  # query tokens of one request per work item: they share each block's conversion
# A request's query is cut into items for idle threads only from this many tokens. Every item walks the
# request's whole context (per KV head), and over a cached context that walk costs about as much as ~8 query
# tokens' arithmetic (bfloat16 or float32, 2,000 tokens from DRAM, one thread): two items of n / 2 tokens
# cost ~2 walks + n tokens where one item costs 1 walk + n, so cutting a verify chunk of a few tokens (a
# decode step's drafts) made the step slower, not faster, on every batch size.
SPLIT_MIN_TOKENS = 16


@dataclass(slots=True)
class NativePlan:
    items: torch.Tensor  # [num_items, 5] int32: first token, tokens, first position, context, table row
    tables: torch.Tensor  # [requests, width] int32 block ids, padded with 0 (never read)
    num_tokens: int
    is_causal: bool

    def for_rows(self, rows: Sequence[int]) -> NativePlan:
        """The plan of the step's token rows `rows` alone (strictly increasing): each row sees the keys it sees
        in this plan, and consecutive rows of one request share an item (MAX_ITEM_TOKENS at most). The native
        decoder stack runs its last layer's attention on the rows whose logits the step wants with it."""
        # (first token, tokens, first position, context, table row) per item, in token order
        spans = self.items.tolist()
        items: list[int] = []
        j = 0
        for r in rows:
            while spans[j][0] + spans[j][1] <= r:
                j += 1
            t0, _, p0, ctx, req = spans[j]
            if items and items[-1] == req and items[-5] + items[-4] == r and items[-4] < MAX_ITEM_TOKENS:
                items[-4] += 1  # the run of rows before goes on
            else:
                items += (r, 1, p0 + r - t0, ctx, req)
        return NativePlan(
            torch.tensor(items, dtype=torch.int32).view(-1, 5), self.tables, self.num_tokens, self.is_causal
        )


def item_tokens(query_len: int, threads: int, requests: int = 1) -> int:
    """Tokens per work item for a request with `query_len` new tokens in a step of `requests` requests (each
    item is then one per KV head): at most MAX_ITEM_TOKENS, since bigger items convert each block once for
    more rows. A request is split over the threads (as many items as threads) only where the step has fewer
    requests than threads and its query is long enough for its arithmetic to outweigh the extra walks over
    its context (SPLIT_MIN_TOKENS): otherwise the other requests' items keep the threads busy, or an item's
    walk is most of its cost. Results do not depend on it (benchmarks/attention_bench.py measures the
    trade-off, its verify cases the short queries)."""
    whole = max(1, min(MAX_ITEM_TOKENS, query_len))
    if requests >= threads or query_len < SPLIT_MIN_TOKENS:
        return whole
    return max(1, min(whole, -(-query_len // max(1, threads))))


class NativeBackend:
    """The C++ paged attention kernel (see the module docstring). CPU only."""

    name = "native"
    # forward reads every key and value from the caches, never its k and v arguments: the model may hand
    # it empty ones after writing the cache itself (fused_ops.rope_and_write).
    reads_keys_from_cache = True
    failed: str | None = None

    def __init__(self, kernels: Kernels) -> None:
        self.kernels = kernels

    def plan(self, meta: AttentionMetadata) -> NativePlan:
        bs = meta.block_size
        threads = torch.get_num_threads()
        needs = [-(-ctx // bs) for ctx in meta.context_lens]  # blocks each request's context spans
        width = max(needs, default=1) or 1
        items: list[int] = []
        flat: list[int] = []  # the block tables, padded with 0 to `width`: one tensor from one list
        for i, (n, ctx, need) in enumerate(zip(meta.query_lens, meta.context_lens, needs, strict=True)):
            table = meta.block_tables[i]
            if len(table) < need:  # the kernel would read past the table
                raise ValueError(f"request {i}: block table has {len(table)} blocks, needs {need}")
            flat += table[:need]
            flat += [0] * (width - need)
            step = item_tokens(n, threads, len(meta.query_lens))
            first, start = ctx - n, meta.query_starts[i]
            for a in range(0, n, step):
                items += (start + a, min(step, n - a), first + a, ctx, i)
        tables = torch.tensor(flat, dtype=torch.int32).view(len(needs), width)
        return NativePlan(
            torch.tensor(items, dtype=torch.int32).view(-1, 5), tables, meta.num_tokens, meta.is_causal
        )

    def forward(
        self,
        q: torch.Tensor,  # [num_tokens, H, D]
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
        v_cache: torch.Tensor,
        plan: NativePlan,
        sliding_window: int | None,
        scale: float,
    ) -> torch.Tensor:
        t, h, d = q.shape
        _, bs, hkv, _ = k_cache.shape
        if q.device.type != "cpu" or not kv_dtype_runs(q.dtype, k_cache.dtype) or q.dtype not in DTYPE_CODES:
            raise ValueError(
                "native attention runs on CPU float32/bfloat16/float16 (and float32 over a float16 cache), got "
                f"{q.dtype} over a {k_cache.dtype} cache on {q.device}"
            )
        if q.stride(-1) != 1:
            q = q.contiguous()
        if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
            raise ValueError("native attention needs contiguous KV caches")
        out = torch.empty((t, h, d), dtype=q.dtype)
        if t == 0 or plan.items.shape[0] == 0:
            return out
        rc = self.kernels.paged_attention(
            DTYPE_CODES[q.dtype],
            DTYPE_CODES[k_cache.dtype],
            q.data_ptr(),
            q.stride(0),
            q.stride(1),
            k_cache.data_ptr(),
            v_cache.data_ptr(),
            out.data_ptr(),
            plan.items.data_ptr(),
            plan.items.shape[0],
            plan.tables.data_ptr(),
            plan.tables.shape[1],
            h,
            hkv,
            d,
            bs,
            int(plan.is_causal),
            sliding_window or 0,
            scale,
            torch.get_num_threads(),
        )
        if rc != 0:
            raise ValueError(f"native attention refused its arguments (code {rc}): {h} heads, {hkv} kv heads")
        return out
