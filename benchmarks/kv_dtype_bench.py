"""What `--kv-cache-dtype float16` buys a float32 model, in process: two engines, one over a float32 KV cache and
one over a float16 one, step for step on the same prompts, taking turns (these machines are noisy: read the
ratios).

Per round and engine, an `EngineCore` over the real `ModelRunner` (default model, `--dtype float32`):

- **warm step**: a `--context`-token prompt sent again once it is cached: the tail reuse leaves one token to
  compute, over the whole cached context (what a warm request's TTFT waits on, less HTTP);
- **decode step**: one token of a stream whose context is `--context` tokens long;
- **cold prefill**: a new `--context`-token prompt, every step until its first token (chunked at the engine's
  2,048-token budget).

Medians over the rounds, ms, float32 KV / float16 KV beside them. The same prompts go to both engines.

    .venv/bin/python benchmarks/kv_dtype_bench.py --quantize-activations q8
    BRINE_CPU_TIER=avx2 ONEDNN_MAX_CPU_ISA=AVX2 ATEN_CPU_CAPABILITY=avx2 MKL_ENABLE_INSTRUCTIONS=AVX2 \\
        .venv/bin/python benchmarks/kv_dtype_bench.py --quantize-activations q8 --rounds 40
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.profile_step import prompt_ids  # noqa: E402
from engine.config import EngineConfig  # noqa: E402
from engine.engine_core import EngineCore  # noqa: E402
from engine.model.kernels.build import describe  # noqa: E402
from engine.model.loading.files import resolve_model  # noqa: E402
from engine.model_runner import ModelRunner  # noqa: E402
from engine.sampling_params import SamplingParams  # noqa: E402
from engine.tokenizer import Tokenizer  # noqa: E402

KV = ("auto", "float16")  # float32 (the model's dtype), then float16


def _until_first_token(core: EngineCore, rid: str, prompt: list[int], max_tokens: int = 1) -> float:
    """Seconds from adding the request to the step that gave its first token."""
    core.add_request(rid, prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
    start = time.perf_counter()
    while True:
        outs = core.step()
        if any(o.request_id == rid and o.outputs and o.outputs[0].token_ids for o in outs):
            return time.perf_counter() - start


def _drain(core: EngineCore) -> None:
    while core.has_work():
        core.step()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--context", type=int, default=2029)
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--quantize-activations", choices=("none", "q8"), default="none")
    args = ap.parse_args()
    files = resolve_model(None)
    cores: dict[str, EngineCore] = {}
    for kv in KV:
        config = EngineConfig(
            model=str(files.path),
            dtype="float32",
            num_blocks=4 * (args.context // 16 + 8),
            max_num_seqs=4,
            quantize_activations=args.quantize_activations,
            kv_cache_dtype=kv,
        )
        cores[kv] = EngineCore(ModelRunner(config), Tokenizer(files.path), config)
    some = cores[KV[0]]
    doc = prompt_ids(some, args.context, 1)
    for core in cores.values():  # cache the warm prompt, and warm up
        _until_first_token(core, "seed", doc)
        _drain(core)
    times: dict[tuple[str, str], list[float]] = {}
    for r in range(args.rounds):
        cold = prompt_ids(some, args.context, 1000 + r)
        for kv, core in cores.items():
            times.setdefault(("warm step", kv), []).append(_until_first_token(core, f"w{r}", doc))
            _drain(core)
            times.setdefault(("cold prefill", kv), []).append(_until_first_token(core, f"c{r}", cold, 2))
            start = time.perf_counter()
            core.step()  # the cold request's second token: a decode at `context`
            times.setdefault(("decode step", kv), []).append(time.perf_counter() - start)
            _drain(core)
    print(
        f"kernels {describe()}; float32, activations {args.quantize_activations}; context {args.context}; "
        f"medians of {args.rounds} rounds, ms"
    )
    print("| measure | float32 KV | float16 KV | float32 / float16 |")
    print("|---|---|---|---|")
    for what in ("warm step", "decode step", "cold prefill"):
        a, b = (statistics.median(times[what, kv]) * 1e3 for kv in KV)
        print(f"| {what} | {a:.2f} | {b:.2f} | {a / b:.2f}x |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
