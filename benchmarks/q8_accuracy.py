"""What `--quantize-activations q8` and `--kv-cache-dtype float16` cost in accuracy: Brine's prompt logprobs
against transformers in float32.

One text (this repository's README and docs/benchmarks.md, the first `--tokens` tokens) is scored by
transformers (float32, on the weights Brine converted from the GGUF: the same values) and by Brine's engine
(prompt_logprobs) in each setting asked for. Per setting, against transformers at every position:

- top-1: how often Brine's most likely next token is transformers' most likely one;
- mean and max |d logprob|: the difference in the logprob of the text's actual next token;
- perplexity of the text.

bfloat16 (Brine's default on AVX512-BF16 CPUs) is the yardstick: its rounding is a cost users already take.
A setting is a dtype, then `+q8` for q8 activations and `+kv16` for a float16 KV cache (under float32).

    .venv/bin/python benchmarks/q8_accuracy.py
    .venv/bin/python benchmarks/q8_accuracy.py --settings float32,float32+q8,bfloat16,bfloat16+q8 --tokens 2048
    .venv/bin/python benchmarks/q8_accuracy.py --settings float32,float32+kv16,float32+q8,float32+q8+kv16,bfloat16
"""

from __future__ import annotations

import argparse
import asyncio
import math
from pathlib import Path

import torch

from engine.async_engine import AsyncEngine
from engine.config import EngineConfig
from engine.model.kernels.build import describe
from engine.model.loading.files import resolve_model
from engine.sampling_params import SamplingParams

ROOT = Path(__file__).resolve().parents[1]


def text_ids(tokenizer, tokens: int) -> list[int]:
    text = (ROOT / "README.md").read_text() + (ROOT / "docs" / "benchmarks.md").read_text()
    ids = tokenizer(text).input_ids[:tokens]
    if len(ids) < tokens:
        raise SystemExit(f"the text has only {len(ids)} tokens")
    return ids


def reference(model_dir: Path, ids: list[int]) -> torch.Tensor:
    """transformers' float32 logprobs of every next token: [len(ids) - 1, vocab]."""
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.inference_mode():
        logits = hf(torch.tensor([ids])).logits[0, :-1].float()
    return torch.log_softmax(logits, dim=-1)


def next_token_logprobs(lp: torch.Tensor, ids: list[int]) -> torch.Tensor:
    """From logprobs of every next token ([len(ids) - 1, vocab]), those of the text's actual next tokens."""
    return lp.gather(1, torch.tensor(ids[1:])[:, None])[:, 0]


def perplexity(chosen: torch.Tensor) -> float:
    """Of the text, from the logprob of each actual next token."""
    return math.exp(-chosen.double().mean().item())


def cells(ref: torch.Tensor, ids: list[int], chosen: torch.Tensor, top: torch.Tensor) -> str:
    """One setting's table cells against the reference logprobs `ref` ([len(ids) - 1, vocab]): top-1 agreement
    (its own most likely next tokens `top` against ref's), mean and max |d logprob| of the text's actual next
    token (its logprobs `chosen`), perplexity."""
    d = (chosen.double() - next_token_logprobs(ref, ids).double()).abs()
    agree = (top == ref.argmax(-1)).double().mean().item()
    return f"{agree * 100:.2f}% | {d.mean().item():.4f} | {d.max().item():.3f} | {perplexity(chosen):.3f}"


def brine(setting: str, ids: list[int]) -> tuple[list[float], list[int]]:
    """Brine's logprob of each actual next token and its own top-1, positions 1 .. len(ids) - 1."""
    dtype, *options = setting.split("+")
    if set(options) - {"q8", "kv16"}:
        raise SystemExit(f"{setting}: a setting is a dtype, then +q8 and/or +kv16")
    eng = AsyncEngine.from_config(
        EngineConfig(
            device="cpu",
            dtype=dtype,
            quantize_activations="q8" if "q8" in options else "none",
            kv_cache_dtype="float16" if "kv16" in options else "auto",
        )
    )

    async def run():
        params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=1)
        async for out in eng.generate(ids, params):
            if out.prompt_logprobs is not None:
                return out.prompt_logprobs
        raise RuntimeError("no prompt logprobs")

    try:
        lps = asyncio.run(run())
    finally:
        eng.shutdown()
    chosen = [lp.logprob for lp in lps[1:] if lp is not None]
    top = [lp.top[0][0] for lp in lps[1:] if lp is not None]
    return chosen, top


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--settings", default="bfloat16,float32+q8,bfloat16+q8,float32")
    ap.add_argument("--tokens", type=int, default=1024)
    args = ap.parse_args()
    import transformers

    model_dir = resolve_model(None).path
    ids = text_ids(transformers.AutoTokenizer.from_pretrained(model_dir), args.tokens)
    ref = reference(model_dir, ids)
    print(f"kernels: {describe()}; {len(ids)} tokens; against transformers float32")
    print(f"transformers float32: perplexity {perplexity(next_token_logprobs(ref, ids)):.3f}")
    print("| setting | top-1 agreement | mean abs d logprob | max abs d logprob | perplexity |")
    print("|---|---|---|---|---|")
    for setting in args.settings.split(","):
        chosen, top = brine(setting, ids)
        print(
            f"| {setting} | {cells(ref, ids, torch.tensor(chosen, dtype=torch.float64), torch.tensor(top))} |"
        )


if __name__ == "__main__":
    main()
