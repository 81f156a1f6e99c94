"""Greedy tokens and top-5 logprobs of a fixed set of prompts on the default model (issue 34): recorded once on
the tree before the engine/model redesign, so that `test_golden_outputs.py` can show the move changed nothing.

`python -m tests.engine.golden_outputs record` rewrites tests/engine/data/golden_outputs.json from this tree;
`python -m tests.engine.golden_outputs compare` prints whether this tree gives bit-identical results (only
meaningful on the CPU that recorded them: the file names it).
"""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

from engine.async_engine import AsyncEngine
from engine.config import EngineConfig
from engine.sampling_params import SamplingParams

PATH = Path(__file__).parent / "data" / "golden_outputs.json"
DTYPES = ("float32", "bfloat16")
PROMPTS = [
    ("You are a terse assistant.", "Name three primary colors."),
    ("You are a terse assistant.", "What is the capital of France?"),  # shares the system prompt's blocks
    ("You write Python.", "Write a function that reverses a string."),
    ("You are a poet.", "A haiku about the sea, please."),
]
PARAMS = SamplingParams(max_tokens=24, temperature=0.0, logprobs=5, ignore_eos=True)


def describe_cpu() -> str:
    """The CPU's model name and the vector ISAs that change numerics: this file's own, so it survives moves."""
    info = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    name = next((ln.split(":", 1)[1].strip() for ln in info.splitlines() if ln.startswith("model name")), "?")
    flags = next((ln.split(":", 1)[1].split() for ln in info.splitlines() if ln.startswith("flags")), [])
    isas = [f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16") if f in flags]
    return f"{name} ({' '.join(isas) or 'no x86 vector flags'})"


def prompt_ids(engine: AsyncEngine) -> list[list[int]]:
    out = []
    for system, user in PROMPTS:
        messages = [{"role": "system", "content": system}, {"role": "user", "content": user}]
        text = engine.tokenizer.apply_chat_template(messages)
        out.append(engine.tokenizer.encode(text, add_special_tokens=False))
    return out


async def one(engine: AsyncEngine, ids: list[int]) -> list[dict]:
    steps: list[dict] = []
    async for out in engine.generate(ids, PARAMS):
        for c in out.outputs:
            for lp in c.logprobs or []:
                steps.append({"token": lp.token_id, "logprob": lp.logprob, "top": [list(t) for t in lp.top]})
    return steps


async def run_all(engine: AsyncEngine) -> list[list[dict]]:
    ids = prompt_ids(engine)
    # All four at once: batched decode, with the second reusing the first's cached system prompt.
    return list(await asyncio.gather(*(one(engine, p) for p in ids)))


def generate(dtype: str) -> list[list[dict]]:
    # Exact activations on every tier: the recording CPU (AVX512-BF16) never quantized them, and Q8 activations
    # (auto's choice on AVX2 and AVX512 without BF16) move a logprob by more than another tier's summation order.
    config = EngineConfig(
        num_blocks=256, enable_prefix_caching=True, device="cpu", dtype=dtype, quantize_activations="none"
    )
    engine = AsyncEngine.from_config(config)
    try:
        return asyncio.run(run_all(engine))
    finally:
        engine.shutdown()


def main(argv: list[str]) -> int:
    mode = argv[1] if len(argv) > 1 else "compare"
    results = {dtype: generate(dtype) for dtype in DTYPES}
    if mode == "record":
        PATH.write_text(json.dumps({"cpu": describe_cpu(), "outputs": results}, indent=0) + "\n")
        print(f"wrote {PATH}")
        return 0
    golden = json.loads(PATH.read_text())
    same = golden["outputs"] == json.loads(json.dumps(results))
    print(f"recorded on: {golden['cpu']}\nthis CPU:    {describe_cpu()}\nbit-identical: {same}")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv))
