"""A client that disconnects mid-stream aborts its request: its KV blocks go back, seen on /metrics."""

from __future__ import annotations

import httpx
import pytest
from e2e_server import BrineServer, is_idle, wait_for_metrics

pytestmark = pytest.mark.slow


def test_disconnect_mid_stream_frees_blocks(brine_server: BrineServer) -> None:
    # Idle: no request holds blocks (an earlier test's retention request may still keep some on purpose).
    idle = wait_for_metrics(brine_server, is_idle)
    assert is_idle(idle), "another request still holds blocks"
    base = idle["brine_kv_cache_usage_perc"]
    aborted_before = idle["brine_request_success_total/abort"]
    body = {
        "model": brine_server.model,
        "messages": [{"role": "user", "content": "Tell me a very long story about a lighthouse keeper."}],
        "max_tokens": 1000,
        "temperature": 0,
        "ignore_eos": True,  # the story must outlast the test
        "stream": True,
    }
    with httpx.Client(timeout=300) as http:
        with http.stream("POST", f"{brine_server.base_url}/v1/chat/completions", json=body,
                         headers=brine_server.headers) as r:  # fmt: skip
            assert r.status_code == 200
            lines = r.iter_lines()  # keep the iterator: dropping it would close the stream early
            events = 0
            while events < 4:
                if next(lines).startswith("data: "):
                    events += 1
            during = wait_for_metrics(brine_server, lambda m: m["brine_kv_cache_usage_perc"] > base)
            assert during["brine_num_requests_running"] == 1 and during["brine_kv_cache_usage_perc"] > base
        # Leaving the block closes the connection mid-stream.
    after = wait_for_metrics(brine_server, is_idle)
    assert is_idle(after), brine_server.log_tail()
    assert after["brine_request_success_total/abort"] == aborted_before + 1
    # Nowhere near 1000 tokens were generated: the engine stopped when the client left.
    assert after["brine_generation_tokens_total"] - during["brine_generation_tokens_total"] < 200
