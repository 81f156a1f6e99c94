"""Same answer beside other adapters: the invariance property test with LoRA adapters in the mix.

Hypothesis draws prompts that share random prefixes, each under the base model or one of two adapters, an
arrival stagger, a token budget small enough to chunk prompts, a KV pool tight enough to preempt, and prefix
caching on or off, on the real default model. Every request's token ids and logprobs (chosen and top-2) must
be exactly those of the same request run alone on a cold engine: its adapter's rows are the same beside
other adapters' rows and base rows, and base rows never change because of adapter neighbours.
"""

from __future__ import annotations

import asyncio
import random
from dataclasses import dataclass

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from lora_helpers import default_model_shapes, write_adapter

from engine.async_engine import AsyncEngine
from engine.config import EngineConfig
from engine.model.kernels.invariance import isa_summary
from engine.request import Origin
from engine.sampling_params import SamplingParams
from kv_cache.namespace import CacheNamespace

pytestmark = pytest.mark.slow

BLOCK = 16
MAX_TOKENS = 6
ADAPTERS = (None, "a", "b")


@dataclass(frozen=True, slots=True)
class Req:
    prompt: tuple[int, ...]
    seed: int | None  # None: greedy
    adapter: str | None

    def params(self) -> SamplingParams:
        if self.seed is None:
            return SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, logprobs=2, ignore_eos=True)
        return SamplingParams(
            max_tokens=MAX_TOKENS, temperature=0.9, seed=self.seed, logprobs=2, ignore_eos=True
        )


@pytest.fixture(scope="module")
def modules(tmp_path_factory) -> list[tuple[str, str]]:
    root = tmp_path_factory.mktemp("lora_prop")
    layers, shapes = default_model_shapes()
    return [
        (n, str(write_adapter(root / n, layers, shapes, seed=s, std=0.05))) for n, s in (("a", 1), ("b", 2))
    ]


def engine(dtype: str, modules, **kw) -> AsyncEngine:
    return AsyncEngine.from_config(
        EngineConfig(device="cpu", dtype=dtype, enable_lora=True, lora_modules=list(modules), **kw)
    )


async def answer(eng: AsyncEngine, req: Req, delay: float = 0.0):
    await asyncio.sleep(delay)
    ns = None if req.adapter is None else CacheNamespace(lora=eng.loras.get(req.adapter).key)
    tokens: list[int] = []
    lps: list = []
    async for out in eng.generate(list(req.prompt), req.params(), origin=Origin(ns)):
        for c in out.outputs:
            tokens += c.token_ids
            lps += [(lp.logprob, tuple(lp.top)) for lp in c.logprobs or []]
    return tuple(tokens), tuple(lps)


class Reference:
    def __init__(self, modules) -> None:
        self.modules = modules
        self.engines: dict[str, AsyncEngine] = {}
        self.answers: dict[tuple[str, Req], object] = {}

    def get(self, dtype: str, req: Req):
        if (dtype, req) not in self.answers:
            if dtype not in self.engines:
                self.engines[dtype] = engine(dtype, self.modules, num_blocks=64, enable_prefix_caching=False)
            self.answers[dtype, req] = asyncio.run(answer(self.engines[dtype], req))
        return self.answers[dtype, req]


@pytest.fixture(scope="module")
def reference(modules):
    ref = Reference(modules)
    yield ref
    for eng in ref.engines.values():
        assert eng.num_used_blocks() == 0
        eng.shutdown()


@st.composite
def workloads(draw):
    rng = random.Random(draw(st.integers(0, 2**32)))
    base = [rng.randrange(100, 49000) for _ in range(64)]
    reqs = []
    for _ in range(draw(st.integers(3, 5))):
        shared = draw(st.sampled_from([0, 5, 16, 31, 48, 64]))
        tail = [rng.randrange(100, 49000) for _ in range(draw(st.integers(1, 20)))]
        seed = draw(st.one_of(st.none(), st.integers(0, 1000)))
        reqs.append(Req(tuple(base[:shared] + tail), seed, draw(st.sampled_from(ADAPTERS))))
    delays = [draw(st.sampled_from([0.0, 0.0, 0.01, 0.05])) for _ in reqs]
    budget = draw(st.sampled_from([16, 24, 40, 2048]))
    longest = max(-(-(len(r.prompt) + MAX_TOKENS) // BLOCK) for r in reqs)
    blocks = draw(st.integers(longest + 1, longest + 12))
    return reqs, delays, budget, blocks, draw(st.booleans())


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@settings(max_examples=3, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(workload=workloads())
def test_every_request_answers_as_if_alone_beside_any_adapters(dtype, modules, reference, workload):
    reqs, delays, budget, blocks, caching = workload
    eng = engine(
        dtype,
        modules,
        num_blocks=blocks,
        max_num_batched_tokens=budget,
        max_num_seqs=4,
        enable_prefix_caching=caching,
    )
    try:

        async def all_at_once():
            return await asyncio.gather(*(answer(eng, r, d) for r, d in zip(reqs, delays, strict=True)))

        got = asyncio.run(all_at_once())
        assert eng.num_used_blocks() == 0
    finally:
        eng.shutdown()
    for i, (req, ans) in enumerate(zip(reqs, got, strict=True)):
        assert ans == reference.get(dtype, req), (
            f"request {i} of {len(reqs)} (adapter {req.adapter}, {len(req.prompt)} prompt tokens, seed "
            f"{req.seed}) differs from its cold solo run: budget {budget}, {blocks} blocks, caching {caching}; "
            f"{isa_summary()}"
        )
