"""CUDA-graph steps (engine.model.cuda_graphs, engine.model.graph_plan): buckets, the padding rule and the static
attention plan, on CPU; the capture itself on CUDA (marked, skipped here).

The padding rule is checked bit for bit through the engine's own CPU attention (invariant): a step padded to
its bucket gives every real row the logits and tokens it gives unpadded. The static FlexAttention plan is
checked against FlexBackend's own planning (`plan_tiles`, exact) and, with the kernel emulated on CPU, against
the engine's attention (close: a different order of sums).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from engine.config import EngineConfig
from engine.model.attention.base import slot_ids
from engine.model.attention.flex import plan_tiles
from engine.model.cuda_graphs import GraphRunner, StaticFlexAttention
from engine.model.graph_plan import (
    BUCKETS,
    Q_BLOCK,
    PaddedStep,
    StaticLayout,
    bucket_for,
    buckets_up_to,
    fill_flex_plan,
    pad_step,
)
from engine.model.models.context import ForwardContext
from engine.model_runner import ModelRunner

BS = 4


def test_buckets():
    assert [bucket_for(n, BUCKETS) for n in (1, 2, 3, 5, 9, 17, 33, 64, 65)] == [
        1,
        2,
        4,
        8,
        16,
        32,
        64,
        64,
        None,
    ]
    assert buckets_up_to(2048) == BUCKETS
    assert buckets_up_to(20) == (1, 2, 4, 8, 16)
    assert buckets_up_to(0) == (1,)


def test_pad_step_repeats_the_last_token_as_requests_of_one_query():
    p = pad_step(8, [5, 6, 7], [3, 9, 10], [30, 41, 42], [0, 2], [1, 2], [4, 11], [[7], [8, 9, 10]])
    assert (p.bucket, p.num_tokens, p.num_rows) == (8, 3, 2)
    assert p.input_ids == [5, 6, 7] + [7] * 5
    assert p.positions == [3, 9, 10] + [10] * 5
    assert p.slots == [30, 41, 42] + [42] * 5
    assert p.logits_rows == [0, 2] + [2] * 6
    assert p.query_lens == [1, 2] + [1] * 5
    assert p.context_lens == [4, 11] + [11] * 5
    assert p.block_tables == [[7], [8, 9, 10]] + [[8, 9, 10]] * 5
    with pytest.raises(ValueError):
        pad_step(2, [1, 2, 3], [0, 1, 2], [0, 1, 2], [2], [3], [3], [[0]])


def _step(batch: list[tuple[list[int], int, list[int]]], sample_last: bool = True):
    """(new tokens, computed, block table) per request -> the runner's host lists (every request samples)."""
    ids, pos, slots, rows = [], [], [], []
    for new, start, table in batch:
        rows.append(len(ids) + len(new) - 1)
        ids += new
        pos += range(start, start + len(new))
        slots += slot_ids(table, start, start + len(new), BS)
    qlens = [len(n) for n, _, _ in batch]
    ctx = [s + len(n) for n, s, _ in batch]
    return ids, pos, slots, rows, qlens, ctx, [t for _, _, t in batch]


def _unpadded(runner: ModelRunner, lists) -> torch.Tensor:
    """The step as the runner runs it (no padding), through the runner's own attention backend."""
    ids, pos, slots, rows, qlens, ctx, tables = lists
    p = pad_step(len(ids), *lists)  # pads nothing: the same lists as tensors
    assert p.input_ids == ids and p.logits_rows[: len(rows)] == rows
    from engine.model.attention.base import AttentionMetadata

    dev = torch.tensor([ids, pos, slots])
    meta = AttentionMetadata(qlens, ctx, tables, BS, dev[2])
    fc = ForwardContext.for_step(
        runner.attn_backend,
        meta,
        dev[1],
        runner.kv_store.k_caches,
        runner.kv_store.v_caches,
        torch.tensor(rows),
    )
    return runner.model(dev[0], fc)


def _prefill(runner: ModelRunner, prompts: dict[str, list[int]], tables: dict[str, list[int]]) -> None:
    lists = _step([(p, 0, tables[k]) for k, p in prompts.items()])
    _unpadded(runner, lists)


@pytest.fixture
def runner(tiny_model) -> ModelRunner:
    tiny = tiny_model("llama")
    return ModelRunner(
        EngineConfig(model=str(tiny.path), device="cpu", dtype="float32", block_size=BS, num_blocks=64)
    )


def test_padding_changes_no_rows_bits_on_cpu(runner: ModelRunner):
    """Decodes and a mixed step, padded to their buckets through the engine's CPU attention: the real rows'
    logits (and so their greedy tokens) are the unpadded run's, bit for bit."""
    assert runner.graphs is None  # never on CPU
    prompts = {"a": [3, 17, 29, 4, 8, 60, 2], "b": [9, 9, 1], "c": [44, 5, 6, 7, 8, 100, 3, 1, 12, 13, 14]}
    tables = {"a": [40, 3, 17, 22], "b": [8, 0, 5, 60], "c": [11, 50, 2, 7, 33]}
    _prefill(runner, prompts, tables)
    graphs = GraphRunner(
        runner.model,
        runner.kv_store.k_caches,
        runner.kv_store.v_caches,
        runner.attn_backend,
        BS,
        runner.max_model_len,
        BUCKETS,
    )
    n = {k: len(p) for k, p in prompts.items()}
    decodes = _step([([5], n["a"], tables["a"]), ([77], n["b"], tables["b"]), ([6], n["c"], tables["c"])])
    mixed = _step([([5], n["a"], tables["a"]), ([12, 13, 14, 15, 16], n["b"], tables["b"])])
    for lists in (decodes, mixed):
        want = _unpadded(runner, lists)
        bucket = graphs.bucket(len(lists[0]), max(lists[5]))
        assert bucket is not None and bucket > len(lists[0])  # 3 -> 4, 6 -> 8: there is padding
        got = graphs.run(pad_step(bucket, *lists))[: len(lists[3])]
        assert torch.equal(got, want)
        assert torch.equal(got.argmax(-1), want.argmax(-1))
        # Twice the bucket's padding (a larger bucket): still the same bits.
        wider = bucket_for(2 * bucket, BUCKETS)
        assert wider is not None
        assert torch.equal(graphs.run(pad_step(wider, *lists))[: len(lists[3])], want)


def _reference_tiles(step: PaddedStep, bs: int) -> list[tuple[int, list[int]]]:
    """(kv count, blocks) per tile, from FlexBackend's own planning (batch-invariant: all partial)."""
    out = []
    for n, ctx, table in zip(step.query_lens, step.context_lens, step.block_tables, strict=True):
        tp = plan_tiles(ctx - n, n, ctx, table, bs, True, None, split_full=False)
        assert all(len(f) == 0 for f in tp.full)
        out += [(len(p), [int(x) for x in p]) for p in tp.partial]
    return out


@pytest.mark.parametrize(
    "batch",
    [
        [([1], 6, [3, 9])],  # one decode
        [([1], 6, [3, 9]), ([2], 0, [5]), ([3], 12, [7, 1, 8, 2])],  # decodes, one at position 0
        [([1] * 20, 3, [3, 9, 4, 6, 10, 11]), ([2], 8, [0, 13, 14])],  # a chunk over two tiles + a decode
    ],
)
def test_static_flex_plan_lists_flexbackends_blocks(batch):
    lists = _step(batch)
    step = pad_step(bucket_for(len(lists[0]), BUCKETS) or 0, *lists)
    layout = StaticLayout(step.bucket, max_blocks=8)
    buf = np.full(layout.size, -7, dtype=np.int64)
    used = fill_flex_plan(buf, layout, step, BS)
    assert used == layout.span("kv_idx")[0] + max(c for c, _ in _reference_tiles(step, BS)) * step.bucket

    def field(name: str) -> np.ndarray:
        s, n = layout.span(name)
        return buf[s : s + n]

    ref = _reference_tiles(step, BS)
    kv_num, kv_idx = field("kv_num"), field("kv_idx").reshape(8, step.bucket).T
    assert len(ref) <= step.bucket
    for k, (count, blocks) in enumerate(ref):
        assert kv_num[k] == count and list(kv_idx[k, :count]) == blocks
    # unused tiles repeat the last used one
    assert all(kv_num[k] == ref[-1][0] for k in range(len(ref), step.bucket))
    # every token is answered by a query row fed by that token, at its position
    q_src, q_pos, q_lim, out_rows = field("q_src"), field("q_pos"), field("q_lim"), field("out_rows")
    assert list(q_src[out_rows]) == list(range(step.bucket))
    assert list(q_pos[out_rows]) == step.positions and list(q_lim[out_rows]) == step.positions
    assert len(q_src) == step.bucket * Q_BLOCK and (q_src >= 0).all() and (q_src < step.bucket).all()
    with pytest.raises(ValueError):
        fill_flex_plan(buf, StaticLayout(step.bucket, max_blocks=1), step, BS)


def _emulated_flex(q, k, v, block_mask, scale, enable_gqa, kernel_options):
    """What FlexAttention's kernel computes, densely: each query tile sees the slots of the blocks its list
    names (kv_num / kv_indices, as the BlockMask holds them), there where mask_mod holds; nothing else.
    (Uncompiled flex evaluates mask_mod over every block instead, which is exact only inside the listed
    ones: engine.model.attention.flex.)"""
    num, idx = block_mask.kv_num_blocks[0, 0], block_mask.kv_indices[0, 0]
    rows, slots = q.shape[2], k.shape[2]
    q_block, kv_block = block_mask.BLOCK_SIZE
    listed = torch.zeros(rows // q_block, slots // kv_block, dtype=torch.bool)
    for t in range(listed.shape[0]):
        listed[t, idx[t, : num[t]].long()] = True
    listed = listed.repeat_interleave(q_block, 0).repeat_interleave(kv_block, 1)
    q_idx, kv_idx = torch.arange(rows)[:, None], torch.arange(slots)[None, :]
    allowed = listed & block_mask.mask_mod(0, 0, q_idx, kv_idx)
    return torch.nn.functional.scaled_dot_product_attention(
        q, k, v, attn_mask=allowed[None, None], scale=scale, enable_gqa=enable_gqa
    )


def test_static_flex_path_matches_the_engines_attention_on_cpu(runner: ModelRunner):
    """The whole static path (staging, the device-side prepare, the BlockMask over static tensors, block
    positions) on CPU, with the kernel emulated: the logits of the engine's own attention, within rounding."""
    prompts = {"a": [3, 17, 29, 4, 8, 60, 2], "b": [9, 9, 1]}
    tables = {"a": [40, 3, 17, 22], "b": [8, 0, 5, 60]}
    _prefill(runner, prompts, tables)
    nb = runner.num_blocks
    static = StaticFlexAttention(runner.device, nb, BS, max(BUCKETS) * Q_BLOCK, compile=False)
    static._flex = _emulated_flex
    graphs = GraphRunner(
        runner.model, runner.kv_store.k_caches, runner.kv_store.v_caches, static, BS, 64, BUCKETS
    )
    # a's context grows to 8 first (so the step below reads a written cache), then a step with longer block
    # lists in the same bucket: the next step's copy stops before their tails, which must be ignored.
    _unpadded(runner, _step([([5], 7, tables["a"])]))
    longer = _step([([7, 8, 9, 10, 11], 8, tables["a"])])
    got_longer = graphs.run(pad_step(8, *longer))[:1].clone()
    torch.testing.assert_close(got_longer, _unpadded(runner, longer), rtol=1e-5, atol=1e-5)
    lists = _step([([6], 13, tables["a"]), ([12, 13, 14, 15, 16], 3, tables["b"])])
    bucket = graphs.bucket(len(lists[0]), max(lists[5]))
    assert bucket == 8
    got = graphs.run(pad_step(bucket, *lists))[:2]
    torch.testing.assert_close(got, _unpadded(runner, lists), rtol=1e-5, atol=1e-5)
    # A context past the plan's width runs eagerly instead.
    assert graphs.bucket(1, 65) is None


@pytest.mark.cuda
def test_graph_replay_gives_the_eager_padded_runs_bits_on_cuda(tiny_model):
    """On CUDA: the runner captures every bucket; a replay gives the bits of the same padded step run
    eagerly; greedy tokens through execute() match --enforce-eager's. (Untested on a GPU so far.)"""
    from test_model_runner import Driver

    from engine.sampling_params import SamplingParams

    tiny = tiny_model("llama")

    def make(eager: bool) -> ModelRunner:
        cfg = EngineConfig(
            model=str(tiny.path),
            device="cuda",
            dtype="float32",
            block_size=16,
            num_blocks=64,
            enforce_eager=eager,
        )
        return ModelRunner(cfg)

    runner = make(False)
    assert runner.graphs is not None and sorted(runner.graphs.captured) == list(BUCKETS)
    graphs = runner.graphs
    lists = _step_bs16([([5], 7, [3]), ([12, 13, 14], 3, [9])])
    step = pad_step(8, *lists)
    replayed = graphs.run(step)[:2].clone()
    bk = graphs._buckets[8]
    eager = graphs._forward(bk)[:2]
    assert torch.equal(replayed, eager)

    outs = []
    for eager_mode in (False, True):
        r = make(eager_mode)
        d = Driver(r, chunk=8)
        for i in range(5):
            d.add(f"r{i}", [1 + i, 7, 9, 11 + i, 3], SamplingParams(temperature=0.0, max_tokens=8))
        for _ in range(10):
            d.step()
        outs.append({k: v["out"] for k, v in d.reqs.items()})
    assert outs[0] == outs[1]


def _step_bs16(batch):
    ids, pos, slots, rows = [], [], [], []
    for new, start, table in batch:
        rows.append(len(ids) + len(new) - 1)
        ids += new
        pos += range(start, start + len(new))
        slots += slot_ids(table, start, start + len(new), 16)
    return (
        ids,
        pos,
        slots,
        rows,
        [len(n) for n, _, _ in batch],
        [s + len(n) for n, s, _ in batch],
        [t for _, _, t in batch],
    )


def test_runner_with_a_graph_runner_gives_the_same_outputs_on_cpu(tiny_model):
    """The runner's CUDA-only wiring (`_graphed`, the padded run, sampling from the padded logits), exercised
    on CPU by handing a CPU runner a GraphRunner over its own attention: every step's tokens and logprobs are
    those of the plain runner (steps over 64 tokens and prompt-logprob steps still run eagerly)."""
    from test_model_runner import Driver

    from engine.sampling_params import SamplingParams

    tiny = tiny_model("llama")

    def make(graphed: bool) -> ModelRunner:
        cfg = EngineConfig(model=str(tiny.path), device="cpu", dtype="float32", block_size=BS, num_blocks=96)
        r = ModelRunner(cfg)
        if graphed:
            kv = r.kv_store
            r.graphs = GraphRunner(r.model, kv.k_caches, kv.v_caches, r.attn_backend, BS, 256, BUCKETS)
            run = r.graphs.run

            def counted(step: PaddedStep) -> torch.Tensor:
                buckets_run.append(step.bucket)
                return run(step)

            r.graphs.run = counted  # type: ignore[method-assign]
        return r

    buckets_run: list[int] = []
    results = []
    for graphed in (False, True):
        drv = Driver(make(graphed), chunk=70, seed=3)
        prompt = [(7 * i) % 120 + 1 for i in range(75)]
        drv.add("long", prompt, SamplingParams(temperature=0.0, logprobs=2), max_len=96)
        drv.add("seeded", [3, 4, 5], SamplingParams(temperature=0.8, seed=11, logprobs=1))
        drv.add("greedy", [9, 8, 7, 6, 5], SamplingParams(temperature=0.0), max_len=32)
        drv.add("prompt_lp", [1, 2, 3, 4], SamplingParams(temperature=0.0, prompt_logprobs=1), max_len=32)
        steps = []
        for i in range(8):
            if i == 3:
                drv.reqs.pop("prompt_lp")  # later steps have no prompt logprobs left: graphed where short
            result = drv.step()
            steps.append((dict(result.logprobs), result.errors))
        results.append((steps, {k: r["out"] for k, r in drv.reqs.items()}))
    assert results[0] == results[1]
    # all but the first step (82 tokens) ran padded: 8 tokens, then 3 or 4 (bucket 4)
    assert len(buckets_run) == 7 and set(buckets_run) == {4, 8}
