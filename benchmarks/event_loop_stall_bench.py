"""A victim's time to first token beside requests that cost the server work off the engine (issue 28, section 3):
heavy `/detokenize` bodies and over-long prompts (refused with the context-length 400 once tokenizing passes
the limit).

Starts `brine serve` (keyless, loopback, the default model). For each attack the victim's 5-token TTFT (one
reused client, so the figure is the server's) is measured idle, then while another process sends that attack
back to back, then idle again; the report gives the medians and the ratio to the idle median around it.
Figures only: nothing is asserted.

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

from benchmarks.salt_flood_bench import victim_ttft
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
        with httpx.Client() as client:
            for _ in range(3):
                victim_ttft(base, model, client)
            for name, (route, body) in attacks(model).items():
                before = [victim_ttft(base, model, client) for _ in range(args.samples)]
                body_file = tempfile.NamedTemporaryFile(suffix=".json", delete=False)  # too big for argv
                body_file.write(body)
                body_file.close()
                proc = subprocess.Popen(
                    [sys.executable, "-c", ATTACKER, base + route, body_file.name], stdout=subprocess.PIPE
                )
                time.sleep(1.0)
                attacked = [victim_ttft(base, model, client) for _ in range(args.samples)]
                proc.terminate()
                statuses = json.loads(proc.communicate(timeout=30)[0] or b"{}")
                os.unlink(body_file.name)
                after = [victim_ttft(base, model, client) for _ in range(args.samples)]
                idle = statistics.median(before + after)
                report[name] = {
                    "idle_median_ms": round(idle * 1e3, 1),
                    "attacked_median_ms": round(statistics.median(attacked) * 1e3, 1),
                    "ratio": round(statistics.median(attacked) / idle, 2),
                    "attacker_statuses": statuses,
                }
    finally:
        server.terminate()
        server.wait(timeout=30)
    report["load_average_end"] = {"1min": os.getloadavg()[0]}
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
