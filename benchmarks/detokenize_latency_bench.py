"""`/detokenize`'s own latency, two trees side by side (issue 28: moving big bodies off the event loop must not
slow the normal path).

Starts `brine serve` (keyless, loopback, the default model) from `--tree` (say, a worktree of an older commit)
and from this checkout, both at once, and sends each body size to both, alternating which goes first, so that
a busy machine's drift falls on both alike. Prints the median milliseconds per size and tree. Figures only.

    python -m benchmarks.detokenize_latency_bench --tree DIR
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
import time
from pathlib import Path

import httpx

from benchmarks.event_loop_stall_bench import attacks
from benchmarks.salt_flood_bench import VICTIM_PROMPT
from benchmarks.schema_timing_bench import ROOT, start_server


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tree", type=Path, required=True, help="the other checkout")
    args = parser.parse_args()
    servers = {"tree": start_server(args.tree), "this": start_server(ROOT)}
    report: dict[str, object] = {"load_average_start": os.getloadavg()[0]}
    try:
        model = servers["this"][2]
        sizes = {
            "5 ids": (json.dumps({"model": model, "tokens": VICTIM_PROMPT}).encode(), 200),
            "1000 ids": (json.dumps({"model": model, "tokens": [12345] * 1000}).encode(), 100),
            "32768 ids": (attacks(model)["detokenize"][1], 30),
        }
        headers = {"content-type": "application/json"}
        with httpx.Client(timeout=60) as client:
            for name, (body, n) in sizes.items():
                times: dict[str, list[float]] = {"tree": [], "this": []}
                for i in range(n):
                    for which in ("tree", "this") if i % 2 == 0 else ("this", "tree"):
                        start = time.perf_counter()
                        client.post(servers[which][1] + "/detokenize", content=body, headers=headers)
                        times[which].append(time.perf_counter() - start)
                report[name] = {k: round(statistics.median(v) * 1e3, 2) for k, v in times.items()}
    finally:
        for server, _, _ in servers.values():
            server.terminate()
            server.wait(timeout=30)
    report["load_average_end"] = os.getloadavg()[0]
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
