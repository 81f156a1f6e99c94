"""Smoke test of the benchmark client and report against a tiny fake OpenAI-compatible server.

The fake server streams completions word by word and keeps a toy prefix cache (salted, chained, blocks of 4
words), reporting `usage.prompt_tokens_details.cached_tokens` and `brine_prefix_cache_*` counters at
`/metrics`, so every workload's cache numbers are known exactly without loading a model.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import Response, StreamingResponse
from prometheus_client import CollectorRegistry, Counter, generate_latest

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # `benchmarks` is not an installed package

from benchmarks import compare  # noqa: E402
from benchmarks.report import markdown, percentile, summarize  # noqa: E402
from benchmarks.serve_bench import run_workload  # noqa: E402
from benchmarks.workloads import WORKLOADS, build, write_server_files  # noqa: E402

BLOCK = 4


def fake_app(
    with_metrics: bool = True,
    with_usage: bool = True,
    fail_after: int | None = None,
    cut_after: int | None = None,
) -> FastAPI:
    """`fail_after`: stream that many tokens, then an error event and [DONE] (how an OpenAI-compatible server,
    Brine included, reports a failure once the 200 status line is sent). `cut_after`: stream that many tokens,
    then [DONE] with no finish_reason (how llama-cpp-python's server cuts a stream short when another request
    waits, its default `interrupt_requests`)."""
    app = FastAPI()
    registry = CollectorRegistry()
    queries = Counter("brine_prefix_cache_queries", "", ["model_name"], registry=registry).labels("fake")
    hits = Counter("brine_prefix_cache_hits", "", ["model_name"], registry=registry).labels("fake")
    cache: set[int] = set()
    app.state.in_flight = app.state.max_in_flight = 0

    def lookup_and_store(tokens: list[str], salt: str | None) -> int:
        parent, matched, chain = hash(("root", salt)), 0, True
        for i in range(len(tokens) // BLOCK):
            parent = hash((parent, tuple(tokens[i * BLOCK : (i + 1) * BLOCK])))
            if chain and parent in cache:
                matched += BLOCK
            else:
                chain = False
            cache.add(parent)
        return min(matched, (len(tokens) - 1) // BLOCK * BLOCK)  # the last token is always computed

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [{"id": "fake", "object": "model"}]}

    if with_metrics:

        @app.get("/metrics")
        async def metrics() -> Response:
            return Response(generate_latest(registry), media_type="text/plain")

    app.state.seen = []  # (authorization header, number of messages) per request

    async def generate(body: dict, chat: bool):
        prompt = body["messages"][-1]["content"] if chat else body["prompt"]
        tokens = prompt.split()
        cached = lookup_and_store(tokens, body.get("cache_salt"))
        queries.inc(len(tokens))
        hits.inc(cached)
        app.state.in_flight += 1
        app.state.max_in_flight = max(app.state.max_in_flight, app.state.in_flight)
        try:
            for i in range(body["max_tokens"]):
                if i == fail_after:
                    yield f"data: {json.dumps({'error': {'message': 'boom', 'type': 'server_error'}})}\n\n"
                    yield "data: [DONE]\n\n"
                    return
                if i == cut_after:
                    yield "data: [DONE]\n\n"
                    return
                await asyncio.sleep(0.02)
                choice = (
                    {"index": 0, "delta": {"content": f" w{i}"}} if chat else {"index": 0, "text": f" w{i}"}
                )
                choice["finish_reason"] = "length" if i == body["max_tokens"] - 1 else None
                yield f"data: {json.dumps({'choices': [choice]})}\n\n"
        finally:
            app.state.in_flight -= 1
        if with_usage:
            usage = {"prompt_tokens": len(tokens), "completion_tokens": body["max_tokens"],
                     "prompt_tokens_details": {"cached_tokens": cached}}  # fmt: skip
            yield f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n"
        yield "data: [DONE]\n\n"

    app.state.bodies = []  # every /v1/completions body, in order

    @app.post("/v1/completions")
    async def completions(request: Request) -> StreamingResponse:
        body = await request.json()
        app.state.bodies.append(body)
        return StreamingResponse(generate(body, False), media_type="text/event-stream")

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> StreamingResponse:
        body = await request.json()
        app.state.seen.append((request.headers.get("authorization"), [m["role"] for m in body["messages"]]))
        return StreamingResponse(generate(body, True), media_type="text/event-stream")

    return app


def serve(app: FastAPI) -> Iterator[str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started:
        assert time.monotonic() < deadline, "fake server did not start"
        time.sleep(0.02)
    yield f"http://127.0.0.1:{port}"
    server.should_exit = True
    thread.join(timeout=10)


@pytest.fixture
def fake() -> Iterator[tuple[str, FastAPI]]:
    app = fake_app()
    for url in serve(app):
        yield url, app


def run(url: str, name: str, **kw):  # noqa: ANN201
    workload = build(name, seed=3, **compare.PRESETS["tiny"][name])
    return workload, asyncio.run(run_workload(url, workload, server="fake", progress=False, **kw))


def by_tag(result, tag: str) -> list:  # noqa: ANN001, ANN201
    return [r for r in result.requests if r.tag == tag]


@pytest.mark.parametrize("name", WORKLOADS)
def test_every_workload_runs_and_hit_rate_matches_usage(fake, name: str) -> None:  # noqa: ANN001
    url, _ = fake
    workload, result = run(url, name)
    assert len(result.requests) == len(workload.requests)
    assert all(r.ok for r in result.requests), [r.error for r in result.requests]
    assert all(r.ttft is not None and r.completion_tokens == 4 and len(r.itls) == 3 for r in result.requests)
    prompt = sum(r.prompt_tokens for r in result.requests)
    cached = sum(r.cached_tokens for r in result.requests)
    assert result.cache_queries == prompt  # /metrics deltas agree with what the requests were told
    assert result.cache_hits == cached
    assert result.hit_rate == (cached / prompt)


def test_cold_warm_and_isolation_numbers(fake) -> None:  # noqa: ANN001
    url, _ = fake
    _, docqa = run(url, "doc-qa")
    assert [r.cached_tokens == 0 for r in docqa.requests] == [True, False, False]
    _, tenants = run(url, "tenants")  # round 0 is cold for every tenant: salts keep tenants apart
    assert all(r.cached_tokens == 0 for r in by_tag(tenants, "cold"))
    assert all(r.cached_tokens > 0 for r in by_tag(tenants, "warm"))
    _, iso = run(url, "isolation")
    assert by_tag(iso, "other-tenant")[0].cached_tokens == 0
    assert by_tag(iso, "warm")[0].cached_tokens > 0
    _, uniq = run(url, "unique")
    assert uniq.hit_rate == 0.0
    s = summarize(iso)
    assert s["cached_tokens_by_tag"]["other-tenant"] == 0 and s["ok"] == 3


def test_concurrency_is_bounded_and_reached(fake) -> None:  # noqa: ANN001
    url, app = fake
    workload, _ = run(url, "prefix-repetition")
    assert app.state.max_in_flight == workload.concurrency == 2


def test_time_limit_stops_new_requests(fake) -> None:  # noqa: ANN001
    url, _ = fake
    workload, result = run(url, "doc-qa", time_limit_s=0.05)  # each request streams for ~80 ms
    assert 1 <= len(result.requests) < len(workload.requests)


def test_chat_api_and_server_without_metrics_or_usage() -> None:
    for url in serve(fake_app(with_metrics=False, with_usage=False)):
        _, result = run(url, "doc-qa", api="chat")
        assert all(r.ok and r.completion_tokens == 4 for r in result.requests)  # counted from chunks
        assert result.hit_rate is None and result.cache_queries is None
        s = summarize(result)
        assert s["cached_tokens"] is None and s["prompt_tokens"] is None  # n/a, not 0


def test_error_event_mid_stream_is_a_failed_request() -> None:
    for url in serve(fake_app(fail_after=2)):
        workload, result = run(url, "isolation")
        assert len(result.requests) == len(workload.requests)
        assert not any(r.ok for r in result.requests)
        assert all(r.error is not None and "boom" in r.error for r in result.requests)
        s = summarize(result)
        assert s["ok"] == 0 and s["request_throughput"] == 0 and s["ttft_p50"] is None


def test_stream_cut_short_without_finish_reason_is_a_failed_request() -> None:
    for url in serve(fake_app(cut_after=1)):
        _, result = run(url, "unique")
        assert not any(r.ok for r in result.requests)
        assert all("finish_reason" in (r.error or "") for r in result.requests)
        assert summarize(result)["ok"] == 0


def test_compare_writes_report_json_and_charts(fake, tmp_path: Path) -> None:  # noqa: ANN001
    url, _ = fake
    md_path = compare.main(["--external", f"fake={url}", "--preset", "tiny", "--out-dir", str(tmp_path),
                            "--name", "smoke", "--quiet-wait", "0"])  # fmt: skip
    md = md_path.read_text()
    for name in (*WORKLOADS, "prefix-sweep", "noisy-neighbour"):
        assert f"| {name} | fake |" in md
    assert "Noisy neighbour: quiet tenants' TTFT" in md and "\n| fake | " in md.split("Noisy neighbour")[1]
    data = json.loads((tmp_path / "smoke.json").read_text())
    iso = next(s for s in data["summaries"] if s["workload"] == "isolation")
    assert iso["cached_tokens_by_tag"]["other-tenant"] == 0
    (row,) = data["ratios"]  # the headline ratios, in the JSON and at the top of the report
    assert row["server"] == "fake" and row["isolation_b_cached_tokens"] == 0
    assert 0 < row["doc_qa_warm_over_cold_ttft"] and 0 < row["tenants_later_over_first_ttft"]
    assert row["unique_on_over_off"] is None  # no "fake-no-cache" twin ran
    assert "| server | doc-qa warm / cold TTFT |" in md and "\n| fake | " in md
    for chart in ("ttft_cold_warm", "ttft_vs_prefix", "throughput"):
        png = tmp_path / f"smoke_{chart}.png"
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert f"({png.name})" in md


def test_percentile() -> None:
    assert percentile([], 50) is None
    assert percentile([3.0], 99) == 3.0
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5
    assert percentile([4.0, 1.0, 3.0, 2.0], 100) == 4.0


def test_llamacpp_requests_queue_instead_of_cutting_each_other_short(monkeypatch, tmp_path: Path) -> None:  # noqa: ANN001
    # The probe of the baseline's venv is faked: only the command compare.py would start is checked.
    gguf = tmp_path / compare.GGUF_FILE
    gguf.write_bytes(b"")
    monkeypatch.setattr(compare, "gguf_path", lambda: gguf)
    monkeypatch.setattr(compare, "LLAMACPP_PYTHON", Path(sys.executable))
    monkeypatch.setattr(compare.subprocess, "run",
                        lambda *a, **k: compare.subprocess.CompletedProcess(a, 0, "0.3.0\n", ""))  # fmt: skip
    spec = compare.llamacpp_spec(threads=2)
    assert isinstance(spec, compare.ServerSpec) and spec.cmd is not None
    i = spec.cmd.index("--interrupt_requests")
    assert spec.cmd[i + 1] == "false"  # its default (true) ends a stream early whenever another request waits


def test_shared_system_prompt_sends_tenant_keys_and_the_system_prompt(fake, tmp_path: Path) -> None:  # noqa: ANN001
    url, app = fake
    workload, result = run(url, "shared-system-prompt", api_key="operator")
    assert all(r.ok for r in result.requests), [r.error for r in result.requests]
    keys = list(workload.tenant_keys.values())
    assert len(keys) == 3 and len(result.requests) == 6
    # Wave 0: each tenant's first question in order, with its own key and the shared system message.
    assert [a for a, _ in app.state.seen[:3]] == [f"Bearer {k}" for k in keys]
    assert all(roles == ["system", "user"] for _, roles in app.state.seen)
    assert [r.tag for r in result.requests] == ["first-tenant-1", "first-other", "first-other"] + [
        "later"
    ] * 3
    assert result.kv_usage_peak is None  # the fake exports no gauge: n/a, not 0
    s = summarize(result)
    assert s["ttft_mean_by_tag"]["first-other"] is not None
    tenants, prefix = write_server_files(workload, tmp_path)
    lines = tenants.read_text().splitlines()
    assert [line.split()[0] for line in lines] == list(workload.tenant_keys)
    assert prefix is not None and json.loads(prefix.read_text())[0]["role"] == "system"
    specs = compare.tenant_specs(tenants, prefix)
    assert [sp.name for sp in specs] == ["brine-tenants-public-prefix", "brine-tenants"]
    assert all(sp.runs("shared-system-prompt") and not sp.runs("doc-qa") for sp in specs)
    assert "--public-prefix" in specs[0].cmd and "--public-prefix" not in specs[1].cmd  # type: ignore[operator]
    md = markdown([s | {"server": "brine-tenants-public-prefix"}, s | {"server": "brine-tenants"}], "# t")
    assert "With `--public-prefix` / without: tenants 2.. first TTFT 1x" in md


def test_noisy_neighbour_runs_the_quiet_requests_alone_then_beside_the_noisy_tenant(fake) -> None:  # noqa: ANN001
    url, _ = fake
    sizes = {"quiet_tenants": 2, "doc_tokens": 40, "questions": 2, "fan_prompts": 3, "max_tokens": 4}
    workload = build("noisy-neighbour", seed=3, **sizes)
    assert workload.noise is not None and len(workload.noise["prompt"]) * workload.noise["n"] == 6
    assert {r.prompt for r in workload.baseline}.isdisjoint(r.prompt for r in workload.requests)
    result = asyncio.run(run_workload(url, workload, server="fake", progress=False))
    tags = [r.tag for r in result.requests]
    assert tags == ["alone"] * 4 + ["noisy"] * 4 and all(r.ok for r in result.requests)
    assert result.noise_sent >= 1  # the fake server cannot serve list prompts: sent, not ok
    s = summarize(result)
    assert set(s["ttft_p50_by_tag"]) == {"alone", "noisy"} and s["noise_sent"] == result.noise_sent


# A baseline server that dies as a native llama.cpp build did on an AMX VM: it answers /v1/models and its
# first `DIE_AFTER` completions, then kills itself with SIGILL on the next one (no core file).
DYING_SERVER = r"""
import json, os, resource, signal, sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

port, die_after = int(sys.argv[1]), int(sys.argv[2])
served = 0

class Handler(BaseHTTPRequestHandler):
    def do_GET(self):
        body = json.dumps({"object": "list", "data": [{"id": "dying", "object": "model"}]}).encode()
        self.send_response(200 if self.path == "/v1/models" else 404)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_POST(self):
        global served
        self.rfile.read(int(self.headers["Content-Length"]))
        if served >= die_after:
            print("ggml: about to run an instruction this CPU lacks", file=sys.stderr, flush=True)
            resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
            os.kill(os.getpid(), signal.SIGILL)
        served += 1
        choice = {"index": 0, "text": " hi", "finish_reason": "length"}
        body = f"data: {json.dumps({'choices': [choice]})}\n\ndata: [DONE]\n\n".encode()
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass

ThreadingHTTPServer(("127.0.0.1", port), Handler).serve_forever()
"""


def test_a_server_that_dies_is_reported_and_not_waited_for(tmp_path: Path) -> None:
    port = compare.free_port()
    cmd = [sys.executable, "-c", DYING_SERVER, str(port), "1"]  # the warm-up lives, the first workload kills
    spec = compare.ServerSpec("llama-cpp-python 0.0.0", f"http://127.0.0.1:{port}", cmd)
    args = argparse.Namespace(
        workloads=["unique", "isolation"],
        preset="tiny",
        seed=1,
        time_limit=600.0,
        startup_timeout=60.0,
        quiet_wait=0.0,
    )
    notes: list[str] = []
    results = compare.bench_all([spec], args, tmp_path, time.monotonic() + 600, notes)
    assert results == []  # the workload it died in is dropped, the next one is not run
    (note,) = notes
    assert note.startswith("**llama-cpp-python 0.0.0 died** during `unique`")
    assert "SIGILL (exit status 132)" in note and "GGML_NATIVE=OFF" in note
    assert "about to run an instruction this CPU lacks" in note  # the log's last lines


def test_exit_reasons_name_the_signal() -> None:
    assert compare.exit_reason(-4) == compare.exit_reason(132)  # Popen's -N and a shell's 128 + N
    assert "SIGILL (exit status 132)" in compare.exit_reason(-4)
    assert compare.exit_reason(-9) == "killed by SIGKILL (exit status 137)"
    assert compare.exit_reason(1) == "exit status 1"
