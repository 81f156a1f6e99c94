"""A flood under one cache salt against another salt's time to first token (issue 28, section 4).

Starts `brine serve` (keyless, loopback, the default model), measures a victim's TTFT and inter-token latency
(the median gap between its 16 streamed tokens) under salt "b" while idle, then while another process keeps
`--streams` streams running under salt "a", and prints both medians and their ratios. Figures only: nothing
is asserted (these machines are noisy). `--server-arg=--no-express-lane` measures without the express lane.

    python -m benchmarks.salt_flood_bench [--streams 80] [--samples 5] [--tree DIR] [--flood-client raw]

Two victim figures, taken alternately: `fresh` opens a new httpx client per request, as the first version of
this bench did (~25-30 ms of client set-up on a 2-core EPYC, in idle and flooded alike, so its ratio is the
comparable one); `reused` keeps one client and its connection, so idle is about the server's own time.

The flood client runs on the same cores as the server. `--flood-client httpx` is the first version's (a
thread per stream, every SSE line parsed); `raw` (default) reads each stream's bytes and drops them, on one
asyncio thread, so that the client's own CPU takes less from the server. The report gives the CPU (in cores)
used by the flood client, by the server's event-loop thread and by its other threads (the engine step thread
and torch's workers) while flooded, and the load average: on two cores, whatever the client takes the
server's step loses.

`--tree DIR`: run the server from another checkout (an older commit's worktree) to compare before and after;
`--server-arg=--threads=1` (repeatable): a flag for `brine serve`.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
VICTIM_PROMPT = [504, 3458, 282, 4649, 314]  # 5 token ids
FLOOD_BODY = {
    "prompt": "Once upon a time",
    "max_tokens": 400,
    "ignore_eos": True,
    "temperature": 0,
    "stream": True,
    "cache_salt": "a",
}

FLOOD_HTTPX = """
import json, sys, threading, httpx
url, n = sys.argv[1], int(sys.argv[2])
body = json.loads(sys.argv[3])
def run():
    while True:
        with httpx.stream("POST", url, json=body, timeout=600) as r:
            for _ in r.iter_lines():
                pass
for _ in range(n):
    threading.Thread(target=run, daemon=True).start()
threading.Event().wait()
"""

# One thread, raw HTTP/1.1 over asyncio streams, the response read in 64 KiB chunks and dropped.
FLOOD_RAW = """
import asyncio, sys
from urllib.parse import urlsplit
url, n, body = sys.argv[1], int(sys.argv[2]), sys.argv[3].encode()
u = urlsplit(url)
head = (f"POST {u.path} HTTP/1.1\\r\\nHost: {u.netloc}\\r\\nContent-Type: application/json\\r\\n"
        f"Content-Length: {len(body)}\\r\\nConnection: close\\r\\n\\r\\n").encode()
async def run():
    while True:
        reader, writer = await asyncio.open_connection(u.hostname, u.port)
        writer.write(head + body)
        while await reader.read(65536):
            pass
        writer.close()
async def main():
    await asyncio.gather(*(run() for _ in range(n)))
asyncio.run(main())
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


VICTIM_TOKENS = 16


def victim_ttft(base: str, model: str, client: httpx.Client | None = None) -> tuple[float, float]:
    """(seconds from sending the victim's request to its first text chunk, the median gap between its later
    chunks: its inter-token latency); `client`: reuse it (else a fresh one, as `httpx.stream` makes)."""
    body = {"model": model, "prompt": VICTIM_PROMPT, "max_tokens": VICTIM_TOKENS, "temperature": 0}
    body.update(stream=True, ignore_eos=True, cache_salt="b")
    start = time.perf_counter()
    times: list[float] = []
    opener = client.stream if client is not None else httpx.stream
    with opener("POST", f"{base}/v1/completions", json=body, timeout=300) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if line.startswith("data: {") and json.loads(line[6:])["choices"][0]["text"]:
                times.append(time.perf_counter())  # a token's text (the last chunk may carry none)
    if len(times) < 2:
        raise RuntimeError("the victim got fewer than two tokens")
    return times[0] - start, statistics.median(b - a for a, b in zip(times, times[1:], strict=False))


def running_requests(base: str) -> float:
    for line in httpx.get(f"{base}/metrics", timeout=10).text.splitlines():
        if line.startswith("brine_num_requests_running") or line.startswith("vllm:num_requests_running"):
            return float(line.rsplit(" ", 1)[1])
    return -1.0


def generated_tokens(base: str) -> float:
    """The server's generated-token counter (every stream's, the victim's few included)."""
    for line in httpx.get(f"{base}/metrics", timeout=10).text.splitlines():
        if line.startswith("brine_generation_tokens_total"):
            return float(line.rsplit(" ", 1)[1])
    return -1.0


def cpu_seconds(pid: int, tid: int | None = None) -> float:
    """User + system CPU seconds of a process (all its threads) or of one of its threads."""
    path = f"/proc/{pid}/stat" if tid is None else f"/proc/{pid}/task/{tid}/stat"
    fields = Path(path).read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def cpu_snapshot(server: int, flood: int) -> dict[str, float]:
    total = cpu_seconds(server)
    loop = cpu_seconds(server, server)  # uvicorn's event loop runs on the main thread
    return {"flood_client": cpu_seconds(flood), "server_event_loop": loop, "server_other": total - loop}


def median_ms(xs: list[float]) -> float:
    return round(statistics.median(xs) * 1e3, 1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--streams", type=int, default=80)
    parser.add_argument("--samples", type=int, default=5)
    parser.add_argument("--tree", type=Path, default=ROOT)
    parser.add_argument("--flood-client", choices=["raw", "httpx"], default="raw")
    parser.add_argument(
        "--server-arg",
        action="append",
        default=[],
        help="passed to brine serve (repeat: --server-arg=--threads=1)",
    )
    args = parser.parse_args()
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    log = tempfile.NamedTemporaryFile("w+", suffix=".log", delete=False)
    env = {**os.environ, "PYTHONPATH": str(args.tree)}
    server = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "server.cli",
            "serve",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            *args.server_arg,
        ],
        cwd=args.tree,
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    flood = None
    try:
        deadline = time.monotonic() + 300
        while True:
            try:
                model = httpx.get(f"{base}/v1/models", timeout=2).json()["data"][0]["id"]
                break
            except (httpx.HTTPError, KeyError, ValueError):
                if server.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"server did not start; log: {log.name}") from None
                time.sleep(0.5)
        client = httpx.Client()
        victim_ttft(base, model)  # warm-up
        victim_ttft(base, model, client)
        idle: dict[str, list[tuple[float, float]]] = {"fresh": [], "reused": []}
        for _ in range(args.samples):
            idle["fresh"].append(victim_ttft(base, model))
            idle["reused"].append(victim_ttft(base, model, client))
        script = FLOOD_RAW if args.flood_client == "raw" else FLOOD_HTTPX
        body = json.dumps({**FLOOD_BODY, "model": model})
        flood = subprocess.Popen(
            [sys.executable, "-c", script, f"{base}/v1/completions", str(args.streams), body]
        )
        time.sleep(15)  # the flood's streams admitted and decoding
        before, t0 = cpu_snapshot(server.pid, flood.pid), time.monotonic()
        tokens0 = generated_tokens(base)
        busy: dict[str, list[tuple[float, float]]] = {"fresh": [], "reused": []}
        for _ in range(args.samples):
            busy["fresh"].append(victim_ttft(base, model))
            time.sleep(0.5)
            busy["reused"].append(victim_ttft(base, model, client))
            time.sleep(0.5)
        after, elapsed = cpu_snapshot(server.pid, flood.pid), time.monotonic() - t0
        tokens_per_s = (generated_tokens(base) - tokens0) / elapsed
        report: dict[str, object] = {
            "tree": str(args.tree),
            "streams": args.streams,
            "flood_client": args.flood_client,
            "server_args": args.server_arg,
            "running_at_end": running_requests(base),
            "load_average": [round(x, 2) for x in os.getloadavg()],
            "cpu_cores_while_flooded": {k: round((after[k] - before[k]) / elapsed, 2) for k in after},
            # The flood's cost of the victims beside it: tokens per second while they come and go.
            "flooded_tokens_per_s": round(tokens_per_s, 1),
        }
        for kind in ("fresh", "reused"):
            for i, name in enumerate(("ttft", "itl")):
                quiet, flooded = [x[i] for x in idle[kind]], [x[i] for x in busy[kind]]
                report[f"{kind}_{name}"] = {
                    "idle_ms": [round(t * 1e3, 1) for t in quiet],
                    "flooded_ms": [round(t * 1e3, 1) for t in flooded],
                    "idle_median_ms": median_ms(quiet),
                    "flooded_median_ms": median_ms(flooded),
                    "ratio": round(statistics.median(flooded) / statistics.median(quiet), 2),
                }
        print(json.dumps(report, indent=2))
    finally:
        if flood is not None:
            flood.kill()
        server.terminate()
        server.wait(timeout=60)


if __name__ == "__main__":
    main()
