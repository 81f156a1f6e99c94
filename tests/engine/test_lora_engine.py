"""LoRA adapters on the real default model (its GGUF's Q4_1/Q8_0 weights run as stored), through the engine:

- the delta is added to the quantized linear's output: a wrapped layer gives the quantized product plus
  x A^T (s B)^T, against a float64 reference;
- batch invariance: requests under the base model and two adapters, sent at once, get exactly the tokens and
  logprobs each gets alone on a cold engine;
- cache identity: the same prompt under the base and an adapter shares no block; under one adapter it hits;
  the adapter reloaded with other weights under its name misses;
- an adapter unloaded while a request runs on it: the request finishes on the weights it started with, and
  a request added afterwards is refused.
"""

from __future__ import annotations

import asyncio

import pytest
import torch
from lora_helpers import default_model_shapes, write_adapter

from engine.async_engine import AsyncEngine
from engine.config import EngineConfig
from engine.lora.peft_format import LoRAError
from engine.model.layers.lora import LoRALinear
from engine.model.layers.quant_linear import QuantLinear
from engine.request import Origin
from engine.sampling_params import SamplingParams
from kv_cache.namespace import CacheNamespace

BLOCK = 16
PROMPT = list(range(1000, 1040))  # 2.5 blocks


@pytest.fixture(scope="module")
def adapters(tmp_path_factory):
    root = tmp_path_factory.mktemp("loras")
    layers, shapes = default_model_shapes()
    return {
        name: write_adapter(root / name, layers, shapes, seed=seed, std=0.05)
        for name, seed in (("a", 1), ("b", 2), ("a2", 3))
    }


def make_engine(adapters, **kw) -> AsyncEngine:
    mods = [(n, str(adapters[n])) for n in ("a", "b")]
    return AsyncEngine.from_config(
        EngineConfig(device="cpu", dtype="float32", num_blocks=96, enable_lora=True, lora_modules=mods, **kw)
    )


@pytest.fixture(scope="module")
def engine(adapters):
    eng = make_engine(adapters)
    yield eng
    assert eng.num_used_blocks() == 0
    eng.shutdown()


def params(max_tokens: int = 6) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, logprobs=2, ignore_eos=True)


def ns(eng: AsyncEngine, name: str | None) -> CacheNamespace | None:
    return None if name is None else CacheNamespace(lora=eng.loras.get(name).key)


async def answer(eng, prompt, name, max_tokens=6):
    tokens, lps, cached, error = [], [], None, None
    async for out in eng.generate(list(prompt), params(max_tokens), origin=Origin(ns(eng, name))):
        cached = out.num_cached_tokens if cached is None else cached
        for c in out.outputs:
            tokens += c.token_ids
            lps += [(lp.logprob, tuple(lp.top)) for lp in c.logprobs or []]
            error = error or (c.finish_reason.name if c.finish_reason is not None else None)
    return tuple(tokens), tuple(lps), cached


def test_startup_names_the_python_layer_path(engine):
    runner = engine._core.runner
    assert runner.lora is not None and runner.layer_stack is None
    layer = runner.model.layers[0].self_attn.qkv_proj
    assert isinstance(layer, LoRALinear) and isinstance(layer.base, QuantLinear)


def test_delta_is_added_to_the_quantized_output(engine):
    runner = engine._core.runner
    adapter = engine.loras.get("a")
    layer = runner.model.layers[3].mlp.gate_up_proj
    x = torch.randn(5, 576, generator=torch.Generator().manual_seed(0))
    base = layer.base(x)
    rows = torch.tensor([1, 3])
    layer.step.groups = [(adapter, rows)]
    try:
        got = layer(x)
    finally:
        layer.step.groups = []
    a_g, b_g = (t.double() for t in adapter_weights(adapter, 3, "gate_proj"))
    a_u, b_u = (t.double() for t in adapter_weights(adapter, 3, "up_proj"))
    want = base.double().clone()
    want[rows, :1536] += x[rows].double() @ a_g.T @ b_g.T
    want[rows, 1536:] += x[rows].double() @ a_u.T @ b_u.T
    torch.testing.assert_close(got.double(), want, atol=1e-4, rtol=1e-4)
    assert torch.equal(got[[0, 2, 4]], base[[0, 2, 4]])  # rows without the adapter: untouched bits
    assert (got[rows] - base[rows]).abs().max() > 1e-2  # and the delta is not negligible


def adapter_weights(adapter, layer, target):
    """(A, s B) as the adapter's files hold them, read back from the delta's packed products."""
    from safetensors.torch import load_file

    tensors = load_file(f"{adapter.path}/adapter_model.safetensors")
    part = "mlp" if target in ("gate_proj", "up_proj", "down_proj") else "self_attn"
    key = f"base_model.model.model.layers.{layer}.{part}.{target}"
    return tensors[f"{key}.lora_A.weight"], tensors[f"{key}.lora_B.weight"] * (16.0 / 8)


def test_mixed_batch_gives_every_request_its_solo_answer(engine, adapters):
    work = [
        (PROMPT, None),
        (PROMPT, "a"),
        (PROMPT[:23], "b"),
        ([7, 8, 9] * 9, "a"),
        ([7, 8, 9] * 9, None),
    ]
    cold = make_engine(adapters, enable_prefix_caching=False)
    try:
        alone = [asyncio.run(answer(cold, p, n))[:2] for p, n in work]
    finally:
        cold.shutdown()

    async def together():
        return await asyncio.gather(*(answer(engine, p, n) for p, n in work))

    got = [a[:2] for a in asyncio.run(together())]
    assert got == alone
    # The adapters change the answer: else this would not test which weights a row ran.
    assert len({alone[0][0], alone[1][0]}) == 2


def test_express_steps_inside_an_adapters_flood_give_every_request_its_solo_answer(adapters):
    """The express lane (engine.express) with LoRA: while 16 greedy streams on adapter "a" run, requests on
    adapter "b" and on the base model arrive and are served in express steps inside the flood's steps (the
    Python layers pause too). The step inside must hand the paused one back its own row groups: every flood
    stream and every newcomer gives its solo answer."""
    flood_prompt, flood_tokens = [5, 6, 7, 100], 32
    work = [(PROMPT, "b"), (PROMPT[:23], None)]
    cold = make_engine(adapters, enable_prefix_caching=False)
    try:
        alone = [asyncio.run(answer(cold, p, n))[:2] for p, n in work]
        flood_alone = asyncio.run(answer(cold, flood_prompt, "a", flood_tokens))[:2]
    finally:
        cold.shutdown()
    eng = make_engine(adapters, max_num_seqs=32)
    core = eng._core
    assert core.scheduler.express_enabled
    ran_inside: list[str] = []
    express_pass = core._express_pass

    def recording(in_flight, inside=False):  # the test's window on where each request ran
        outputs = express_pass(in_flight, inside)
        if inside:
            ran_inside.extend(o.request_id for o in outputs)
        return outputs

    core._express_pass = recording

    async def run():
        floods = [asyncio.create_task(answer(eng, flood_prompt, "a", flood_tokens)) for _ in range(16)]
        # The newcomers arrive once all 16 decode (a read of the step thread's list: only its length).
        while len(core.scheduler.running) < 16:
            await asyncio.sleep(0.005)
        got = await asyncio.gather(*(answer(eng, p, n) for p, n in work))
        return got, await asyncio.gather(*floods)

    try:
        got, floods = asyncio.run(run())
        assert [a[:2] for a in got] == alone
        assert all(f[:2] == flood_alone for f in floods)
        assert ran_inside  # some ran inside the flood's steps
        assert eng.num_used_blocks() == 0
    finally:
        eng.shutdown()


def test_cached_blocks_never_cross_adapters(engine, adapters):
    prompt = list(range(2000, 2050))
    assert asyncio.run(answer(engine, prompt, None))[2] == 0
    assert asyncio.run(answer(engine, prompt, "a"))[2] == 0  # the base model's blocks are not a's
    assert asyncio.run(answer(engine, prompt, "b"))[2] == 0
    assert asyncio.run(answer(engine, prompt, "a"))[2] == len(prompt)  # a's own blocks, tail and kept logits
    first = asyncio.run(answer(engine, prompt, "b"))
    # Reloaded under its name with other weights: a new fingerprint, so the old KV is never reused.
    engine.loras.load("b", str(adapters["a2"]), replace=True)
    try:
        again = asyncio.run(answer(engine, prompt, "b"))
        assert again[2] == 0 and again[0] != first[0]
    finally:
        engine.loras.load("b", str(adapters["b"]), replace=True)


def test_unload_while_running_finishes_on_the_adapter(engine, adapters):
    prompt = list(range(3000, 3030))
    want = asyncio.run(answer(engine, prompt, "a", max_tokens=24))[0]

    async def run():
        key = ns(engine, "a")
        stream = engine.generate(prompt, params(24), origin=Origin(key))
        tokens = []
        async for out in stream:
            for c in out.outputs:
                tokens += c.token_ids
            if tokens and engine.loras.get("a") is not None:
                assert engine.loras.unload("a")
        return tuple(tokens), key

    try:
        tokens, key = asyncio.run(run())
        assert engine.loras.get("a") is None
        assert tokens == want
        with pytest.raises(LoRAError):
            engine._core.runner.lora.resolve(key)
    finally:
        if engine.loras.get("a") is None:
            engine.loras.load("a", str(adapters["a"]))


def test_adapter_files_are_checked(engine, tmp_path, adapters):
    layers, shapes = default_model_shapes()
    with pytest.raises(LoRAError, match="rank 128 is above --max-lora-rank 64"):
        engine.loras.load("big", str(write_adapter(tmp_path / "big", 1, shapes, rank=128)))
    wrong = {**shapes, "q_proj": (576, 100)}
    with pytest.raises(LoRAError, match="do not fit"):
        engine.loras.load("wrong", str(write_adapter(tmp_path / "wrong", 1, wrong, targets=("q_proj",))))
    with pytest.raises(LoRAError, match="already loaded"):
        engine.loras.load("a", str(adapters["a"]))
    with pytest.raises(LoRAError, match="not a directory"):
        engine.loras.load("nowhere", str(tmp_path / "nowhere"))
    assert [a.name for a in engine.loras.adapters()] == ["a", "b"] or {
        a.name for a in engine.loras.adapters()
    } == {"a", "b"}
