"""Prefill (and decode) speed of Brine's model runner against plain transformers, side by side in one run.

For each dtype and prompt length the implementations run alternately (ours, theirs, ours, ...) on the same
weights and the same random prompt, and the best of `--repeats` runs is reported (interference from other
processes on a shared machine only ever adds time; `--stat median` reports medians instead).

- Ours: `ModelRunner.execute` of one request holding the whole prompt (paged KV writes, logits for the last
  token, sampling included), batch-invariant (the default) and with `--no-batch-invariant`'s kernels, so the
  line shows what invariance costs.
- Theirs, under `inference_mode`: the plain forward `model(input_ids)` (logits for every position), and the
  stricter `model(input_ids, logits_to_keep=1)` (what `generate` runs for a prompt: like ours, it computes
  logits for the last token only).
- `--decode-steps N`: N greedy single-stream steps after a 128-token prompt (theirs with its DynamicCache).
- `--decode-batch B`: ours only, B streams decoding together against one stream alone.

    .venv/bin/python benchmarks/prefill_bench.py                              # default model, auto dtype
    .venv/bin/python benchmarks/prefill_bench.py --dtype float32,bfloat16 --decode-steps 32
    .venv/bin/python benchmarks/prefill_bench.py --device cuda --lengths 512,2048,8192

The float32 / bfloat16 numbers behind `--dtype auto` on CPU are in engine/model/device.py.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time
from collections.abc import Callable

import torch

from engine.config import EngineConfig
from engine.model.device import resolve_device, resolve_dtype
from engine.model.loading.files import resolve_model
from engine.model_runner import ModelRunner
from engine.outputs import ScheduledRequest, SchedulerOutput
from engine.sampling_params import SamplingParams


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(fn: Callable[[], object], device: torch.device) -> float:
    _sync(device)
    start = time.perf_counter()
    fn()
    _sync(device)
    return time.perf_counter() - start


def _request(tokens: list[int], computed: int, blocks: list[int], out: int = 0) -> SchedulerOutput:
    new = tokens[computed:]
    sr = ScheduledRequest(
        "bench", new, computed, blocks, True, SamplingParams(temperature=0.0), tokens, len(tokens) - out, out
    )
    return SchedulerOutput([sr], len(new))


def bench_dtype(
    path,
    device: torch.device,
    dtype_name: str,
    lengths: list[int],
    repeats: int,
    decode_steps: int,
    stat: Callable[[list[float]], float] = min,
) -> list[str]:
    from transformers import AutoModelForCausalLM

    dtype = resolve_dtype(dtype_name, device)
    max_len = max(lengths)
    block_size = 16
    num_blocks = -(-max(max_len, 128 + decode_steps) // block_size) + 1
    ours, fast = (
        ModelRunner(
            EngineConfig(
                model=str(path),
                device=str(device),
                dtype=dtype_name,
                block_size=block_size,
                num_blocks=num_blocks,
                max_num_batched_tokens=max_len,
                max_num_seqs=256,  # the runner's own default before it took an EngineConfig
                batch_invariant=invariant,
            )
        )
        for invariant in (True, False)
    )
    theirs = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval()
    blocks = list(range(num_blocks - 1, -1, -1))  # non-contiguous order, as in serving
    gen = torch.Generator().manual_seed(0)
    name = str(dtype).removeprefix("torch.")
    lines = []
    for length in lengths:
        prompt = torch.randint(0, ours.vocab_size, (length,), generator=gen).tolist()
        ids = torch.tensor([prompt], device=device)
        runs = {
            "brine": functools.partial(ours.execute, _request(prompt, 0, blocks)),
            "brine_fast": functools.partial(fast.execute, _request(prompt, 0, blocks)),
            "hf": functools.partial(theirs, ids),  # plain forward: logits for every position
            "hf_keep1": functools.partial(theirs, ids, logits_to_keep=1),
        }
        times: dict[str, list[float]] = {k: [] for k in runs}
        with torch.inference_mode():
            for fn in runs.values():  # warm-up (allocations, kernel selection, compilation on CUDA)
                fn()
            for _ in range(repeats):
                for key, fn in runs.items():
                    times[key].append(_timed(fn, device))
        rate = {k: length / stat(v) for k, v in times.items()}
        lines.append(
            f"prefill {length:5d} tok  {name:9s} brine {rate['brine']:8.1f} tok/s | --no-batch-invariant "
            f"{rate['brine_fast']:8.1f} tok/s (invariant/fast {rate['brine'] / rate['brine_fast']:4.2f}) | "
            f"transformers forward "
            f"{rate['hf']:8.1f} tok/s (ratio {rate['brine'] / rate['hf']:4.2f}) | transformers logits_to_keep=1 "
            f"{rate['hf_keep1']:8.1f} tok/s (ratio {rate['brine'] / rate['hf_keep1']:4.2f})"
        )
    if decode_steps:
        lines.append(_bench_decode(ours, theirs, device, name, blocks, decode_steps, repeats, stat))
        lines.append(_bench_decode(fast, theirs, device, name + " fast", blocks, decode_steps, repeats, stat))
    return lines


def _bench_decode(
    ours: ModelRunner,
    theirs,
    device: torch.device,
    name: str,
    blocks: list[int],
    steps: int,
    repeats: int,
    stat: Callable[[list[float]], float],
) -> str:
    prompt = list(range(1000, 1128))

    def run_ours() -> None:
        seq = list(prompt)
        seq.append(ours.execute(_request(seq, 0, blocks)).sampled_token_ids["bench"])
        for i in range(1, steps):
            seq.append(ours.execute(_request(seq, len(seq) - 1, blocks, out=i)).sampled_token_ids["bench"])

    def run_theirs() -> None:
        from transformers import DynamicCache

        cache = DynamicCache()
        out = theirs(
            torch.tensor([prompt], device=device), past_key_values=cache, use_cache=True, logits_to_keep=1
        )
        tok = out.logits[:, -1].argmax(-1, keepdim=True)
        for _ in range(1, steps):
            out = theirs(tok, past_key_values=cache, use_cache=True)
            tok = out.logits[:, -1].argmax(-1, keepdim=True)
            tok.item()  # one sync per token, as a server must

    def prefill_only_ours() -> None:
        ours.execute(_request(prompt, 0, blocks))

    def prefill_only_theirs() -> None:
        theirs(torch.tensor([prompt], device=device), logits_to_keep=1)

    with torch.inference_mode():
        run_ours(), run_theirs()
        t_ours, t_theirs = [], []
        for _ in range(repeats):
            # decode time = whole run minus the prompt's prefill, measured right next to it
            t_ours.append(_timed(run_ours, device) - _timed(prefill_only_ours, device))
            t_theirs.append(_timed(run_theirs, device) - _timed(prefill_only_theirs, device))
    a, b = (steps - 1) / stat(t_ours), (steps - 1) / stat(t_theirs)
    return (
        f"decode  1 stream {name:9s} brine {a:9.1f} tok/s   transformers {b:9.1f} tok/s   ratio {a / b:5.2f}"
    )


def bench_batched_decode(path, device: torch.device, dtype_name: str, batch: int, steps: int) -> str:
    """Ours only: `batch` requests (128-token prompts) decoding together, against one request alone."""
    block_size, prompt_len = 16, 128
    per_req = -(-(prompt_len + steps + 1) // block_size)
    runner = ModelRunner(
        EngineConfig(
            model=str(path),
            device=str(device),
            dtype=dtype_name,
            block_size=block_size,
            num_blocks=batch * per_req + 1,
            max_num_seqs=batch,
        )
    )
    gen = torch.Generator().manual_seed(1)

    def run(n: int) -> float:
        seqs = [torch.randint(0, runner.vocab_size, (prompt_len,), generator=gen).tolist() for _ in range(n)]
        tables = [list(range(i * per_req, (i + 1) * per_req))[::-1] for i in range(n)]
        params = SamplingParams(temperature=0.0)

        def step(first: bool) -> None:
            reqs = []
            for i, seq in enumerate(seqs):
                start = 0 if first else len(seq) - 1
                out = len(seq) - prompt_len
                reqs.append(
                    ScheduledRequest(
                        f"r{i}", seq[start:], start, tables[i], True, params, seq, prompt_len, out
                    )
                )
            result = runner.execute(SchedulerOutput(reqs, sum(len(r.new_token_ids) for r in reqs)))
            for i, seq in enumerate(seqs):
                seq.append(result.sampled_token_ids[f"r{i}"])

        with torch.inference_mode():
            step(True)
            step(False)  # warm-up: first decode shape
            _sync(device)
            start = time.perf_counter()
            for _ in range(steps):
                step(False)
            _sync(device)
        return n * steps / (time.perf_counter() - start)

    one, many = run(1), run(batch)
    return (
        f"decode {batch:3d} streams {dtype_name:9s} brine {many:9.1f} tok/s   1 stream {one:9.1f} tok/s   "
        f"ratio {many / one:5.2f}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default=None, help="HF directory or .gguf (default: the embedded SmolLM2)")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--dtype", default="auto", help="comma-separated, e.g. float32,bfloat16")
    parser.add_argument("--lengths", default="512,2048")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--stat", choices=("min", "median"), default="min", help="how repeats are summarised")
    parser.add_argument("--decode-steps", type=int, default=0, help="also time N single-stream decode steps")
    parser.add_argument("--decode-batch", type=int, default=0, help="also time N streams decoding together")
    parser.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0: torch's default)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    stat = min if args.stat == "min" else statistics.median
    device = resolve_device(args.device)
    path = resolve_model(args.model).path
    lengths = [int(x) for x in args.lengths.split(",")]
    print(
        f"model {path}  device {device}  threads {torch.get_num_threads()}  torch {torch.__version__}  "
        f"repeats {args.repeats} ({args.stat})"
    )
    for dtype_name in args.dtype.split(","):
        for line in bench_dtype(
            path, device, dtype_name.strip(), lengths, args.repeats, args.decode_steps, stat
        ):
            print(line, flush=True)
        if args.decode_batch:
            steps = max(args.decode_steps, 16)
            print(
                bench_batched_decode(path, device, dtype_name.strip(), args.decode_batch, steps), flush=True
            )


if __name__ == "__main__":
    main()
