"""A flood under one cache salt against another salt's stream, through a real `brine serve` (issue 28 section 4).

One request with n = 48 streams under salt "a" keeps the engine's steps full (~50 ms each on two cores), and a
16-token stream under salt "b" measures its time to first token and its inter-token latency, idle and beside
the flood. With the express lane (engine.express) its tokens come from short steps run between the layers of
the flood's steps: on the 2-core EPYC ~1.8x idle for the first token and ~2x for the next ones, where without
the lane each of its tokens waited for a whole flood step (~12x idle). Speed is measured, not asserted tightly
(these machines are noisy): the test prints the ratios and fails only where the victim is back at the flood's
pace, MAX_ITL_RATIO = 6 for the inter-token latency; TTFT is held to the stall bound of the noisy-neighbour
test.
"""

from __future__ import annotations

import json
import statistics
import time

import httpx
import pytest
from e2e_server import BrineServer, is_idle, running_server, wait_for_metrics
from test_e2e_noisy_neighbour import STALL_RATIO, VICTIM_PROMPT, Attacker, wait_until_busy

pytestmark = pytest.mark.slow

MAX_ITL_RATIO = 6.0
SAMPLES = 5
FLOOD = {
    "prompt": "Once upon a time",
    "n": 48,
    "max_tokens": 400,
    "ignore_eos": True,
    "temperature": 1.0,
    "stream": True,
    "cache_salt": "a",
}


def victim(server: BrineServer) -> tuple[float, float]:
    """(TTFT, median inter-token gap) of a 16-token stream under salt "b", in seconds."""
    body = {"model": server.model, "prompt": VICTIM_PROMPT, "max_tokens": 16, "temperature": 0}
    body.update(stream=True, ignore_eos=True, cache_salt="b")
    start = time.perf_counter()
    times: list[float] = []
    with httpx.stream(
        "POST", f"{server.base_url}/v1/completions", json=body, headers=server.headers, timeout=120
    ) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: {") and json.loads(line[6:])["choices"][0]["text"]:
                times.append(time.perf_counter())  # a token's text (the last chunk may carry none)
    assert len(times) >= 8, f"{len(times)} tokens with text"
    return times[0] - start, statistics.median(b - a for a, b in zip(times, times[1:], strict=False))


def medians(server: BrineServer) -> tuple[float, float]:
    runs = [victim(server) for _ in range(SAMPLES)]
    return statistics.median(r[0] for r in runs), statistics.median(r[1] for r in runs)


def test_another_salts_stream_keeps_its_pace_beside_a_flood(tmp_path) -> None:
    extra = ("--max-num-seqs", "64", "--num-kv-blocks", "2048")  # the last value of a flag wins
    with running_server(tmp_path / "serve.log", extra) as server:
        for _ in range(3):
            victim(server)  # warm-up
        idle_ttft, idle_itl = medians(server)
        with Attacker(server, FLOOD):
            wait_until_busy(server)
            time.sleep(2.0)  # all 48 decoding
            ttft, itl = medians(server)
        m = wait_for_metrics(server, lambda m: is_idle(m, 2048), timeout=120)
        assert is_idle(m, 2048), "blocks left held after the flood"
        assert "Traceback" not in server.log_tail(200_000)
    print(
        f"\nvictim beside 48 streams of another salt: TTFT {idle_ttft * 1e3:.1f} -> {ttft * 1e3:.1f} ms "
        f"({ttft / idle_ttft:.2f}x), inter-token {idle_itl * 1e3:.1f} -> {itl * 1e3:.1f} ms "
        f"({itl / idle_itl:.2f}x); target 3x"
    )
    assert itl / idle_itl <= MAX_ITL_RATIO, f"inter-token latency {itl / idle_itl:.2f}x idle"
    assert ttft / idle_ttft <= STALL_RATIO, f"TTFT {ttft / idle_ttft:.2f}x idle"
