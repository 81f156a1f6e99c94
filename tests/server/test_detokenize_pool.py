"""`/detokenize` with a real tokenizer answers a large body in worker processes (server.detokenize_pool):
nothing of it, from parsing the body to decoding, runs in the server process, whose event loop and GIL every
stream needs; each answer, errors included, is byte for byte the one the route gives in process; a dead worker
is replaced; the workers die with the server."""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path

import pytest
from fake_engine import FakeEngine
from fastapi.testclient import TestClient
from server_helpers import MODEL
from tiny_qwen import build_tiny_qwen

from engine.tokenizer import Tokenizer
from server.app import create_app
from server.detokenize_pool import DetokenizePool, Job, answer
from server.token_routes import IN_PROCESS_BYTES

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "engine"))
from test_worker_process import check_workers_die_with_their_server  # noqa: E402

J = "application/json"
# (body, content type): the route's whole surface, as FastAPI read a typed body before.
CASES: list[tuple[bytes, str | None]] = [
    (json.dumps({"model": MODEL, "tokens": [40, 41, 42]}).encode(), J),
    (b'{"tokens": []}', J),
    (b'{"model": "other", "tokens": [40]}', J),
    (b'{"tokens": [-1]}', J),
    (b'{"tokens": ["a"]}', J),
    (b'{"tokens": ["40", 41.0, true]}', J),
    (b'{"tokens": [40.5]}', J),
    (b'{"tokens": [NaN]}', J),
    (b'{"tokens": [1000000000000000000000000000000]}', J),
    (b'{"tokens": [40, 40, 40, 40, 40]}', J),  # over the limit of 4
    (b'{"tokens": null}', J),
    (b'{"model": 5, "tokens": [40]}', J),
    (b'{"model": "\\ud800", "tokens": [40]}', J),
    (b'{"tokens": [40], "unknown_field": 1}', J),
    (b'{"tokens": [40', J),
    (b"", J),
    (b"[40]", J),
    (b'{"tokens": [40], "model": "\xff"}', J),
    (b'{"tokens": [40]}', None),
    (b'{"tokens": [40]}', "text/plain"),
    (b'{"tokens": [40]}', "application/vnd.api+json; charset=utf-8"),
]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    return Tokenizer(build_tiny_qwen(tmp_path_factory.mktemp("qwen")))


def _post(client: TestClient, body: bytes, content_type: str | None):  # type: ignore[no-untyped-def]
    headers = {"content-type": content_type} if content_type else {}
    return client.post("/detokenize", content=body, headers=headers)


def test_workers_answer_every_body_as_the_route_does_in_process(tokenizer: Tokenizer) -> None:
    in_process = [
        answer(Job(body, ct, MODEL, 4), tokenizer.decode, tokenizer.vocab_size) for body, ct in CASES
    ]
    assert in_process[0].status == 200 and json.loads(in_process[0].body)["prompt"]
    assert [a.status for a in in_process].count(
        200
    ) == 6  # the rest are the errors the route has always given
    pool = DetokenizePool(tokenizer.backend.to_str(), tokenizer.vocab_size, workers=1)
    try:
        for (body, ct), expected in zip(CASES, in_process, strict=True):
            got = pool.run(Job(body, ct, MODEL, 4))
            assert (got.status, got.body) == (expected.status, expected.body), body
    finally:
        pool.close()


def test_a_large_body_is_answered_outside_the_server_process(
    tokenizer: Tokenizer, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    ids = [40 + i % 50 for i in range(3000)]  # ~15 KB of JSON: past what is answered in process
    big = json.dumps({"model": MODEL, "tokens": ids, "unknown_field": 1}).encode()
    assert len(big) > IN_PROCESS_BYTES
    surrogate = json.dumps({"model": "\ud800", "tokens": ids}, ensure_ascii=True).encode()
    expected = tokenizer.decode(ids)
    engine = FakeEngine(model_name=MODEL)
    engine.tokenizer = tokenizer
    app = create_app(engine)

    def not_here(*_: object, **__: object) -> str:
        raise AssertionError("decoded in the server process")

    with TestClient(app) as client:
        small = _post(client, b'{"tokens": [40, 41]}', J)  # the normal path: in process, as before
        assert small.status_code == 200 and small.json() == {"prompt": tokenizer.decode([40, 41])}
        monkeypatch.setattr(Tokenizer, "decode", not_here)  # the old route decoded every body here
        with caplog.at_level("INFO", logger="brine.server"):
            r = _post(client, big, J)
            assert r.status_code == 200 and r.headers["content-type"] == J
            assert r.json() == {"prompt": expected}
            bad = _post(client, surrogate, J)
            assert bad.status_code == 400 and bad.json()["error"]["code"] == "invalid_text"
    # What the worker logged reaches the server's log: the unknown field's warning, the refused surrogate.
    messages = [r.getMessage() for r in caplog.records]
    assert any("unknown_field" in m for m in messages), messages
    assert any("lone UTF-16 surrogate in model" in m for m in messages), messages


def test_a_dead_worker_is_replaced(tokenizer: Tokenizer) -> None:
    engine = FakeEngine(model_name=MODEL)
    engine.tokenizer = tokenizer
    app = create_app(engine)
    body = json.dumps({"tokens": [40 + i % 50 for i in range(3000)]}).encode()  # one for a worker
    with TestClient(app) as client:
        first = _post(client, body, J)
        assert first.status_code == 200
        pool = app.state.detokenize_pool
        assert pool is not None
        for worker in list(pool._all):
            os.kill(worker.proc.pid, signal.SIGKILL)
            worker.proc.wait(timeout=30)
        for _ in range(3):  # every dead worker found and replaced
            again = _post(client, body, J)
            assert (again.status_code, again.content) == (200, first.content)


SERVER = """
import sys
sys.path.insert(0, "tests/server")
from tiny_qwen import build_tiny_qwen
import tempfile
from engine.tokenizer import Tokenizer
from server.detokenize_pool import DetokenizePool, Job
tok = Tokenizer(build_tiny_qwen(__import__("pathlib").Path(tempfile.mkdtemp())))
pool = DetokenizePool(tok.backend.to_str(), tok.vocab_size, workers=1)
assert pool.run(Job(b'{"tokens": [40]}', None, "m", 10)).status == 200  # the worker is up and armed
print(" ".join(str(w.proc.pid) for w in pool._all), flush=True)
import time; time.sleep(600)
"""


@pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="the kernel's kill on parent death is Linux's"
)
def test_detokenize_workers_die_with_a_killed_server() -> None:
    check_workers_die_with_their_server(SERVER)
