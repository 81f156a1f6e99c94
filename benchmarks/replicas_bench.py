"""The `replicas` workload against one Brine replica and against two behind vllm-router with each policy.

Two `brine serve` replicas start once (KV events on, an operator key); each configuration runs the workload
(`benchmarks.workloads.replicas`: documents spread over waves, all in flight) after both caches are reset:
one replica direct (the ceiling), then the router with round_robin, cache_aware, kv_aware (fed by Brine's
KV events) and consistent_hash (routing on the requests' X-Session-ID); then one replica, kv_aware and
consistent_hash again with a cache_salt per document (a tenant's traffic). Reported per configuration: hit ratio
(cached / prompt tokens from `usage`), req/s, TTFT p50/p90 and how many requests each replica served.

    .venv/bin/python -m benchmarks.replicas_bench          # part of `make bench`; skips without vllm-router
"""

from __future__ import annotations

if __package__ in (None, ""):  # run as a script: make `benchmarks` importable
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import argparse
import asyncio
import datetime
import json
import secrets
import shutil
import socket
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import httpx

from benchmarks.compare import ServerSpec, free_port, stop, wait_ready
from benchmarks.report import fmt, percentile
from benchmarks.results import WorkloadResult
from benchmarks.serve_bench import run_workload
from benchmarks.workloads import replicas

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
BLOCK_SIZE = 16
POLICIES = ("round_robin", "cache_aware", "kv_aware", "consistent_hash")
# (name, router policy or None for one replica direct, salted requests)
CONFIGS = [("one replica", None, False), *((p, p, False) for p in POLICIES), ("one replica, salted", None, True),
           ("kv_aware, salted", "kv_aware", True), ("consistent_hash, salted", "consistent_hash", True)]  # fmt: skip


@dataclass(slots=True)
class Replica:
    spec: ServerSpec
    events_port: int
    proc: subprocess.Popen


def _free_pair() -> int:
    """A free port whose successor is free too: the KV event socket and its replay socket (PORT + 1)."""
    for _ in range(100):
        port = free_port()
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port + 1))
            except OSError:
                continue
        return port
    raise RuntimeError("no two consecutive free ports")


def _brine(name: str, key: str, log_dir: Path, taken: set[int]) -> Replica:
    events = _free_pair()
    while events in taken or events + 1 in taken:
        events = _free_pair()
    port = free_port()
    while port in taken or port in (events, events + 1):
        port = free_port()
    taken.update((port, events, events + 1))
    exe = ROOT / ".venv" / "bin" / "brine"
    base = [str(exe)] if exe.exists() else [sys.executable, "-m", "server.cli"]
    cmd = [*base, "serve", "--host", "127.0.0.1", "--port", str(port), "--api-key", key,
           "--kv-events-endpoint", f"tcp://127.0.0.1:{events}"]  # fmt: skip
    spec = ServerSpec(name, f"http://127.0.0.1:{port}", cmd, api_key=key)
    with open(log_dir / f"{name}.log", "wb") as log:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
    return Replica(spec, events, proc)


def _router(
    policy: str, reps: list[Replica], model: str, key: str, log: Path
) -> tuple[ServerSpec, subprocess.Popen]:
    exe = shutil.which("vllm-router", path=str(Path(sys.executable).parent)) or "vllm-router"
    port = free_port()
    cmd = [exe, "--host", "127.0.0.1", "--port", str(port), "--policy", policy, "--api-key", key,
           "--worker-urls", *(r.spec.base_url for r in reps)]  # fmt: skip
    if policy == "kv_aware":
        cmd += ["--kv-event-model", model, "--kv-event-block-size", str(BLOCK_SIZE)]
        for r in reps:
            cmd += ["--kv-event-source", f"{r.spec.base_url}=tcp://127.0.0.1:{r.events_port}"]
            cmd += ["--kv-event-replay-source", f"{r.spec.base_url}=tcp://127.0.0.1:{r.events_port + 1}"]
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
    return ServerSpec(f"router-{policy}", f"http://127.0.0.1:{port}", cmd, api_key=key), proc


def _successes(rep: Replica) -> float:
    headers = {"Authorization": f"Bearer {rep.spec.api_key}"}
    text = httpx.get(f"{rep.spec.base_url}/metrics", headers=headers, timeout=30).text
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("brine_request_success_total{")
    )


def summarize(name: str, r: WorkloadResult, served: list[float]) -> dict:
    ok = [q for q in r.requests if q.ok]
    prompt = sum(q.prompt_tokens or 0 for q in ok)
    cached = sum(q.cached_tokens or 0 for q in ok)
    ttfts = [q.ttft for q in ok if q.ttft is not None]
    return {
        "config": name,
        "requests": len(r.requests),
        "failed": len(r.requests) - len(ok),
        "hit_ratio": cached / prompt if prompt else None,
        "req_per_s": len(ok) / r.duration if r.duration else None,
        "ttft_p50": percentile(ttfts, 50),
        "ttft_p90": percentile(ttfts, 90),
        "served": served,
    }


def markdown(rows: list[dict], params: dict) -> str:
    ceilings = {False: rows[0]["hit_ratio"] or 0.0}
    ceilings[True] = next((r["hit_ratio"] for r in rows if r["config"] == "one replica, salted"), None) or 0.0
    lines = [
        f"# replicas: {params['docs']} documents of ~{params['doc_tokens']} tokens, {params['questions']} questions "
        "each, all documents in flight (vllm-router, 2 Brine replicas; salted: a cache_salt per document)",
        "",
        "| configuration | hit ratio | of ceiling | req/s | TTFT p50 | TTFT p90 | requests per replica |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        ceiling = ceilings["salted" in row["config"]]
        share = row["hit_ratio"] / ceiling if ceiling and row["hit_ratio"] is not None else None
        lines.append(
            f"| {row['config']} | {fmt(row['hit_ratio'])} | {fmt(share, digits=2)} | {fmt(row['req_per_s'], digits=2)} "
            f"| {fmt(row['ttft_p50'], 's')} | {fmt(row['ttft_p90'], 's')} | {'/'.join(str(int(n)) for n in row['served'])} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> Path | None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--docs", type=int, default=3)
    ap.add_argument("--doc-tokens", type=int, default=800)
    ap.add_argument("--questions", type=int, default=4)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    if shutil.which("vllm-router", path=str(Path(sys.executable).parent)) is None and not shutil.which(
        "vllm-router"
    ):
        print("replicas benchmark skipped: vllm-router is not installed (pip install vllm-router)")
        return None
    key = secrets.token_urlsafe(16)
    log_dir = Path(tempfile.mkdtemp(prefix="brine-replicas-"))  # servers' and routers' logs, kept for a look
    print(f"logs: {log_dir}")
    taken: set[int] = set()
    reps = [_brine(f"replica{i}", key, log_dir, taken) for i in range(2)]
    rows: list[dict] = []
    try:
        for r in reps:
            wait_ready(r.spec, r.proc, log_dir / f"{r.spec.name}.log", 900)
        model = httpx.get(
            f"{reps[0].spec.base_url}/v1/models", headers={"Authorization": f"Bearer {key}"}
        ).json()
        model = model["data"][0]["id"]
        for i, (config, policy, salted) in enumerate(CONFIGS):
            for r in reps:
                httpx.post(
                    f"{r.spec.base_url}/reset_prefix_cache",
                    headers={"Authorization": f"Bearer {key}"},
                    timeout=60,
                )
            router = None
            if policy is None:
                target = reps[0].spec
            else:
                log = log_dir / f"router-{policy}.log"
                target, router = _router(policy, reps, model, key, log)
                wait_ready(target, router, log, 120)
            before = [_successes(r) for r in reps]
            workload = replicas(args.seed + i, args.docs, args.doc_tokens, args.questions, salted=salted)
            result = asyncio.run(
                run_workload(target.base_url, workload, model=model, server=config, api_key=key)
            )
            served = [_successes(r) - b for r, b in zip(reps, before, strict=True)]
            rows.append(summarize(config, result, served))
            if router is not None:
                stop(router)
    finally:
        for r in reps:
            stop(r.proc)
    text = markdown(rows, {"docs": args.docs, "doc_tokens": args.doc_tokens, "questions": args.questions})
    out = args.out or RESULTS / f"{datetime.date.today().isoformat()}-replicas.md"
    out.write_text(text)
    out.with_suffix(".json").write_text(json.dumps(rows, indent=2))
    print(text)
    return out


if __name__ == "__main__":
    main()
