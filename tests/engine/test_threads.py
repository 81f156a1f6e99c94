"""`--threads`: the count reaches torch in the process before the model loads, and on the step thread."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest
import torch
from engine_fakes import ByteTokenizer, FakeRunner

import engine.model_runner
from engine.async_engine import AsyncEngine
from engine.config import EngineConfig
from engine.engine_core import EngineCore
from engine.sampling_params import SamplingParams
from engine.threads import on_fresh_thread, set_torch_threads
from server import cli, serve


@pytest.fixture
def other_count() -> Iterator[int]:
    """A thread count torch is not using now (so a test can fail), restored afterwards: the count is
    process-wide, and the rest of the suite must keep its own."""
    before = torch.get_num_threads()
    yield 1 if before != 1 else 2
    torch.set_num_threads(before)


class ThreadRecordingRunner(FakeRunner):
    def __init__(self) -> None:
        super().__init__(num_blocks=16)
        self.seen: list[int] = []

    def execute(self, out):  # type: ignore[no-untyped-def]
        self.seen.append(torch.get_num_threads())  # on the engine's step thread
        return super().execute(out)


async def test_the_step_thread_computes_with_the_asked_threads(other_count: int) -> None:
    runner = ThreadRecordingRunner()
    core = EngineCore(runner, ByteTokenizer())
    engine = AsyncEngine(core, core.tokenizer, model_name="fake", threads=other_count)
    try:
        outs = [o async for o in engine.generate([1, 2, 3], SamplingParams(max_tokens=3, temperature=0))]
    finally:
        engine.shutdown()
    assert outs[-1].finished
    assert runner.seen and set(runner.seen) == {other_count}


def _model_load(monkeypatch: pytest.MonkeyPatch, config: EngineConfig) -> tuple[int, threading.Thread]:
    """torch's thread count and the thread that from_config's one ModelRunner(...) call ran with (a fake
    that stops the start there)."""
    seen: list[tuple[int, threading.Thread]] = []

    class Loaded(Exception):
        pass

    def fake_runner(*args: object, **kwargs: object) -> None:
        seen.append((torch.get_num_threads(), threading.current_thread()))
        raise Loaded

    monkeypatch.setattr(engine.model_runner, "ModelRunner", fake_runner)
    with pytest.raises(Loaded):
        AsyncEngine.from_config(config)
    assert len(seen) == 1
    return seen[0]


def test_from_config_sets_threads_before_the_model_loads(
    other_count: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    threads, _ = _model_load(monkeypatch, EngineConfig(threads=other_count))
    assert threads == other_count


def test_the_model_loads_on_a_thread_that_has_ended(monkeypatch: pytest.MonkeyPatch) -> None:
    """Only the step thread may keep an OpenMP pool (engine.threads): the loader runs on another thread, which
    is over before the engine starts."""
    _, loader = _model_load(monkeypatch, EngineConfig())
    assert loader is not threading.main_thread() and not loader.is_alive()


def test_on_fresh_thread_returns_or_raises_what_the_function_did(other_count: int) -> None:
    ran_on: list[threading.Thread] = []

    def work() -> int:
        ran_on.append(threading.current_thread())
        return torch.get_num_threads()

    assert on_fresh_thread(work, other_count) == other_count  # the count set on that thread first
    assert ran_on[0] is not threading.current_thread() and not ran_on[0].is_alive()

    def fail() -> None:
        raise KeyError("from the thread")

    with pytest.raises(KeyError, match="from the thread"):
        on_fresh_thread(fail)


def test_no_threads_leaves_torch_alone() -> None:
    before = torch.get_num_threads()
    assert set_torch_threads(None) is None
    assert torch.get_num_threads() == before


def test_bad_counts_are_refused() -> None:
    core = EngineCore(FakeRunner(), ByteTokenizer())
    with pytest.raises(ValueError, match="at least 1"):
        AsyncEngine(core, core.tokenizer, model_name="fake", threads=0)
    with pytest.raises(ValueError, match="at least 1"):
        set_torch_threads(0)
    with pytest.raises(SystemExit):
        cli.build_parser().parse_args(["serve", "--threads", "0"])


def test_the_flag_reaches_the_engine_config() -> None:
    args = cli.build_parser().parse_args(["serve", "--threads", "3"])
    assert serve.engine_config(args, []).threads == 3
    assert serve.engine_config(cli.build_parser().parse_args(["serve"]), []).threads is None
