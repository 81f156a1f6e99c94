"""Host-side planning for steps replayed from CUDA graphs: buckets, padding, and the static attention plan.

A captured graph replays fixed kernels on fixed addresses, so a step it runs must have a fixed shape: its
tokens are padded up to a bucket (`BUCKETS`, as vLLM's capture sizes for decode), and everything that varies
from step to step is written into one static buffer per bucket (`StaticLayout`) with one host->device copy.

Padding rule (`pad_step`): every pad token repeats the step's last real token (same id, position, slot and
block table) as a request of its own with one query. It writes the very k/v its original writes, to the same
slot, and attends over the same context, so no real row's inputs change; the pad rows' outputs are dropped.
No cache block is reserved for padding. On CPU `tests/engine/test_cuda_graphs.py` checks that padding leaves
every real row's logits bit-identical; on CUDA the same holds where the matmuls are batch-invariant.

The static attention plan (`fill_flex_plan`) is FlexAttention's batch-invariant plan (engine.model.attention.flex:
queries padded to 16-row tiles, every visible block listed as partial, in logical order), laid out at fixed
sizes: `bucket` tiles of Q_BLOCK rows (a step of T <= bucket tokens never needs more than T tiles), and
`max_blocks` block columns per tile. Unused tiles repeat the last used one (their outputs are never read);
columns past a tile's block count are left as they were (nothing reads them: see `cuda_graphs`).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

BUCKETS = (1, 2, 4, 8, 16, 32, 64)
Q_BLOCK = 16  # query rows per attention tile: FlexBackend's (engine.model.attention.flex.Q_BLOCK)


def buckets_up_to(max_tokens: int, sizes: tuple[int, ...] = BUCKETS) -> tuple[int, ...]:
    """The capture sizes that a step of at most `max_tokens` tokens can use (at least the smallest)."""
    kept = tuple(b for b in sizes if b <= max_tokens)
    return kept or sizes[:1]


def bucket_for(num_tokens: int, buckets: tuple[int, ...]) -> int | None:
    """The smallest bucket holding `num_tokens` tokens, or None (the step runs eagerly)."""
    for b in buckets:
        if num_tokens <= b:
            return b
    return None


@dataclass(slots=True)
class PaddedStep:
    """One step's host lists padded to `bucket` tokens (see the module docstring's padding rule)."""

    bucket: int
    num_tokens: int  # real tokens: the first num_tokens entries of the token lists
    num_rows: int  # real logits rows: the first num_rows entries of logits_rows
    input_ids: list[int]  # [bucket]
    positions: list[int]  # [bucket]
    slots: list[int]  # [bucket]
    logits_rows: list[int]  # [bucket]: the real rows, then repeats of the last one
    query_lens: list[int]  # per request, pad requests (one query each) last
    context_lens: list[int]
    block_tables: list[list[int]]


def pad_step(
    bucket: int,
    input_ids: list[int],
    positions: list[int],
    slots: list[int],
    logits_rows: list[int],
    query_lens: list[int],
    context_lens: list[int],
    block_tables: list[list[int]],
) -> PaddedStep:
    """The step padded to `bucket` tokens. Needs at least one token and one logits row, and len(input_ids)
    <= bucket."""
    t, pad = len(input_ids), bucket - len(input_ids)
    if t < 1 or pad < 0 or not logits_rows:
        raise ValueError(f"cannot pad a step of {t} tokens and {len(logits_rows)} rows to {bucket}")
    last_ctx, last_table = positions[-1] + 1, block_tables[-1]
    return PaddedStep(
        bucket,
        t,
        len(logits_rows),
        input_ids + [input_ids[-1]] * pad,
        positions + [positions[-1]] * pad,
        slots + [slots[-1]] * pad,
        logits_rows + [logits_rows[-1]] * (bucket - len(logits_rows)),
        query_lens + [1] * pad,
        context_lens + [last_ctx] * pad,
        block_tables + [last_table] * pad,
    )


@dataclass(frozen=True, slots=True)
class StaticLayout:
    """Offsets of one bucket's fields in its int64 static buffer (host pinned copy and device copy alike).

    Tokens: input_ids, positions, slots, logits_rows ([bucket] each). Attention: q_src, q_pos, q_lim
    ([bucket * Q_BLOCK] each: per query row, the token feeding it, its position, the last key position it
    may see), out_rows ([bucket]: the query row answering each token), kv_num ([bucket]: blocks per tile) and
    kv_idx ([max_blocks, bucket]: column k lists tile k's blocks in logical order). kv_idx is last and
    column-major, so a step's entries end after its longest list: the copy stops there (`fill_flex_plan`)."""

    bucket: int
    max_blocks: int

    @property
    def rows(self) -> int:
        return self.bucket * Q_BLOCK

    def span(self, name: str) -> tuple[int, int]:
        """(start, length) of a field."""
        b, r = self.bucket, self.rows
        sizes = dict(
            input_ids=b,
            positions=b,
            slots=b,
            logits_rows=b,
            q_src=r,
            q_pos=r,
            q_lim=r,
            out_rows=b,
            kv_num=b,
            kv_idx=b * self.max_blocks,
        )
        start = 0
        for field_name, n in sizes.items():
            if field_name == name:
                return start, n
            start += n
        raise KeyError(name)

    @property
    def size(self) -> int:
        start, n = self.span("kv_idx")
        return start + n


def fill_tokens(buf: np.ndarray, layout: StaticLayout, step: PaddedStep) -> None:
    """Writes the step's token fields into `buf` (an int64 view of the host staging buffer)."""
    for name in ("input_ids", "positions", "slots", "logits_rows"):
        start, n = layout.span(name)
        buf[start : start + n] = getattr(step, name)


def fill_flex_plan(
    buf: np.ndarray, layout: StaticLayout, step: PaddedStep, block_size: int, is_causal: bool = True
) -> int:
    """Writes FlexAttention's batch-invariant plan of the padded step into `buf` (see the module docstring)
    and returns how many entries of `buf`, from its start, hold this step's data (what must be copied).
    Only the first kv_num[k] entries of tile k's kv_idx list are written: the kernel reads no others, and
    the device-side scatter of block positions skips them. Raises ValueError where a request's context needs
    more than `layout.max_blocks` blocks."""
    rows_src: list[np.ndarray] = []
    rows_pos: list[np.ndarray] = []
    rows_lim: list[np.ndarray] = []
    out_rows = np.empty(step.bucket, dtype=np.int64)
    kv_num = np.empty(layout.bucket, dtype=np.int64)
    s0, _ = layout.span("kv_idx")
    kv_idx = buf[s0 : s0 + layout.bucket * layout.max_blocks].reshape(layout.max_blocks, layout.bucket).T
    start = rows = tile = 0
    for n, ctx, table in zip(step.query_lens, step.context_lens, step.block_tables, strict=True):
        first = ctx - n
        padded = -(-n // Q_BLOCK) * Q_BLOCK
        local = np.minimum(np.arange(padded), n - 1)  # pad rows repeat the last query (as FlexBackend's)
        rows_src.append(start + local)
        rows_pos.append(first + local)
        rows_lim.append(first + local if is_causal else np.full(padded, ctx - 1))
        out_rows[start : start + n] = rows + np.arange(n)
        for k in range(padded // Q_BLOCK):
            # keys the tile may see: up to its last query's position (causal), else the whole context
            last = min(first + k * Q_BLOCK + Q_BLOCK - 1, ctx - 1) if is_causal else ctx - 1
            count = last // block_size + 1
            if count > layout.max_blocks:
                raise ValueError(f"a context of {ctx} tokens needs more than {layout.max_blocks} blocks")
            kv_idx[tile, :count] = table[:count]
            kv_num[tile] = count
            tile += 1
        start += n
        rows += padded
    if tile > layout.bucket:  # cannot happen: a request of n tokens takes ceil(n / 16) <= n tiles
        raise AssertionError(f"{tile} tiles for a bucket of {layout.bucket}")
    kv_idx[tile:, : kv_num[tile - 1]] = kv_idx[tile - 1, : kv_num[tile - 1]]  # unused tiles repeat the last
    kv_num[tile:] = kv_num[tile - 1]
    extra = layout.bucket - tile
    last_rows = slice(rows - Q_BLOCK, rows)
    src, pos, lim = (np.concatenate(a) for a in (rows_src, rows_pos, rows_lim))
    fields = dict(
        q_src=np.concatenate([src, np.tile(src[last_rows], extra)]),
        q_pos=np.concatenate([pos, np.tile(pos[last_rows], extra)]),
        q_lim=np.concatenate([lim, np.tile(lim[last_rows], extra)]),
        out_rows=out_rows,
        kv_num=kv_num,
    )
    for name, values in fields.items():
        s, n = layout.span(name)
        buf[s : s + n] = values
    return s0 + int(kv_num.max()) * layout.bucket
