"""Single-request latency over HTTP, Brine against llama-cpp-python and vLLM's CPU build on the same machine,
in one run.

What one request's step time costs (issue 12's targets), measured at the client over streamed
`/v1/completions` against servers that are already running:

- **5-token TTFT**: a ~5-token prompt, `max_tokens=1`; a different prompt each time (nothing cached);
- **warm TTFT**: a ~2,000-token prompt sent again right after itself (`max_tokens=1`);
- **cold TTFT**: the first send of that prompt, and of `--cold-repeats` other ~2,000-token documents that share
  no block with anything sent before (each starts with its own random id); the median of those sends. One send
  alone moved a peer's figure by half between runs (vLLM CPU 2.1 s, then 3.2 s, on the same machine);
- **decode tok/s**: one stream of `--decode-tokens` tokens with `ignore_eos` (llama-cpp-python has no
  `ignore_eos`: it gets `logit_bias` -100 on the EOS ids instead), tokens after the first over the time from
  the first to the last.

Each measure is the median over `--repeats`. The measures run kind by kind, each on every server in turn
(llama-cpp-python keeps only its previous request's prefix, so a server's warm sends must follow each other).
Ratios are Brine over llama-cpp-python and over vLLM CPU (`--vllm NAME`), with issue 29's targets beside
them; without a peer only Brine's own figures and its warm / 5-token ratio are given.

    .venv/bin/python -m benchmarks.latency_bench --server brine=http://127.0.0.1:8000 \\
        --server llama=http://127.0.0.1:8001 --llama llama
`make bench` runs it as the `latency` workload of `benchmarks/compare.py`, which starts both servers.
"""

from __future__ import annotations

if __package__ in (None, ""):  # run as a script: make `benchmarks` importable
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import argparse
import asyncio
import json
import random
import statistics
import time
from dataclasses import asdict, dataclass, field

import httpx

from benchmarks.quiet import wait_quiet
from benchmarks.workloads import document

# (measure, target as text, test on the ratio): issue 29's targets for Brine over each peer, measured in one
# run on the same machine. llama-cpp-python is the single-stream reference; vLLM's CPU build the batching peer.
TARGETS = {
    "ttft_short": ("<= 1.5x", lambda r: r <= 1.5),
    "ttft_warm": ("<= 2x", lambda r: r <= 2.0),
    "decode_tok_s": (">= 1x", lambda r: r >= 1.0),
}
VLLM_TARGETS = {
    "ttft_short": ("<= 1x", lambda r: r <= 1.0),
    "ttft_warm": ("<= 0.5x", lambda r: r <= 0.5),
    "ttft_cold_long": ("<= 0.7x", lambda r: r <= 0.7),
}
WARM_OVER_SHORT_TARGET = 1.5  # Brine's warm TTFT over its own 5-token TTFT


@dataclass(slots=True)
class LatencyResult:
    server: str
    ttft_short: list[float] = field(default_factory=list)  # seconds
    ttft_cold_long: list[float] = field(default_factory=list)  # the first send of each distinct document
    ttft_warm: list[float] = field(default_factory=list)
    decode_tok_s: list[float] = field(default_factory=list)
    prompt_tokens_short: int | None = None  # from usage, where the server reports it
    prompt_tokens_long: int | None = None
    errors: list[str] = field(default_factory=list)

    def median(self, measure: str) -> float | None:
        values = getattr(self, measure)
        return statistics.median(values) if values else None


@dataclass(slots=True)
class Stream:
    token_times: list[float]  # seconds since the request was sent, one per non-empty text chunk
    completion_tokens: int | None
    prompt_tokens: int | None
    finish_reason: str | None


async def stream(client: httpx.AsyncClient, url: str, body: dict) -> Stream:
    body = {**body, "stream": True, "stream_options": {"include_usage": True}, "temperature": 0.0}
    start = time.perf_counter()
    times: list[float] = []
    usage: dict = {}
    finish = None
    async with client.stream("POST", f"{url}/v1/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {(await r.aread()).decode(errors='replace')[:200]}")
        async for line in r.aiter_lines():
            if not line.startswith("data:") or line[5:].strip() == "[DONE]":
                continue
            event = json.loads(line[5:])
            if event.get("error"):
                raise RuntimeError(f"error event: {event['error']}")
            for choice in event.get("choices") or []:
                if choice.get("text"):
                    times.append(time.perf_counter() - start)
                finish = choice.get("finish_reason") or finish
            usage = event.get("usage") or usage
    return Stream(times, usage.get("completion_tokens"), usage.get("prompt_tokens"), finish)


WORDS = (
    "apple river stone cloud tiger piano garden window candle forest silver rabbit ocean pencil mirror castle"
)


def short_prompt(i: int) -> str:
    """5 tokens with the default model's tokenizer (a bos-less BPE: every word here is one token); a
    different prompt for each i below 16, so that none is cached."""
    words = WORDS.split()
    return f"Please say {words[i % len(words)]} once more"


async def measure(
    servers: dict[str, str],
    *,
    llama: str | None = None,
    eos_token_ids: list[int] = (),  # type: ignore[assignment]
    repeats: int = 5,
    cold_repeats: int = 2,
    long_tokens: int = 2150,
    decode_tokens: int = 128,
    seed: int = 0,
    model: str | None = None,
    gap_s: float = 0.0,
    quiet_s: float = 5.0,
) -> list[LatencyResult]:
    """Every measure on every server (name -> base URL). `llama`: the name of the llama-cpp-python server,
    which gets `logit_bias` on `eos_token_ids` in place of `ignore_eos`. `gap_s`: idle time before each
    timed warm or 5-token request (0: back to back), for TTFT under sporadic traffic. `cold_repeats`: documents
    sent once each after the warm sends, for the cold TTFT's median. `quiet_s`: the longest wait, before each
    server's turn at each measure, for the CPUs to go idle (benchmarks/quiet.py; 0: none)."""
    long_prompt = document(random.Random(seed), long_tokens, "latency")
    results = {name: LatencyResult(name) for name in servers}
    async with httpx.AsyncClient(timeout=600) as client:
        models = {}
        for name, url in servers.items():
            models[name] = model or (await client.get(f"{url}/v1/models")).json()["data"][0]["id"]

        async def each(fn) -> None:  # type: ignore[no-untyped-def]
            for name, url in servers.items():
                await wait_quiet(max_wait_s=quiet_s)  # the server before may still be busy
                try:
                    await fn(results[name], url.rstrip("/"), models[name], name == llama)
                except (httpx.HTTPError, RuntimeError, json.JSONDecodeError) as exc:
                    results[name].errors.append(f"{fn.__name__}: {type(exc).__name__}: {exc}"[:300])

        async def warm(res: LatencyResult, url: str, model: str, _: bool) -> None:
            body = {"model": model, "prompt": long_prompt, "max_tokens": 1}
            first = await stream(client, url, body)
            res.ttft_cold_long += first.token_times[:1]
            res.prompt_tokens_long = first.prompt_tokens
            for _ in range(repeats):
                await asyncio.sleep(gap_s)
                s = await stream(client, url, body)
                if s.token_times:
                    res.ttft_warm.append(s.token_times[0])

        async def cold(res: LatencyResult, url: str, model: str, _: bool) -> None:
            for i in range(cold_repeats):  # after the warm sends: llama-cpp-python keeps only the last prompt
                prompt = document(random.Random(f"{seed} cold {i}"), long_tokens, "latency, cold")
                s = await stream(client, url, {"model": model, "prompt": prompt, "max_tokens": 1})
                res.ttft_cold_long += s.token_times[:1]

        async def short(res: LatencyResult, url: str, model: str, _: bool) -> None:
            for i in range(repeats):
                await asyncio.sleep(gap_s)
                s = await stream(
                    client, url, {"model": model, "prompt": short_prompt(seed + i), "max_tokens": 1}
                )
                res.prompt_tokens_short = s.prompt_tokens or res.prompt_tokens_short
                if s.token_times:
                    res.ttft_short.append(s.token_times[0])

        async def decode(res: LatencyResult, url: str, model: str, is_llama: bool) -> None:
            body: dict = {"model": model, "prompt": "Once upon a time", "max_tokens": decode_tokens}
            if is_llama:
                body["logit_bias"] = {str(t): -100.0 for t in eos_token_ids}
            else:
                body["ignore_eos"] = True
            for _ in range(repeats):
                s = await stream(client, url, body)
                n = len(s.token_times)
                if n < min(decode_tokens, 64):
                    res.errors.append(f"decode: the stream ended after {n} tokens ({s.finish_reason})")
                elif s.token_times[-1] > s.token_times[0]:
                    res.decode_tok_s.append((n - 1) / (s.token_times[-1] - s.token_times[0]))

        for fn in (warm, cold, short, decode):
            await each(fn)
    return list(results.values())


def _over(b: LatencyResult | None, peer: LatencyResult | None, measure: str) -> float | None:
    x = b.median(measure) if b else None
    y = peer.median(measure) if peer else None
    return x / y if x is not None and y else None


def ratios(
    results: list[LatencyResult], brine: str, llama: str | None, vllm: str | None = None
) -> dict[str, float | None]:
    """Brine / llama-cpp-python per measure (None where either is missing), Brine / vLLM CPU per measure of
    VLLM_TARGETS (keys `vllm_<measure>`, only with a vLLM server), and Brine's warm / 5-token."""
    by = {r.server: r for r in results}
    b = by.get(brine)
    out: dict[str, float | None] = {m: _over(b, by.get(llama) if llama else None, m) for m in TARGETS}
    if vllm is not None:
        out |= {f"vllm_{m}": _over(b, by.get(vllm), m) for m in VLLM_TARGETS}
    ws = (b.median("ttft_warm"), b.median("ttft_short")) if b else (None, None)
    out["brine_warm_over_short"] = ws[0] / ws[1] if ws[0] is not None and ws[1] else None
    return out


def _ms(x: float | None) -> str:
    return "n/a" if x is None else f"{1e3 * x:.1f} ms"


def _verdict(ok: bool) -> str:
    return "met" if ok else "**not met**"


NAMES = {
    "ttft_short": "5-token TTFT",
    "ttft_warm": "warm TTFT",
    "decode_tok_s": "decode tok/s",
    "ttft_cold_long": "cold TTFT (~2k tokens)",
}


def _target_rows(rat: dict[str, float | None], targets: dict, prefix: str = "") -> list[str]:
    rows = []
    for m, (target, test) in targets.items():
        r = rat.get(prefix + m)
        verdict = "" if r is None else _verdict(test(r))
        rows.append(f"| {NAMES[m]} | {'n/a' if r is None else f'{r:.2f}x'} | {target} | {verdict} |")
    return rows


def markdown(results: list[LatencyResult], brine: str, llama: str | None, vllm: str | None = None) -> str:
    lines = [
        "## Single-request latency (issue 29's targets)",
        "",
        "Streamed `/v1/completions`, medians; 5-token TTFT: `max_tokens=1`, a new prompt each time; warm TTFT: a "
        "~2,000-token prompt sent again right after itself; cold TTFT: the median of the first sends of that prompt "
        "and of other ~2,000-token documents (`--cold-repeats`); decode: one stream, `ignore_eos` (llama-cpp-python: "
        "`logit_bias` on EOS), tokens after the first over the time from the first to the last "
        "(`benchmarks/latency_bench.py`).",
        "",
        "| server | 5-token TTFT | warm TTFT (~2k tokens) | cold TTFT (median of each prompt's first send) | "
        "decode tok/s | prompt tokens (short / long) |",
        "|---|---|---|---|---|---|",
    ]
    for r in results:
        dec = r.median("decode_tok_s")
        lines.append(
            f"| {r.server} | {_ms(r.median('ttft_short'))} | {_ms(r.median('ttft_warm'))} | "
            f"{_ms(r.median('ttft_cold_long'))} | {'n/a' if dec is None else f'{dec:.1f}'} | "
            f"{r.prompt_tokens_short or 'n/a'} / {r.prompt_tokens_long or 'n/a'} |"
        )
    rat = ratios(results, brine, llama, vllm)
    lines += ["", f"| {brine} / {llama or 'llama-cpp-python'} | measured | target | |", "|---|---|---|---|"]
    lines += _target_rows(rat, TARGETS)
    w = rat["brine_warm_over_short"]
    lines.append(
        f"| {brine}'s warm TTFT / its 5-token TTFT | {'n/a' if w is None else f'{w:.2f}x'} | "
        f"<= {WARM_OVER_SHORT_TARGET}x | {'' if w is None else _verdict(w <= WARM_OVER_SHORT_TARGET)} |"
    )
    if vllm is not None:
        lines += ["", f"| {brine} / {vllm} | measured | target | |", "|---|---|---|---|"]
        lines += _target_rows(rat, VLLM_TARGETS, "vllm_")
    if llama is None:
        lines += ["", "No llama-cpp-python server ran: Brine's figures only."]
    errors = [f"- {r.server}: `{e}`" for r in results for e in r.errors[:3]]
    if errors:
        lines += ["", "Errors:", "", *errors]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--server", action="append", required=True, metavar="NAME=URL", help="repeatable")
    p.add_argument("--brine", default=None, help="which NAME is Brine (default: the first)")
    p.add_argument("--llama", default=None, help="which NAME is llama-cpp-python (default: none)")
    p.add_argument("--vllm", default=None, help="which NAME is vLLM's CPU build (default: none)")
    p.add_argument(
        "--eos-token-ids", default="0,2", help="llama-cpp-python's logit_bias ids (default model's)"
    )
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument(
        "--cold-repeats", type=int, default=2, help="distinct documents sent once, beside the first"
    )
    p.add_argument(
        "--long-tokens", type=int, default=2150, help="size of the long prompt (~2,000 real tokens)"
    )
    p.add_argument("--decode-tokens", type=int, default=128)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--gap-ms", type=float, default=0.0, help="idle time before each timed TTFT request (default: none)"
    )
    p.add_argument(
        "--quiet-wait", type=float, default=5.0, help="at most this long (s) for idle CPUs before each turn"
    )
    p.add_argument("--out", default=None, help="also write the results as JSON here")
    args = p.parse_args(argv)
    servers = dict(s.split("=", 1) for s in args.server)
    brine = args.brine or next(iter(servers))
    results = asyncio.run(
        measure(
            servers,
            llama=args.llama,
            eos_token_ids=[int(t) for t in args.eos_token_ids.split(",") if t],
            repeats=args.repeats,
            cold_repeats=args.cold_repeats,
            long_tokens=args.long_tokens,
            decode_tokens=args.decode_tokens,
            seed=args.seed,
            gap_s=args.gap_ms / 1000,
            quiet_s=args.quiet_wait,
        )
    )
    print(markdown(results, brine, args.llama, args.vllm))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(
                {
                    "results": [asdict(r) for r in results],
                    "ratios": ratios(results, brine, args.llama, args.vllm),
                },
                f,
            )


if __name__ == "__main__":
    main()
