"""Compiles tried in killable worker processes (engine.grammar_sandbox): a compile over the timeout is a
client error and its worker is killed, a compile whose request is gone is killed, errors keep their reason;
and through `AsyncEngine`: compiles get their own pool, keyed by the request's namespace, forgotten on resets,
and a caller that leaves kills its compile. Worker processes take a few seconds to start (xgrammar imports
torch), so one sandbox of one worker serves the module."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Iterator

import pytest
import xgrammar as xgr
from engine_fakes import ByteTokenizer, FakeRunner

from engine.async_engine import AsyncEngine
from engine.config import EngineConfig
from engine.engine_core import EngineCore
from engine.grammar_sandbox import CompileCancelled, CompileSandbox
from engine.request import Origin
from engine.sampling_params import SamplingParams
from engine.structured_output import GrammarCompiler, StructuredOutputError, StructuredOutputSpec
from kv_cache.namespace import CacheNamespace

VOCAB = ["<eos>", "{", "}", '"', ":", ",", " ", "[", "]", "a", "b", "ab", "1", "2", "12", "true", "x", "y"]
# ~2 s to compile on a 2-core EPYC, far more than the test's timeout.
SLOW = StructuredOutputSpec(
    "json_schema", json.dumps({"type": "string", "enum": [f"c{i}" for i in range(60000)]})
)
SMALL = StructuredOutputSpec("regex", "[xy]+1")


def _info() -> xgr.TokenizerInfo:
    return xgr.TokenizerInfo(VOCAB, vocab_type=xgr.VocabType.RAW, vocab_size=40, stop_token_ids=[0])


@pytest.fixture(scope="module")
def compiler() -> Iterator[GrammarCompiler]:
    sandbox = CompileSandbox(_info(), workers=1, timeout_s=0.3)
    sandbox.prestart()
    compiler = GrammarCompiler(_info(), sandbox=sandbox)
    yield compiler
    compiler.close()


def test_a_compile_over_the_timeout_is_a_client_error_and_its_worker_is_killed(
    compiler: GrammarCompiler,
) -> None:
    assert compiler.sandbox is not None
    kills = compiler.sandbox.kills
    with pytest.raises(StructuredOutputError, match="longer than 0.3 s to compile") as info:
        compiler.compile(SLOW)
    assert info.value.param == "response_format"
    assert compiler.sandbox.kills == kills + 1 and compiler.cached(SLOW) is None
    # The replacement worker serves the next compile; its start-up is not counted against the timeout.
    assert compiler.compile(SMALL).memory_bytes > 0


def test_a_compile_whose_request_is_gone_is_killed(compiler: GrammarCompiler) -> None:
    assert compiler.sandbox is not None
    compiler.compile(SMALL)  # a worker is up
    kills = compiler.sandbox.kills
    cancel = threading.Event()
    threading.Timer(0.1, cancel.set).start()
    start = time.monotonic()
    with pytest.raises(CompileCancelled):
        compiler.compile(StructuredOutputSpec(SLOW.kind, SLOW.spec + " "), cancel=cancel)
    assert time.monotonic() - start < 0.3 + 0.25  # not left to run into the timeout
    assert compiler.sandbox.kills == kills + 1


def test_a_spec_the_worker_refuses_keeps_its_reason_and_kills_nothing(compiler: GrammarCompiler) -> None:
    assert compiler.sandbox is not None
    kills = compiler.sandbox.kills
    with pytest.raises(StructuredOutputError, match="parenthesis is not closed") as info:
        compiler.compile(StructuredOutputSpec("regex", "(unclosed"))
    assert not info.value.args[0].split("compiled: ")[1].startswith("[")  # no C++ file:line prefix
    assert compiler.sandbox.kills == kills


def test_prestart_returns_while_its_workers_still_boot() -> None:
    """A real tokenizer's info (~1 MB of JSON) is more than a socket buffer holds: a worker that read it only
    after importing xgrammar (~2 s) held prestart, and so the server's start, until each worker in turn had
    booted. Now prestart returns while both still boot, and both serve once booted."""
    vocab = [f"token{i:06d}-" * 3 for i in range(50_000)]  # ~2 MB of JSON
    info = xgr.TokenizerInfo(vocab, vocab_type=xgr.VocabType.RAW, vocab_size=len(vocab), stop_token_ids=[0])
    sandbox = CompileSandbox(info, workers=2)
    try:
        sandbox.prestart()
        workers = list(sandbox._all)
        assert len(workers) == 2
        assert not any(w.conn.poll(0) for w in workers), "a worker had booted before prestart returned"
        for w in workers:
            w.wait_ready(None)
        assert sandbox.trial(SMALL).memory_bytes > 0
    finally:
        sandbox.close()


@pytest.mark.parametrize("prestart", [False, True])
def test_an_engine_boots_its_grammar_workers_only_when_told_or_needed(
    monkeypatch: pytest.MonkeyPatch, prestart: bool
) -> None:
    """`brine serve` prestarts them; any other engine boots one when a constrained request first needs it,
    and so never spends their CPU (xgrammar imports torch) if none comes. The default model's tokenizer,
    a fake runner."""
    import engine.model_runner

    def runner(config: EngineConfig) -> FakeRunner:
        fake = FakeRunner(num_blocks=64)
        fake.vocab_size = 49152  # type: ignore[attr-defined]
        return fake

    monkeypatch.setattr(engine.model_runner, "ModelRunner", runner)
    eng = AsyncEngine.from_config(EngineConfig(), prestart_grammar_workers=prestart)
    try:
        grammars = eng._grammars
        assert grammars is not None and grammars.sandbox is not None
        sandbox = grammars.sandbox
        assert sandbox.started == (2 if prestart else 0)
        assert grammars.compile(SMALL).memory_bytes > 0
        assert sandbox.started == (2 if prestart else 1)
    finally:
        eng.shutdown()


def _engine(grammars: GrammarCompiler) -> AsyncEngine:
    core = EngineCore(FakeRunner(num_blocks=64, step_delay=0.002), ByteTokenizer(), EngineConfig())
    return AsyncEngine(core, core.tokenizer, model_name="fake", grammars=grammars)


async def _run(engine: AsyncEngine, spec: StructuredOutputSpec, ns: CacheNamespace | None) -> None:
    params = SamplingParams(max_tokens=2, temperature=0, structured=spec)
    async for _ in engine.generate([1, 2, 3], params, origin=Origin(ns)):
        pass


async def test_the_engine_compiles_once_per_namespace_and_forgets_on_reset() -> None:
    grammars = GrammarCompiler(_info())
    engine = _engine(grammars)
    try:
        a, b = CacheNamespace(tenant="a"), CacheNamespace(tenant="b")
        await _run(engine, SMALL, a)
        await _run(engine, SMALL, a)
        assert grammars.compiles == 1
        await _run(engine, SMALL, b)
        assert grammars.compiles == 2
        engine.forget_prefix_cache(("tenant", "a"))  # a tenant's reset forgets its grammars too
        await _run(engine, SMALL, a)
        await _run(engine, SMALL, b)
        assert grammars.compiles == 3
        assert engine.reset_prefix_cache()
        assert len(grammars) == 0
    finally:
        engine.shutdown()


async def test_a_caller_that_leaves_kills_its_compile_on_the_engines_own_pool(
    compiler: GrammarCompiler,
) -> None:
    assert compiler.sandbox is not None
    compiler.compile(SMALL)  # a worker is up
    kills = compiler.sandbox.kills
    seen: list[str] = []
    original = compiler.compile

    def spy(*args: object, **kwargs: object):  # type: ignore[no-untyped-def]
        seen.append(threading.current_thread().name)
        return original(*args, **kwargs)  # type: ignore[arg-type]

    compiler.compile = spy  # type: ignore[method-assign]
    engine = _engine(compiler)
    try:
        task = asyncio.ensure_future(_run(engine, StructuredOutputSpec(SLOW.kind, SLOW.spec + "  "), None))
        await asyncio.sleep(0.1)
        task.cancel()  # the client disconnected
        with pytest.raises(asyncio.CancelledError):
            await task
        deadline = time.monotonic() + 0.25  # well before the 0.3 s timeout would have killed it
        while compiler.sandbox.kills == kills and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        assert compiler.sandbox.kills == kills + 1
        assert seen and seen[0].startswith("brine-grammar-compile")
    finally:
        del compiler.compile
        engine.shutdown()
