"""profile_step's py-spy summary: samples go to the deepest frame naming a part, per thread."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # `benchmarks` is not an installed package

from benchmarks.profile_step import summarize_pyspy  # noqa: E402

RAW = """\
thread (1): brine-engine;_run (engine/async_engine.py:290);step (engine/engine_core.py:181);execute (engine/model_runner.py:147);forward (engine/model/llama.py:190);PackedLinear.forward (engine/model/cpu_linear.py:70);_linear (engine/model/cpu_linear.py:49) 6
thread (1): brine-engine;_run (engine/async_engine.py:290);step (engine/engine_core.py:181);execute (engine/model_runner.py:147);LlamaForCausalLM.forward (engine/model/llama.py:190);TiledBackend.forward (engine/model/tiled_attention.py:186);scores (engine/model/tiled_attention.py:54) 3
thread (1): brine-engine;_run (engine/async_engine.py:290);EngineCore.step (engine/engine_core.py:171);Scheduler.schedule (engine/scheduler.py:120) 1
thread (7): MainThread;run (asyncio/runners.py:118);EpollSelector.select (selectors.py:468) 8
thread (7): MainThread;run (asyncio/runners.py:118);_SelectorSocketTransport.write (asyncio/selector_events.py:1057) 2
"""


def test_samples_are_summed_by_thread_and_deepest_part(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    raw = tmp_path / "raw.txt"
    raw.write_text(RAW)
    summarize_pyspy(str(raw))
    out = capsys.readouterr().out
    assert "### thread brine-engine: 10 samples (50% of all)" in out
    assert "| model: linears (packed oneDNN) | 6 | 60% |" in out
    assert "| model: attention (gathers, products, softmax) | 3 | 30% |" in out
    assert "| scheduler | 1 | 10% |" in out
    assert "### thread MainThread: 10 samples (50% of all)" in out
    assert "| asyncio: idle (select) | 8 | 80% |" in out and "| asyncio: HTTP, SSE, routes | 2 | 20% |" in out
