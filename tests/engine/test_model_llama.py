"""Our Llama-family model against transformers on tiny random checkpoints (float32, same weights).

Every architecture is checked for (a) a whole prompt, (b) the prompt in chunks across calls, (c) a prompt
whose first blocks come from an earlier request's cache (and from a request computing them in the same
step), and (d) batched decode steps of requests with different lengths, mixed with prefills. Block tables
come from a shuffled free list, so they are never contiguous.
"""

from __future__ import annotations

import random

import pytest
import torch

from engine.model.attention.chooser import select_backend
from engine.model.loading.loader import load_model
from engine.model.models.context import ForwardContext

TOL = dict(atol=2e-4, rtol=2e-4)


@pytest.fixture
def setup(arch, tiny_model, paged):
    tiny = tiny_model(arch)
    model = load_model(tiny.path, torch.device("cpu"), torch.float32)
    return tiny, paged(model)


def _tokens(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(128) for _ in range(n)]


def test_whole_prompt(setup):
    tiny, run = setup
    prompt = _tokens(23, 1)
    (ours,) = run.step([(prompt, 0, run.table_for(23))])
    torch.testing.assert_close(ours, tiny.logits(prompt), **TOL)


def test_prompt_in_chunks(setup):
    tiny, run = setup
    prompt = _tokens(23, 2)
    table = run.table_for(23)
    got, start = [], 0
    for n in (7, 9, 7):  # chunk boundaries fall inside blocks (block size 4)
        (logits,) = run.step([(prompt[start : start + n], start, table)])
        got.append(logits)
        start += n
    torch.testing.assert_close(torch.cat(got), tiny.logits(prompt), **TOL)


def test_prefix_from_cache_of_earlier_request(setup):
    tiny, run = setup
    first = _tokens(19, 3)
    table_a = run.table_for(19)
    run.step([(first, 0, table_a)])
    # Second request: same first 12 tokens (3 full blocks), then its own; reuses A's blocks for them.
    second = first[:12] + _tokens(9, 4)
    table_b = table_a[:3] + run.alloc(3)
    (ours,) = run.step([(second[12:], 12, table_b)])
    torch.testing.assert_close(ours, tiny.logits(second)[12:], **TOL)


def test_prefix_computed_by_another_request_in_the_same_step(setup):
    tiny, run = setup
    first = _tokens(14, 5)
    second = first[:8] + _tokens(10, 6)
    table_a = run.table_for(14)
    table_b = table_a[:2] + run.alloc(3)
    # B reads blocks that A writes in this very step: K/V of the whole batch is written before attention.
    ours_a, ours_b = run.step([(first, 0, table_a), (second[8:], 8, table_b)])
    torch.testing.assert_close(ours_a, tiny.logits(first), **TOL)
    torch.testing.assert_close(ours_b, tiny.logits(second)[8:], **TOL)


def test_batched_decode_of_different_lengths(setup):
    tiny, run = setup
    seqs = [_tokens(n, 10 + n) for n in (3, 11, 6, 18)]
    tables = [run.table_for(len(s) + 3) for s in seqs]
    run.step([(s, 0, t) for s, t in zip(seqs, tables, strict=True)])
    for step in range(3):
        new = [_tokens(1, 100 * step + i)[0] for i in range(len(seqs))]
        outs = run.step([([tok], len(s), t) for s, tok, t in zip(seqs, new, tables, strict=True)])
        for s, tok, out in zip(seqs, new, outs, strict=True):
            s.append(tok)
            torch.testing.assert_close(out[0], tiny.logits(s)[-1], **TOL)


def test_mixed_step_decode_chunk_and_fresh_prefill(setup):
    tiny, run = setup
    a, b, c = _tokens(9, 20), _tokens(17, 21), _tokens(7, 22)
    ta, tb, tc = run.table_for(10), run.table_for(17), run.table_for(7)
    run.step([(a, 0, ta), (b[:5], 0, tb)])
    a.append(3)
    dec, chunk, fresh = run.step([([3], 9, ta), (b[5:], 5, tb), (c, 0, tc)])
    torch.testing.assert_close(dec[0], tiny.logits(a)[-1], **TOL)
    torch.testing.assert_close(chunk, tiny.logits(b)[5:], **TOL)
    torch.testing.assert_close(fresh, tiny.logits(c), **TOL)


def test_logits_only_for_requested_rows(arch, tiny_model):
    from attention_helpers import build_metadata

    tiny = tiny_model(arch)
    model = load_model(tiny.path, torch.device("cpu"), torch.float32)
    cfg = model.cfg
    k = [torch.zeros(8, 4, cfg.num_kv_heads, cfg.head_dim) for _ in range(cfg.num_layers)]
    v = [torch.zeros_like(x) for x in k]
    p1, p2 = _tokens(5, 30), _tokens(6, 31)
    meta = build_metadata([0, 0], [5, 6], [[3, 1], [6, 0]], 4, torch.device("cpu"))
    backend = select_backend(torch.device("cpu"), 8, 4, head_dim=cfg.head_dim)
    positions = torch.tensor([*range(5), *range(6)])
    ctx = ForwardContext.for_step(backend, meta, positions, k, v, torch.tensor([4, 10]))
    logits = model(torch.tensor(p1 + p2), ctx)
    assert logits.shape == (2, cfg.vocab_size) and logits.dtype == torch.float32
    torch.testing.assert_close(logits[0], tiny.logits(p1)[-1], **TOL)
    torch.testing.assert_close(logits[1], tiny.logits(p2)[-1], **TOL)


def test_sliding_window_is_applied(tiny_model, paged):
    # The windowed Mistral must differ from the same weights attending to everything: the test above
    # would otherwise pass for a model that ignores the window.
    tiny = tiny_model("mistral_window")
    model = load_model(tiny.path, torch.device("cpu"), torch.float32)
    assert set(model.cfg.sliding_windows) == {6}
    prompt = _tokens(20, 40)
    run = paged(model)
    (windowed,) = run.step([(prompt, 0, run.table_for(20))])
    for layer in model.layers:
        layer.self_attn.sliding_window = None
    (full,) = run.step([(prompt, 0, run.table_for(20))])
    torch.testing.assert_close(windowed[:6], full[:6], **TOL)
    assert (windowed[6:] - full[6:]).abs().max() > 1e-3
