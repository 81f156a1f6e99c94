"""Prompt-lookup speculation, Brine against llama-cpp-python's, on the same extraction prompts and GGUF.

Four arms, single stream, greedy, on spec_decode_bench's `extract` workload (a ~2,000-token contract, "quote
clause N word for word", the answer started with "Clause N."), taking turns per round (the order rotates:
these machines are noisy):

- `brine off` / `brine on`: one in-process Brine engine on the default model, its drafting switched per
  arm (as spec_decode_bench does), `--spec` the speculative config;
- `llama off` / `llama on`: llama-cpp-python (benchmarks/.venv-llamacpp) in a worker process on the GGUF
  Brine's default model is converted from (`engine.model.loading.files.default_gguf_path`), without and with
  `draft_model=LlamaPromptLookupDecoding(num_pred_tokens=N)`, which is what its server's `--draft_model
  prompt-lookup-decoding --draft_model_num_pred_tokens N` builds (llama_cpp/server/model.py). Its lookup
  tries n-grams of 2, then 1, tokens, the earliest occurrence first, and drafts N tokens every step.

Both get the same prompt token ids (Brine's chat template, rendered once). llama-cpp-python has no
`ignore_eos`, so both ban EOS (Brine with `ignore_eos`, llama with `logit_bias` -100 on the EOS ids), and
prefix caching is off in Brine; llama-cpp-python resets its context per prompt (each round's prompts are
new). Decode tok/s: the tokens after the first over the time from the first to the last.

    .venv/bin/python benchmarks/spec_llamacpp_bench.py --rounds 4
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
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LLAMACPP_PYTHON = ROOT / "benchmarks" / ".venv-llamacpp" / "bin" / "python"


def llama_worker() -> None:
    """In llama-cpp-python's venv: reads one JSON request per line on stdin (prompt ids, arm), answers with
    the output ids and decode timing. Imports nothing of Brine's."""
    from llama_cpp import Llama
    from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

    setup = json.loads(sys.stdin.readline())
    # logits_all as its server's default (True): with a draft model 0.3.36 needs it, since it sizes the
    # logits buffer from the argument (n_batch rows without it) and then writes every row of a prompt there.
    common = dict(
        model_path=setup["gguf"],
        n_ctx=setup["n_ctx"],
        n_threads=setup["threads"],
        logits_all=True,
        verbose=False,
    )
    models = {
        "off": Llama(**common),
        "on": Llama(
            **common, draft_model=LlamaPromptLookupDecoding(num_pred_tokens=setup["num_pred_tokens"])
        ),
    }
    bias = {int(t): -100.0 for t in setup["eos"]}
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        req = json.loads(line)
        llm = models[req["arm"]]
        llm.reset()
        times: list[float] = []
        text = ""
        for chunk in llm.create_completion(
            req["prompt"], max_tokens=req["max_tokens"], temperature=0.0, logit_bias=bias, stream=True
        ):
            times.append(time.perf_counter())
            text += chunk["choices"][0]["text"]  # type: ignore[index]
        # EOS is banned, so it runs to max_tokens; a chunk may hold more than one token (text held back at
        # a multi-byte character), so the count is max_tokens, timed from the first chunk to the last.
        print(json.dumps({"n": req["max_tokens"], "t": times[-1] - times[0], "text": text}), flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--spec",
        default='{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}',
    )
    p.add_argument("--num-pred-tokens", type=int, default=10, help="llama's draft_model_num_pred_tokens")
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--doc-tokens", type=int, default=2000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=os.cpu_count() or 2)
    p.add_argument("--llamacpp-python", type=Path, default=LLAMACPP_PYTHON)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        llama_worker()
        return
    import asyncio

    asyncio.run(compare(args))


async def compare(args: argparse.Namespace) -> None:
    from benchmarks.spec_decode_bench import extract_prompts, one
    from engine.async_engine import AsyncEngine
    from engine.config import EngineConfig
    from engine.model.loading.files import default_gguf_path
    from engine.sampling_params import SamplingParams
    from engine.spec_config import SpeculativeConfig

    spec = SpeculativeConfig.from_json(args.spec)
    engine = AsyncEngine.from_config(
        EngineConfig(
            max_num_seqs=1, enable_prefix_caching=False, speculative_config=spec, threads=args.threads
        )
    )
    scheduler = engine._core.scheduler  # the bench's own engine: drafting is switched per arm, when idle
    drafter = scheduler.spec
    worker = subprocess.Popen(
        [str(args.llamacpp_python), str(Path(__file__).resolve()), "--worker"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert worker.stdin is not None and worker.stdout is not None
    setup = {
        "gguf": str(default_gguf_path()),
        "n_ctx": args.doc_tokens * 2 + args.max_tokens + 256,
        "threads": args.threads,
        "num_pred_tokens": args.num_pred_tokens,
        "eos": sorted(engine.tokenizer.eos_token_ids),
    }
    worker.stdin.write(json.dumps(setup) + "\n")
    worker.stdin.flush()
    json.loads(worker.stdout.readline())

    async def brine(arm: str, ids: list[int]) -> tuple[float, list[int]]:
        scheduler.spec = drafter if arm == "on" else None
        params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
        toks, times = await one(engine, ids, params)
        return (len(times) - 1) / (times[-1] - times[0]), toks

    def llama(arm: str, ids: list[int]) -> tuple[float, str]:
        worker.stdin.write(json.dumps({"arm": arm, "prompt": ids, "max_tokens": args.max_tokens}) + "\n")
        worker.stdin.flush()
        got = json.loads(worker.stdout.readline())
        return (got["n"] - 1) / got["t"], got["text"]

    arms = ["brine off", "brine on", "llama off", "llama on"]
    rates: dict[str, list[float]] = {a: [] for a in arms}
    print(f"brine spec {args.spec}; llama num_pred_tokens {args.num_pred_tokens}; threads {args.threads}")
    print(f"load average {os.getloadavg()[0]:.2f}")
    try:
        warm = extract_prompts(engine, 1, 999, 300)[0]
        for arm in arms:  # warm both engines, every arm
            await brine(arm.split()[1], warm) if arm.startswith("brine") else llama(arm.split()[1], warm)
        for r in range(args.rounds):
            ids = extract_prompts(engine, 1, args.seed + r, args.doc_tokens)[0]
            order = arms[r % 4 :] + arms[: r % 4]
            outs: dict[str, list[int]] = {}
            texts: dict[str, str] = {}
            for arm in order:
                who, mode = arm.split()
                if who == "brine":
                    rate, outs[mode] = await brine(mode, ids)
                else:
                    rate, texts[mode] = llama(mode, ids)
                rates[arm].append(rate)
            assert outs["on"] == outs["off"], "speculation changed Brine's output"
            if r == 0:
                print(f"brine: {engine.tokenizer.decode(outs['on'])!r}\nllama: {texts['on']!r}")
            if texts["on"] != texts["off"]:  # llama.cpp's verification batches the drafts: not bit-identical
                print(f"round {r}: llama-cpp-python's output changed with its speculation")
            print(f"round {r}: " + ", ".join(f"{a} {rates[a][-1]:.1f}" for a in arms), flush=True)
        med = {a: statistics.median(v) for a, v in rates.items()}
        print(f"\n{'arm':>10} {'decode tok/s':>13} (median of {args.rounds})")
        for a in arms:
            print(f"{a:>10} {med[a]:>13.1f}")
        print(
            f"speculation: brine {med['brine on'] / med['brine off']:.2f}x, "
            f"llama {med['llama on'] / med['llama off']:.2f}x; brine on / llama on "
            f"{med['brine on'] / med['llama on']:.2f}x, brine off / llama off {med['brine off'] / med['llama off']:.2f}x"
        )
        print(f"load average {os.getloadavg()[0]:.2f}")
    finally:
        worker.stdin.close()
        worker.wait(timeout=30)
        engine.shutdown()


if __name__ == "__main__":
    main()
