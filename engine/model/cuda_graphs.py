"""`GraphRunner`: short steps (decodes, and mixed steps of at most 64 tokens) run at a bucket's fixed shape,
replayed from a CUDA graph captured at startup, one per bucket (engine.model.graph_plan.BUCKETS), as vLLM does.

Why: a decode step of a small model on a GPU costs more in kernel launches (a few hundred per step, each a
few microseconds of host time) than in the kernels themselves; a graph launches them all in one call.

What a replay needs, and how it gets it:
- Fixed shapes: the step is padded up to its bucket (`graph_plan.pad_step`), and the attention plan is laid
  out at fixed sizes (`graph_plan.fill_flex_plan`): `StaticFlexAttention` runs FlexAttention with the same
  kernel options, tiles and block order as `attention.flex.FlexBackend`'s batch-invariant plan.
- Fixed addresses: each bucket owns one int64 device buffer holding every per-step input, filled from a
  pinned host buffer with one host->device copy per step; the graph's first kernels turn those into the
  attention's int32 block lists, mask buffers and block positions. Nothing is planned on the host inside
  the graph: per-step host work is the list padding and the numpy fill, then one copy and one replay.
- The logits come back in a static tensor [bucket, vocab]; the caller reads its first rows.

Buckets are captured at startup, largest first, in one shared memory pool, each after two eager warm-up runs
(the first compiles FlexAttention for that shape); each capture's time is logged. `--enforce-eager` turns
graphs off (the runner never builds this), as do LoRA, sliding windows and an attention other than flex.

Without a GPU the same object runs eagerly (`capture=False`): the static path with FlexAttention uncompiled,
or, given any other backend, the padded step planned by that backend. That is how the padding and the static
plan are tested on CPU. The capture itself (`capture()`) has not yet run on a GPU: written for issue 33 on a
CPU-only machine, it is exercised by tests/engine/test_cuda_graphs.py's CUDA-marked tests.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch
from torch import nn

from engine.model.attention.base import AttentionBackend, AttentionMetadata
from engine.model.graph_plan import (
    Q_BLOCK,
    PaddedStep,
    StaticLayout,
    bucket_for,
    fill_flex_plan,
    fill_tokens,
    pad_step,
)
from engine.model.models.context import ForwardContext

if TYPE_CHECKING:  # imported lazily at run time, as attention.flex does
    from torch.nn.attention.flex_attention import BlockMask

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class StaticPlan:
    """One bucket's attention inputs: views of its device buffer, and the tensors the BlockMask holds."""

    layout: StaticLayout
    q_src: torch.Tensor  # [rows] int64
    q_pos: torch.Tensor  # [rows] int64
    q_lim: torch.Tensor  # [rows] int64
    out_rows: torch.Tensor  # [bucket] int64
    kv_num: torch.Tensor  # [bucket] int64
    kv_idx: torch.Tensor  # [max_blocks, bucket] int64 (only the first kv_num[k] of column k are meaningful)
    kv_num32: torch.Tensor  # [1, 1, bucket] int32: what the BlockMask reads
    kv_idx32: torch.Tensor  # [1, 1, bucket, max_blocks] int32
    block_mask: BlockMask  # over the two above


class StaticFlexAttention:
    """FlexAttention over the paged cache with a plan living in static buffers (`bind`, then `prepare` as the
    step's first device work). The numerics are FlexBackend's batch-invariant path: the same kernel options
    (BLOCK_M = 16 query rows, BLOCK_N the key tile, no split-KV), every visible block listed as partial in
    logical order, and the same mask (a key is visible up to the row's last visible position)."""

    name = "flex (static, CUDA graphs)"
    reads_keys_from_cache = False  # the model writes k/v itself, as it does for FlexBackend
    failed: str | None = None

    def __init__(
        self, device: torch.device, num_blocks: int, block_size: int, max_rows: int, compile: bool
    ) -> None:
        from torch.nn.attention.flex_attention import flex_attention

        from engine.model.attention.flex import kernel_options

        self.device, self.num_blocks, self.block_size = device, num_blocks, block_size
        # Shared by every bucket (replays run one at a time on one stream): one mask_mod, one compiled kernel.
        self.q_pos = torch.zeros(max_rows, dtype=torch.int32, device=device)
        self.q_lim = torch.full((max_rows,), -1, dtype=torch.int32, device=device)
        # physical block -> logical index; the last entry takes the scatter's unused columns
        self.block_pos = torch.zeros(num_blocks + 1, dtype=torch.int32, device=device)
        q_lim, block_pos, bs = self.q_lim, self.block_pos, block_size

        def mask_mod(b, h, q_idx, kv_idx):
            return block_pos[kv_idx // bs] * bs + kv_idx % bs <= q_lim[q_idx]

        self._mask_mod = mask_mod
        self._flex = torch.compile(flex_attention, fullgraph=True) if compile else flex_attention
        self._kernel_options = kernel_options(device, block_size)  # FlexBackend's: the same kernel

    def bind(self, buf: torch.Tensor, layout: StaticLayout) -> StaticPlan:
        """The plan over one bucket's device buffer `buf` (int64, `layout.size`)."""
        from torch.nn.attention.flex_attention import BlockMask

        def view(name: str) -> torch.Tensor:
            s, n = layout.span(name)
            return buf[s : s + n]

        b, m = layout.bucket, layout.max_blocks
        kv_num32 = torch.ones(1, 1, b, dtype=torch.int32, device=self.device)
        kv_idx32 = torch.zeros(1, 1, b, m, dtype=torch.int32, device=self.device)
        # Zero full blocks, as FlexBackend passes under batch invariance: the same kernel variant.
        full_num = torch.zeros(1, 1, b, dtype=torch.int32, device=self.device)
        full_idx = torch.zeros(1, 1, b, m, dtype=torch.int32, device=self.device)
        mask = BlockMask.from_kv_blocks(
            kv_num32,
            kv_idx32,
            full_kv_num_blocks=full_num,
            full_kv_indices=full_idx,
            BLOCK_SIZE=(Q_BLOCK, self.block_size),
            mask_mod=self._mask_mod,
            seq_lengths=(layout.rows, self.num_blocks * self.block_size),
            compute_q_blocks=False,  # torch >= 2.9 (the project pins 2.13): no backward, no q-side lists
        )
        return StaticPlan(
            layout,
            view("q_src"),
            view("q_pos"),
            view("q_lim"),
            view("out_rows"),
            view("kv_num"),
            view("kv_idx").view(m, b),
            kv_num32,
            kv_idx32,
            mask,
        )

    def prepare(self, plan: StaticPlan) -> None:
        """Device work that turns the staged int64 fields into what the kernel reads (captured in the graph)."""
        rows = plan.layout.rows
        plan.kv_num32.view(-1).copy_(plan.kv_num)
        plan.kv_idx32[0, 0].copy_(plan.kv_idx.t())
        self.q_pos[:rows].copy_(plan.q_pos)
        self.q_lim[:rows].copy_(plan.q_lim)
        # block_pos[kv_idx[j, k]] = j for j < kv_num[k]; other entries (stale) land on the spare last one.
        logical = torch.arange(plan.layout.max_blocks, device=self.device)[:, None]  # [max_blocks, 1]
        target = torch.where(logical < plan.kv_num[None, :], plan.kv_idx, self.num_blocks)
        values = logical.expand_as(target).to(torch.int32)
        self.block_pos.index_copy_(0, target.reshape(-1), values.reshape(-1))

    def plan(self, meta: AttentionMetadata) -> StaticPlan:
        raise RuntimeError(
            "StaticFlexAttention plans through GraphRunner (bind + graph_plan), never per step"
        )

    def forward(
        self,
        q: torch.Tensor,  # [T, H, D]
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
        v_cache: torch.Tensor,
        plan: StaticPlan,
        sliding_window: int | None,
        scale: float,
    ) -> torch.Tensor:
        if sliding_window is not None:
            raise ValueError("StaticFlexAttention has no sliding windows (GraphRunner is off for them)")
        _, _, kv_heads, dim = k_cache.shape
        qf = q.index_select(0, plan.q_src).transpose(0, 1)[None]  # [1, H, rows, D]
        kf = k_cache.view(1, -1, kv_heads, dim).transpose(1, 2)  # [1, Hkv, slots, D]: a view
        vf = v_cache.view(1, -1, kv_heads, dim).transpose(1, 2)
        o = self._flex(
            qf,
            kf,
            vf,
            block_mask=plan.block_mask,
            scale=scale,
            enable_gqa=kv_heads != q.shape[1],
            kernel_options=self._kernel_options,
        )
        return o[0].transpose(0, 1).index_select(0, plan.out_rows).to(q.dtype)  # [T, H, D]


@dataclass(slots=True)
class _Bucket:
    layout: StaticLayout
    host: torch.Tensor  # [size] int64, pinned on CUDA: the step's inputs as staged
    host_np: np.ndarray  # the same memory, as numpy (made once: the fill is numpy's)
    dev: torch.Tensor  # [size] int64 on the device: their one copy
    plan: StaticPlan | None  # None on the dynamic (any backend) path
    graph: torch.cuda.CUDAGraph | None = None
    logits: torch.Tensor | None = None  # [bucket, vocab] float32: the captured forward's output
    copied: torch.cuda.Event | None = None  # the last copy out of `host` (refill only once it has run)

    def field(self, name: str) -> torch.Tensor:
        s, n = self.layout.span(name)
        return self.dev[s : s + n]


class GraphRunner:
    """Runs a step padded to its bucket: replayed from a graph where captured, else eagerly (same path).

    `attention`: a `StaticFlexAttention` (the static plan; the only one that can be captured), or any other
    backend, which then plans each padded step itself (eager only: the CPU tests of the padding rule).
    Rule for callers: `run` only steps that `bucket` accepted, with at least one logits row and no
    sliding-window layers; read only the first `num_rows` rows of what it returns before the next `run`.
    """

    def __init__(
        self,
        model: nn.Module,
        k_caches: Sequence[torch.Tensor],
        v_caches: Sequence[torch.Tensor],
        attention: AttentionBackend | StaticFlexAttention,
        block_size: int,
        max_model_len: int,
        buckets: tuple[int, ...],
        is_causal: bool = True,
    ) -> None:
        self.model, self.k_caches, self.v_caches = model, k_caches, v_caches
        self.attention, self.block_size, self.is_causal = attention, block_size, is_causal
        self.buckets = tuple(sorted(buckets))
        self.device = k_caches[0].device
        self.max_context = -(-max_model_len // block_size) * block_size
        self.max_blocks = self.max_context // block_size
        self._buckets: dict[int, _Bucket] = {}
        self.capture_s: float | None = None  # set by capture()
        static = isinstance(attention, StaticFlexAttention)
        for b in self.buckets:
            layout = StaticLayout(b, self.max_blocks if static else 0)
            size = layout.size if static else 4 * b
            host = torch.zeros(size, dtype=torch.int64, pin_memory=self.device.type == "cuda")
            dev = torch.zeros(size, dtype=torch.int64, device=self.device)
            plan = attention.bind(dev, layout) if isinstance(attention, StaticFlexAttention) else None
            self._buckets[b] = _Bucket(layout, host, host.numpy(), dev, plan)

    def bucket(self, num_tokens: int, max_context: int) -> int | None:
        """The bucket a step of `num_tokens` tokens whose longest context is `max_context` runs at, or None."""
        return bucket_for(num_tokens, self.buckets) if max_context <= self.max_context else None

    @property
    def captured(self) -> list[int]:
        return [b for b, bk in self._buckets.items() if bk.graph is not None]

    def run(self, step: PaddedStep) -> torch.Tensor:
        """[bucket, vocab] float32 logits of `step.logits_rows` (valid until the next run of its bucket)."""
        bk = self._buckets[step.bucket]
        self._stage(bk, step)
        if bk.graph is not None and bk.logits is not None:
            bk.graph.replay()
            return bk.logits
        return self._forward(bk, step)

    def _stage(self, bk: _Bucket, step: PaddedStep) -> None:
        """Fills the host buffer and sends it with the step's one host->device copy."""
        # The previous copy out of this pinned buffer must have run before it is refilled. In the engine it
        # always has (each step ends with a sync), so query() answers without waiting, and nothing syncs.
        if bk.copied is not None and not bk.copied.query():
            bk.copied.synchronize()
        buf = bk.host_np
        fill_tokens(buf, bk.layout, step)
        n = bk.host.numel()
        if bk.plan is not None:  # the copy stops after the step's longest block list (graph_plan)
            n = fill_flex_plan(buf, bk.layout, step, self.block_size, self.is_causal)
        if self.device.type == "cpu":
            bk.dev[:n].copy_(bk.host[:n])
            return
        bk.dev[:n].copy_(bk.host[:n], non_blocking=True)
        if bk.copied is None:
            bk.copied = torch.cuda.Event()
        bk.copied.record()

    def _forward(self, bk: _Bucket, step: PaddedStep | None = None) -> torch.Tensor:
        """The padded step's forward from the bucket's device buffer (what a capture records)."""
        ids, pos = bk.field("input_ids"), bk.field("positions")
        slots, rows = bk.field("slots"), bk.field("logits_rows")
        if bk.plan is not None and isinstance(self.attention, StaticFlexAttention):
            self.attention.prepare(bk.plan)
            ctx = ForwardContext(pos, self.attention, bk.plan, slots, self.k_caches, self.v_caches, rows)
            return self.model(ids, ctx)
        if step is None:
            raise RuntimeError("the dynamic path plans from the step's host lists")
        meta = AttentionMetadata(
            step.query_lens, step.context_lens, step.block_tables, self.block_size, slots, self.is_causal
        )
        ctx = ForwardContext.for_step(self.attention, meta, pos, self.k_caches, self.v_caches, rows)
        return self.model(ids, ctx)

    def capture(self) -> float:
        """Captures every bucket's graph (CUDA, static plan only), largest first; returns the seconds taken.
        Writes junk into slot 0 of block 0 while warming up: call it before any request has run."""
        if self.device.type != "cuda" or not isinstance(self.attention, StaticFlexAttention):
            raise RuntimeError("CUDA graphs need a CUDA device and StaticFlexAttention")
        pool = torch.cuda.graph_pool_handle()
        t_all = time.perf_counter()
        for b in sorted(self.buckets, reverse=True):
            t0 = time.perf_counter()
            bk = self._buckets[b]
            dummy = pad_step(b, [0], [0], [0], [0], [1], [1], [[0]])
            self._stage(bk, dummy)
            # Warm-up on a side stream, as torch's capture recipe says (lazy per-stream state, such as cuBLAS
            # workspaces, is then made outside the capture); the first run compiles FlexAttention.
            main = torch.cuda.current_stream(self.device)
            side = torch.cuda.Stream(self.device)
            side.wait_stream(main)
            with torch.cuda.stream(side):
                for _ in range(2):
                    self._forward(bk)
            main.wait_stream(side)
            torch.cuda.synchronize(self.device)
            graph = torch.cuda.CUDAGraph()
            # thread_local: another thread of the process (grammar masks, detokenizer) may touch CUDA meanwhile.
            with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
                bk.logits = self._forward(bk)
            torch.cuda.synchronize(self.device)
            bk.graph = graph
            logger.info("CUDA graph for %d tokens captured in %.2f s", b, time.perf_counter() - t0)
        seconds = self.capture_s = time.perf_counter() - t_all
        logger.info("CUDA graphs: %d buckets %s captured in %.1f s", len(self.buckets), self.buckets, seconds)
        return seconds
