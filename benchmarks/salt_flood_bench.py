"""A flood under one cache salt against another salt's time to first token (issue 28, section 4).

Starts `brine serve` (keyless, loopback, the default model), measures a victim's TTFT under salt "b" while
idle, then while another process keeps `--streams` streams running under salt "a", and prints both medians
and their ratio. Figures only: nothing is asserted (these machines are noisy).

    python -m benchmarks.salt_flood_bench [--streams 80] [--samples 5] [--tree DIR]

`--tree DIR`: run the server from another checkout (an older commit's worktree) to compare before and after.
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

FLOOD = """
import json, sys, threading, httpx
url, n = sys.argv[1], int(sys.argv[2])
body = {"model": sys.argv[3], "prompt": "Once upon a time", "max_tokens": 400, "ignore_eos": True,
        "temperature": 0, "stream": True, "cache_salt": "a"}
def run():
    while True:
        with httpx.stream("POST", url, json=body, timeout=600) as r:
            for _ in r.iter_lines():
                pass
for _ in range(n):
    threading.Thread(target=run, daemon=True).start()
threading.Event().wait()
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def victim_ttft(base: str, model: str) -> float:
    body = {"model": model, "prompt": VICTIM_PROMPT, "max_tokens": 5, "temperature": 0, "stream": True}
    body["cache_salt"] = "b"
    start = time.perf_counter()
    with httpx.stream("POST", f"{base}/v1/completions", json=body, timeout=300) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if line.startswith("data: ") and '"text"' in line:
                return time.perf_counter() - start
    raise RuntimeError("the victim got no token")


def running_requests(base: str) -> float:
    for line in httpx.get(f"{base}/metrics", timeout=10).text.splitlines():
        if line.startswith("brine_num_requests_running") or line.startswith("vllm:num_requests_running"):
            return float(line.rsplit(" ", 1)[1])
    return -1.0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--streams", type=int, default=80)
    parser.add_argument("--samples", type=int, default=5)
    parser.add_argument("--tree", type=Path, default=ROOT)
    args = parser.parse_args()
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    log = tempfile.NamedTemporaryFile("w+", suffix=".log", delete=False)
    env = {**os.environ, "PYTHONPATH": str(args.tree)}
    server = subprocess.Popen(
        [sys.executable, "-m", "server.cli", "serve", "--host", "127.0.0.1", "--port", str(port)],
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
        victim_ttft(base, model)  # warm-up
        idle = [victim_ttft(base, model) for _ in range(args.samples)]
        flood = subprocess.Popen(
            [sys.executable, "-c", FLOOD, f"{base}/v1/completions", str(args.streams), model]
        )
        time.sleep(15)  # the flood's streams admitted and decoding
        busy = []
        for _ in range(args.samples):
            busy.append(victim_ttft(base, model))
            time.sleep(1)
        report = {
            "tree": str(args.tree),
            "streams": args.streams,
            "running_at_end": running_requests(base),
            "idle_ttft_s": [round(t, 3) for t in idle],
            "flooded_ttft_s": [round(t, 3) for t in busy],
            "idle_median_s": round(statistics.median(idle), 3),
            "flooded_median_s": round(statistics.median(busy), 3),
            "ratio": round(statistics.median(busy) / statistics.median(idle), 2),
        }
        print(json.dumps(report, indent=2))
    finally:
        if flood is not None:
            flood.kill()
        server.terminate()
        server.wait(timeout=60)


if __name__ == "__main__":
    main()
