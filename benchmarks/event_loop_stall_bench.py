"""A victim's time to first token beside requests that cost the server work off the engine (issue 28, section 3):
heavy `/detokenize` bodies and over-long prompts (refused with the context-length 400 once tokenizing passes
the limit).

Starts `brine serve` (keyless, loopback, the default model). For each attack the victim's TTFT and median gap
between tokens (a 5-token prompt, 16 greedy tokens, one reused client, so the figures are the server's) are
measured idle, then while another process sends that attack back to back, then idle again; the report gives
the medians and the ratios to the idle medians around them. First, idle, `/detokenize`'s own latency for a
5-id and a 32,768-id body (the normal path, to compare trees with `--tree`). Figures only: nothing is asserted.

    python -m benchmarks.event_loop_stall_bench [--samples 9] [--tree DIR]
"""

from __future__ import annotations

if __package__ in (None, ""):  # run as a script: make `benchmarks` importable
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from benchmarks.salt_flood_bench import VICTIM_PROMPT
from benchmarks.schema_timing_bench import ROOT, start_server

# The attacker loops in its own process, so its client work does not slow this one's (the GIL); it prints
# the statuses it got when it is stopped.
ATTACKER = """
import collections, json, signal, sys, httpx
url, body = sys.argv[1], open(sys.argv[2], "rb").read()
seen = collections.Counter()
def report(*_):
    print(json.dumps(seen), flush=True)
    sys.exit(0)
signal.signal(signal.SIGTERM, report)
with httpx.Client(timeout=300) as c:
    while True:
        seen[c.post(url, content=body, headers={"content-type": "application/json"}).status_code] += 1
"""


def victim(base: str, model: str, client: httpx.Client) -> tuple[float, float]:
    """The victim's TTFT and its median gap between tokens (16 greedy tokens, one reused client), seconds."""
    body = {"model": model, "prompt": VICTIM_PROMPT, "max_tokens": 16, "temperature": 0, "stream": True}
    body.update(cache_salt="b", ignore_eos=True)
    start = time.perf_counter()
    stamps: list[float] = []
    with client.stream("POST", f"{base}/v1/completions", json=body, timeout=300) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if line.startswith("data: ") and '"text"' in line:
                stamps.append(time.perf_counter())
    if len(stamps) < 2:
        raise RuntimeError("the victim got fewer than 2 tokens")
    return stamps[0] - start, statistics.median(b - a for a, b in zip(stamps, stamps[1:], strict=False))


def route_latency(client: httpx.Client, url: str, body: bytes, n: int) -> float:
    """Median seconds of one request to `url` on an idle server (the route's own cost, the normal path)."""
    times = []
    for _ in range(n):
        start = time.perf_counter()
        client.post(url, content=body, headers={"content-type": "application/json"}).raise_for_status()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def attacks(model: str) -> dict[str, tuple[str, bytes]]:
    """name -> (route, body). /detokenize: 32,768 ids (the default --max-detokenize-tokens), each a long
    token; over-long prompt: ~4 MB of text, far past the 8,192-token context."""
    detok = {"model": model, "tokens": [12345] * 32768}
    long_prompt = {"model": model, "prompt": "lorem ipsum dolor sit amet " * 150_000, "max_tokens": 1}
    return {
        "detokenize": ("/detokenize", json.dumps(detok).encode()),
        "over-long prompt": ("/v1/completions", json.dumps(long_prompt).encode()),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--samples", type=int, default=9)
    parser.add_argument("--tree", type=Path, default=ROOT)
    args = parser.parse_args()
    server, base, model = start_server(args.tree)
    report: dict[str, dict] = {"load_average_start": {"1min": os.getloadavg()[0]}}
    try:
        with httpx.Client(timeout=300) as client:
            for _ in range(3):
                victim(base, model, client)
            small = json.dumps({"model": model, "tokens": VICTIM_PROMPT}).encode()
            _, big = attacks(model)["detokenize"]
            route_latency(client, base + "/detokenize", small, 3)  # the workers started
            report["detokenize_alone_ms"] = {
                "5 ids": round(route_latency(client, base + "/detokenize", small, 50) * 1e3, 2),
                "32768 ids": round(route_latency(client, base + "/detokenize", big, 15) * 1e3, 1),
            }
            for name, (route, body) in attacks(model).items():
                before = [victim(base, model, client) for _ in range(args.samples)]
                body_file = tempfile.NamedTemporaryFile(suffix=".json", delete=False)  # too big for argv
                body_file.write(body)
                body_file.close()
                proc = subprocess.Popen(
                    [sys.executable, "-c", ATTACKER, base + route, body_file.name], stdout=subprocess.PIPE
                )
                time.sleep(1.0)
                attacked = [victim(base, model, client) for _ in range(args.samples)]
                proc.terminate()
                statuses = json.loads(proc.communicate(timeout=30)[0] or b"{}")
                os.unlink(body_file.name)
                after = [victim(base, model, client) for _ in range(args.samples)]
                entry: dict[str, object] = {"attacker_statuses": statuses}
                for i, what in enumerate(("ttft", "itl")):
                    idle = statistics.median(t[i] for t in before + after)
                    busy = statistics.median(t[i] for t in attacked)
                    entry[f"{what}_idle_median_ms"] = round(idle * 1e3, 1)
                    entry[f"{what}_attacked_median_ms"] = round(busy * 1e3, 1)
                    entry[f"{what}_ratio"] = round(busy / idle, 2)
                report[name] = entry
    finally:
        server.terminate()
        server.wait(timeout=30)
    report["load_average_end"] = {"1min": os.getloadavg()[0]}
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
