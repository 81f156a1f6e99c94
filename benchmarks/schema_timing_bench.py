"""Can a tenant time another tenant's JSON schema? (issue 28, section 2)

Starts `brine serve` (keyless, loopback, the default model). Each round makes a fresh schema holding an enum
of random names (a secret worth guessing) and a second schema of the same shape and size. Tenant A (salt "a")
sends the first; then tenant B (salt "b") sends A's schema and the fresh one, in alternating order. If the
compiled-grammar cache were shared, B's request with A's schema would skip the compile and answer faster. The
report gives both medians over the rounds and their ratio (about 1 when B cannot tell), plus A's own second
send of its schema (a real cache hit, for scale). Figures only: nothing is asserted.

    python -m benchmarks.schema_timing_bench [--rounds 10] [--names 400] [--tree DIR]

`--tree DIR`: run the server from another checkout, e.g. one from before the cache was namespaced.
"""

from __future__ import annotations

if __package__ in (None, ""):  # run as a script: make `benchmarks` importable
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from benchmarks.salt_flood_bench import free_port

ROOT = Path(__file__).resolve().parents[1]
MESSAGES = [{"role": "user", "content": "Name a customer."}]


def schema(rng: random.Random, names: int) -> dict:
    """An object with one field whose value is one of `names` random 12-letter names."""
    values = ["".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(12)) for _ in range(names)]
    return {"type": "object", "properties": {"customer": {"enum": values}}, "required": ["customer"]}


def timed(client: httpx.Client, base: str, model: str, salt: str, body_schema: dict) -> float:
    body = {
        "model": model,
        "messages": MESSAGES,
        "max_tokens": 4,
        "temperature": 0,
        "cache_salt": salt,
        "response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": body_schema}},
    }
    start = time.perf_counter()
    r = client.post(f"{base}/v1/chat/completions", json=body, timeout=300)
    elapsed = time.perf_counter() - start
    r.raise_for_status()
    return elapsed


def start_server(tree: Path) -> tuple[subprocess.Popen, str, str]:
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    log = tempfile.NamedTemporaryFile("w+", suffix=".log", delete=False)
    cmd = [sys.executable, "-m", "server.cli", "serve", "--host", "127.0.0.1", "--port", str(port)]
    env = {**os.environ, "PYTHONPATH": str(tree)}
    server = subprocess.Popen(cmd, cwd=tree, env=env, stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 300
    while True:
        try:
            return server, base, httpx.get(f"{base}/v1/models", timeout=2).json()["data"][0]["id"]
        except (httpx.HTTPError, KeyError, ValueError):
            if server.poll() is not None or time.monotonic() > deadline:
                server.kill()
                raise RuntimeError(f"server did not start; log: {log.name}") from None
            time.sleep(0.5)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--names", type=int, default=400, help="enum values per schema (its compile cost)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tree", type=Path, default=ROOT)
    args = parser.parse_args()
    rng = random.Random(args.seed)
    server, base, model = start_server(args.tree)
    seen, fresh, own_hit = [], [], []
    try:
        with httpx.Client() as client:
            timed(client, base, model, "warm", schema(rng, args.names))  # first compile pays one-off costs
            for i in range(args.rounds):
                secret, other = schema(rng, args.names), schema(rng, args.names)
                timed(client, base, model, "a", secret)  # tenant A compiles its schema
                own_hit.append(timed(client, base, model, "a", secret))
                pair = [("seen", secret), ("fresh", other)]
                for kind, s in pair if i % 2 == 0 else pair[::-1]:  # alternate which goes first
                    (seen if kind == "seen" else fresh).append(timed(client, base, model, "b", s))
    finally:
        server.terminate()
        server.wait(timeout=30)
    report = {
        "rounds": args.rounds,
        "names": args.names,
        "load_average": os.getloadavg()[0],
        "b_with_a_schema_median_ms": round(statistics.median(seen) * 1e3, 1),
        "b_with_fresh_schema_median_ms": round(statistics.median(fresh) * 1e3, 1),
        "seen_over_fresh": round(statistics.median(seen) / statistics.median(fresh), 3),
        "a_cache_hit_median_ms": round(statistics.median(own_hit) * 1e3, 1),
    }
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
