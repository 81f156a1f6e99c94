"""The decoder layers as one native call (engine/model/native_stack.py): the same bits as the layers run one
kernel call at a time from Python, on a tiny Llama quantized by gguf-py and on the default model (slow), and
the cases where it steps aside. Each failure names the CPU (isa_summary)."""

from __future__ import annotations

import logging

import pytest
import torch
from kernel_helpers import kernels_or_skip

from engine.model.attention.native import NativeBackend
from engine.model.kernels import build as native_kernels
from engine.model.kernels.invariance import isa_summary
from engine.model.layers.quant_linear import (
    GGML_Q4_0,
    GGML_Q4_1,
    GGML_Q5_0,
    GGML_Q5_1,
    GGML_Q8_0,
    QuantLinear,
)
from engine.model.models.native_stack import NativeStack

KINDS = (GGML_Q4_1, GGML_Q8_0, GGML_Q4_0, GGML_Q5_0, GGML_Q5_1)
LINEARS = (("self_attn", "qkv_proj"), ("self_attn", "o_proj"), ("mlp", "gate_up_proj"), ("mlp", "down_proj"))


def _kernels() -> native_kernels.Kernels:
    return kernels_or_skip("decoder_stack", "the kernels the stack chains")


def _quantized_tiny(tiny_model, dtype: torch.dtype, kernels: native_kernels.Kernels):
    """The tiny Llama with every linear quantized by gguf-py (the 32-weight types in turn) and the native
    attention: a model the stack runs. Layer 0's q/k/v is of mixed parts, as a Q4_K_M file's often are
    (Q4_0 for q and k, Q5_1 for v)."""
    from gguf import quants

    from engine.model.loading.loader import load_model

    model = load_model(tiny_model("llama").path, torch.device("cpu"), dtype, pack=False)
    cfg = model.cfg
    for i, layer in enumerate(model.layers):
        for j, (owner_name, attr) in enumerate(LINEARS):
            owner = getattr(layer, owner_name)
            lin = getattr(owner, attr)
            w = lin.weight.detach().float().numpy()
            if i == 0 and attr == "qkv_proj":
                qk = (cfg.num_heads + cfg.num_kv_heads) * cfg.head_dim
                parts = [(GGML_Q4_0, quants.quantize(w[:qk], GGML_Q4_0))]
                parts.append((GGML_Q5_1, quants.quantize(w[qk:], GGML_Q5_1)))
                setattr(owner, attr, QuantLinear.of_parts(kernels, parts, lin.in_features, lin.bias))
                continue
            kind = KINDS[(i + j) % len(KINDS)]
            raw = quants.quantize(w, kind)
            setattr(owner, attr, QuantLinear(kernels, kind, raw, lin.in_features, lin.bias))
    return model


def _steps(
    paged_cls, model, stack: NativeStack | None, kv_dtype: torch.dtype | None = None
) -> list[torch.Tensor]:
    """A chunked prefill, a second request starting on the first's blocks in the same step, then decodes:
    every new token's logits, with the native attention (and the stack, where given), over a cache of
    `kv_dtype` (default: the model's)."""
    p = paged_cls(model, block_size=16, backend=NativeBackend(_kernels()), stack=stack, kv_dtype=kv_dtype)
    a = [(5 * i + 3) % 128 for i in range(45)]
    ta, tb = p.table_for(64), p.table_for(64)
    b = a[:32] + [7, 8, 9]
    out = p.step([(a[:20], 0, ta)])
    out += p.step([(a[20:], 20, ta), (b[32:], 32, ta[:2] + tb[2:])])
    for n in range(3):  # decode: one token each
        out += p.step([([n + 1], 45 + n, ta), ([n + 2], 35 + n, ta[:2] + tb[2:])])
    return out


@pytest.mark.parametrize(
    "dtype,kv_dtype",
    [(torch.float32, None), (torch.bfloat16, None), (torch.float32, torch.float16)],
    ids=["float32", "bfloat16", "float32-kv-float16"],
)
def test_the_stack_gives_the_bits_of_the_layers_run_from_python(tiny_model, paged, dtype, kv_dtype):
    kernels = _kernels()
    model = _quantized_tiny(tiny_model, dtype, kernels)
    stack, why = NativeStack.build(model, NativeBackend(kernels))
    assert stack is not None, why
    ran: list[bool] = []  # the stack took every step (None: it stepped aside to the Python layers)
    run = stack.run
    stack.run = lambda *a: ran.append((out := run(*a)) is not None) or out  # type: ignore[method-assign]
    with_stack = _steps(paged, model, stack, kv_dtype)
    assert ran and all(ran), ran
    from_python = _steps(paged, model, None, kv_dtype)
    if kv_dtype is not None:  # a float16 cache rounds K and V: not the float32 cache's logits
        assert not torch.equal(with_stack[-1], _steps(paged, model, stack)[-1])
    assert len(with_stack) == len(from_python) == 1 + 2 + 3 * 2
    for i, (a, b) in enumerate(zip(with_stack, from_python, strict=True)):
        assert torch.equal(a, b), f"step output {i} differs; {isa_summary()}"
    assert not torch.equal(with_stack[0], with_stack[1][: with_stack[0].shape[0]])  # not a constant


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_the_last_layer_runs_only_the_rows_the_step_wants_with_their_bits(
    tiny_model, paged, dtype, monkeypatch
):
    """A step that wants the logits of some rows only (a prompt's last row, none for a chunk of it, a verify
    chunk's drafts beside another request's row) runs the stack's last layer past the keys and values for those
    rows alone: their logits have the bits of the Python layers, which run every row, and the caches hold the
    same keys and values afterwards. Rows that are all of the step's, or out of order (prompt logprobs after
    the sampling rows), run every row."""
    from engine.model.models import native_stack

    kernels = _kernels()
    model = _quantized_tiny(tiny_model, dtype, kernels)
    stack, why = NativeStack.build(model, NativeBackend(kernels))
    assert stack is not None, why
    kept: list[list[int] | None] = []
    real = native_stack._kept_rows
    monkeypatch.setattr(native_stack, "_kept_rows", lambda rows, t: kept.append(k := real(rows, t)) or k)
    a = [(5 * i + 3) % 128 for i in range(48)]
    b = [(7 * i + 2) % 128 for i in range(16)]

    def run(s: NativeStack | None) -> tuple[list[torch.Tensor], object]:
        p = paged(model, block_size=16, backend=NativeBackend(kernels), stack=s)
        ta, tb = p.table_for(64), p.table_for(32)
        steps = [
            ([(a[:20], 0, ta)], []),  # a prompt's first chunk: no row
            ([(a[20:40], 20, ta), (b[:13], 0, tb)], [19, 32]),  # each request's last row
            (
                [(a[40:45], 40, ta), (b[13:14], 13, tb)],
                [1, 2, 3, 4, 5],
            ),  # drafts, then the other request's row
            ([(a[45:46], 45, ta), (b[14:15], 14, tb)], [0, 1]),  # a decode: every row
            ([(a[46:48], 46, ta), (b[15:16], 15, tb)], [1, 2, 0]),  # out of order
        ]
        return [p.step_rows(batch, rows) for batch, rows in steps], p

    with_stack, p_stack = run(stack)
    assert kept == [[], [19, 32], [1, 2, 3, 4, 5], None, None], kept
    from_python, p_python = run(None)
    assert [x.shape[0] for x in with_stack] == [0, 2, 5, 2, 3]
    for i, (x, y) in enumerate(zip(with_stack, from_python, strict=True)):
        assert torch.equal(x, y), f"step {i}: {isa_summary()}"
    for layer in range(model.cfg.num_layers):
        assert torch.equal(p_stack.k[layer], p_python.k[layer]) and torch.equal(
            p_stack.v[layer], p_python.v[layer]
        )
    assert not torch.equal(with_stack[2][0], with_stack[2][4])  # not a constant


@pytest.mark.parametrize("use_stack", [True, False], ids=["stack", "python"])
def test_a_step_run_between_two_layers_changes_no_bit_of_either(tiny_model, paged, use_stack):
    """The engine's express steps (engine.express) run inside another step's forward, between two of its
    layers: the outer step's results must be those of the same step run straight through, and the inner
    step's those of it run alone, with the stack (one call per layer, re-entered) and from Python."""
    kernels = _kernels()
    model = _quantized_tiny(tiny_model, torch.float32, kernels)
    stack = NativeStack.build(model, NativeBackend(kernels))[0] if use_stack else None
    assert stack is not None or not use_stack
    outer_tokens = [(7 * i + 1) % 128 for i in range(24)]
    inner_tokens = [(3 * i + 5) % 128 for i in range(9)]

    def runs() -> tuple[paged, paged]:
        outer = paged(model, block_size=16, backend=NativeBackend(kernels), stack=stack)
        inner = paged(model, block_size=16, backend=NativeBackend(kernels), stack=stack, seed=1)
        return outer, inner

    outer, inner = runs()
    straight = outer.step([(outer_tokens, 0, outer.table_for(24))])
    alone = inner.step([(inner_tokens, 0, inner.table_for(9))])
    outer, inner = runs()
    inner_table = inner.table_for(9)
    nested: list[list[torch.Tensor]] = []
    calls = []

    def hook() -> None:
        calls.append(len(calls))
        if len(calls) == 1:  # one inner step, at the first pause; the later pauses only count
            nested.append(inner.step([(inner_tokens, 0, inner_table)]))

    interrupted = outer.step([(outer_tokens, 0, outer.table_for(24))], hook)
    assert len(calls) == model.cfg.num_layers - 1  # between every two layers, never before or after
    assert torch.equal(interrupted[0], straight[0]), isa_summary()
    assert torch.equal(nested[0][0], alone[0]), isa_summary()
    assert not torch.equal(straight[0][:9], alone[0])  # two different steps, not a constant


def test_a_step_that_wants_one_row_keeps_its_bits_when_another_step_runs_between_its_layers(
    tiny_model, paged
):
    """The stack run one call per layer (the express hook) with the last layer on the logits rows only: the
    kept row's logits are those of the step run straight through, and the inner step, which wants its own
    last row, gets the logits it gets alone. (Against the logits of every row this tiny model's dense head,
    unpacked, is a torch matmul whose bits depend on its row count: the first test compares the stack with the
    Python layers on the same rows instead.)"""
    kernels = _kernels()
    model = _quantized_tiny(tiny_model, torch.float32, kernels)
    stack = NativeStack.build(model, NativeBackend(kernels))[0]
    assert stack is not None
    outer_tokens = [(7 * i + 1) % 128 for i in range(24)]
    inner_tokens = [(3 * i + 5) % 128 for i in range(9)]

    def fresh(seed: int = 0):  # type: ignore[no-untyped-def]
        return paged(model, block_size=16, backend=NativeBackend(kernels), stack=stack, seed=seed)

    p = fresh()
    straight = p.step_rows([(outer_tokens, 0, p.table_for(24))], [23])
    q = fresh(1)
    alone = q.step_rows([(inner_tokens, 0, q.table_for(9))], [8])
    p, q = fresh(), fresh(1)
    q_table = q.table_for(9)
    nested: list[torch.Tensor] = []

    def hook() -> None:
        if not nested:
            nested.append(q.step_rows([(inner_tokens, 0, q_table)], [8]))

    interrupted = p.step_rows([(outer_tokens, 0, p.table_for(24))], [23], hook)
    assert straight.shape[0] == 1 and torch.equal(interrupted, straight), isa_summary()
    assert torch.equal(nested[0], alone), isa_summary()
    assert not torch.equal(straight[0], alone[0])  # two different steps, not a constant


def test_the_stack_reuses_its_scratch_and_a_reused_buffer_changes_no_bit(tiny_model, paged):
    """The stack keeps its step scratch (a 2,000-token prefill's is ~60 MiB, which malloc would map afresh,
    page fault by page fault, every step): a new buffer's rows are rounded up (here to 8), a later step takes the
    smallest kept buffer it fits in, a step run inside another's takes its own, at most two are kept, and the
    outputs are those of a stack that never ran before."""
    kernels = _kernels()
    model = _quantized_tiny(tiny_model, torch.float32, kernels)
    reused, fresh = (NativeStack.build(model, NativeBackend(kernels))[0] for _ in range(2))
    assert reused is not None and fresh is not None
    reused._ROWS = 8  # the tiny model's positions end long before the default's 256
    long, short = [(7 * i + 1) % 128 for i in range(24)], [(3 * i + 5) % 128 for i in range(9)]

    def step(stack: NativeStack, tokens: list[int], hook=None) -> torch.Tensor:  # type: ignore[no-untyped-def]
        p = paged(model, block_size=16, backend=NativeBackend(kernels), stack=stack)
        return p.step([(tokens, 0, p.table_for(len(tokens)))], hook)[0]

    def kept() -> list[tuple[int, int]]:
        return [(b.data_ptr(), b.numel()) for b in reused._spare]

    assert torch.equal(step(reused, long[:20]), step(fresh, long[:20]))
    ((big, rows_x_width),) = kept()
    assert rows_x_width % 24 == 0 and rows_x_width // 24 > 100  # 24 rows (20 rounded up) of every buffer
    assert torch.equal(step(reused, long), step(fresh, long)), isa_summary()  # a longer step, the same buffer
    assert torch.equal(step(reused, short), step(fresh, short))  # a short one too
    assert kept() == [(big, rows_x_width)]
    inner: list[torch.Tensor] = []
    outer = step(reused, long, lambda: inner.append(step(reused, short)) if not inner else None)
    assert torch.equal(outer, step(fresh, long)) and torch.equal(inner[0], step(fresh, short))
    assert len(kept()) == 2 and kept()[0] == (big, rows_x_width)  # the inner step's own buffer, kept beside
    small = kept()[1]
    assert small[1] == rows_x_width // 24 * 16  # 16 rows
    assert torch.equal(step(reused, short), step(fresh, short))  # the smallest that fits: the inner one's
    assert kept() == [(big, rows_x_width), small]
    assert not torch.equal(outer[:9], inner[0])  # two different steps, not a constant


def test_the_stack_steps_aside_where_a_piece_has_no_kernel(tiny_model, caplog):
    kernels = _kernels()
    from engine.config import EngineConfig
    from engine.model.attention.sdpa import SdpaBackend
    from engine.model.loading.loader import load_model
    from engine.model_runner import ModelRunner

    native = NativeBackend(kernels)
    dense = load_model(tiny_model("llama").path, torch.device("cpu"), torch.float32)
    assert NativeStack.build(dense, native) == (None, "dense linears")
    quantized = _quantized_tiny(tiny_model, torch.float32, kernels)
    assert NativeStack.build(quantized, SdpaBackend(torch.device("cpu"))) == (None, "attention backend sdpa")
    qwen3 = load_model(tiny_model("qwen3").path, torch.device("cpu"), torch.float32)
    assert NativeStack.build(qwen3, native) == (None, "q/k norms")
    # The runner says which path runs, and --enforce-eager keeps the Python one.
    path = str(tiny_model("llama").path)
    with caplog.at_level(logging.INFO, logger="engine.model_runner"):
        runner = ModelRunner(EngineConfig(model=path, device="cpu", num_blocks=8, enforce_eager=True))
    assert runner.layer_stack is None and "layers from Python (--enforce-eager)" in caplog.text


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_default_model_runs_its_layers_in_one_call_with_the_same_bits(dtype, caplog):
    _kernels()
    from engine.config import EngineConfig
    from engine.errors import ModelNotFoundError
    from engine.model.loading.files import resolve_model
    from engine.model_runner import ModelRunner
    from engine.outputs import ScheduledRequest, SchedulerOutput
    from engine.sampling_params import SamplingParams

    try:
        path = str(resolve_model(None).path)
    except ModelNotFoundError as exc:
        pytest.skip(f"default model not available here: {exc}")
    with caplog.at_level(logging.INFO, logger="engine.model_runner"):
        runner = ModelRunner(EngineConfig(model=path, device="cpu", dtype=dtype, num_blocks=16))
    assert "layers in one native call per step" in caplog.text
    stack = runner.layer_stack
    assert stack is not None
    greedy = SamplingParams(temperature=0.0)
    prompt = [1, 504, 3458, 282, 4649, 314, 2385, 30] * 5

    def req(rid: str, tokens: list[int], start: int, blocks: list[int]) -> ScheduledRequest:
        return ScheduledRequest(rid, tokens[start:], start, blocks, True, greedy, tokens, len(tokens), 0)

    steps = [
        [req("a", prompt, 0, [3, 1, 4])],
        [req("a", [*prompt, 11], 40, [3, 1, 4]), req("b", prompt[:37], 32, [3, 1, 9])],
    ]
    for scheduled in steps:
        step = runner._prepare(scheduled)
        runner.layer_stack = stack
        one_call = runner._run(step)
        runner.layer_stack = None
        from_python = runner._run(step)
        assert torch.equal(one_call, from_python), isa_summary()
        runner.execute(SchedulerOutput(scheduled, sum(len(s.new_token_ids) for s in scheduled)))
