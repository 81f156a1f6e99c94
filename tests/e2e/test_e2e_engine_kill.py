"""The security review's engine-kill requests, over HTTP through a real `brine serve`: each gets a clear 4xx or
fails only itself, a stream in flight beside it finishes as it would alone, and afterwards `/health` is 200
and an innocent request answers."""

from __future__ import annotations

import asyncio

import httpx
import pytest
from e2e_server import BrineServer

pytestmark = pytest.mark.slow

INNOCENT = {"prompt": "The capital of France is", "max_tokens": 12, "temperature": 0, "logprobs": 1}

ATTACKS = [
    # 1e-300 is 0 in float32: x / 0 = inf, a NaN softmax, and (before) the row width as the token id.
    ({"repetition_penalty": 1e-300, "temperature": 1, "max_tokens": 8}, 400),
    ({"repetition_penalty": 1e-300, "temperature": 1, "max_tokens": 1, "logprobs": 1}, 400),
    # The grammar allows only EOS once "a" is written, and min_tokens masks EOS: now the grammar wins.
    ({"guided_choice": ["a"], "min_tokens": 2, "temperature": 1, "max_tokens": 8}, 200),
    ({"guided_choice": ["a"], "min_tokens": 2, "temperature": 1, "max_tokens": 8, "logprobs": 2}, 200),
]


async def _post(server: BrineServer, body: dict) -> httpx.Response:
    async with httpx.AsyncClient(timeout=120) as http:
        full = {"model": server.model, "prompt": "Once upon a time", **body}
        return await http.post(f"{server.base_url}/v1/completions", json=full, headers=server.headers)


@pytest.mark.parametrize(
    ("attack", "status"), ATTACKS, ids=lambda v: ",".join(v) if isinstance(v, dict) else str(v)
)
def test_an_engine_kill_request_harms_nobody(brine_server: BrineServer, attack: dict, status: int) -> None:
    alone = asyncio.run(_post(brine_server, INNOCENT)).json()["choices"][0]

    async def together():
        return await asyncio.gather(_post(brine_server, INNOCENT), _post(brine_server, attack))

    innocent, hostile = asyncio.run(together())
    assert hostile.status_code == status, hostile.text
    if status == 400:
        assert hostile.json()["error"]["param"] == "repetition_penalty"
    else:
        choice = hostile.json()["choices"][0]
        assert choice["text"] == "a" and choice["finish_reason"] == "stop"
    assert innocent.status_code == 200, innocent.text
    beside = innocent.json()["choices"][0]
    assert beside["text"] == alone["text"] and beside["logprobs"] == alone["logprobs"]
    assert httpx.get(f"{brine_server.base_url}/health", timeout=10).status_code == 200, (
        brine_server.log_tail()
    )
    again = asyncio.run(_post(brine_server, INNOCENT))
    assert again.status_code == 200 and again.json()["choices"][0]["text"] == alone["text"]
