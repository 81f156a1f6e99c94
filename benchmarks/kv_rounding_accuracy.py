"""What a narrower KV cache would cost in accuracy, before one is built: transformers in float32 on the default
model's weights, with every K (after RoPE) and V rounded to a cache type as it is stored, against the same model
unrounded.

A cache type rounds what is stored and nothing else: the queries, the products and the softmax stay float32,
as Brine's kernels do with `--kv-cache-dtype float16` (widen exactly, then float32 arithmetic). So this is the
cost of the type itself, whatever kernel later reads it. The types:

- float16, bfloat16: a cast;
- fp8_e4m3, fp8_e5m2: a cast to torch's float8 types, unscaled (vLLM's `--kv-cache-dtype fp8` with its default
  scale of 1.0); values past e4m3's 448 would become NaN and are counted;
- q8_0, q4_0: llama.cpp's cache types, per 32 values along head_dim, as ggml's reference quantizes them (the
  gguf package's bits: tests/benchmarks/test_kv_rounding_accuracy.py).

Per type, over the first `--tokens` tokens of the README and docs/benchmarks.md (benchmarks/q8_accuracy.py's
text): top-1 agreement with the unrounded model, mean and max |d logprob| of the text's next token, perplexity.

    .venv/bin/python benchmarks/kv_rounding_accuracy.py --tokens 2048
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.q8_accuracy import cells, next_token_logprobs, perplexity, text_ids  # noqa: E402
from engine.model.loading.files import resolve_model  # noqa: E402


def _blocks(x: torch.Tensor) -> torch.Tensor:
    """[..., head_dim] as [..., head_dim / 32, 32]."""
    return x.reshape(*x.shape[:-1], x.shape[-1] // 32, 32)


def _id(d: torch.Tensor) -> torch.Tensor:
    return torch.where(d == 0, 0, 1 / torch.where(d == 0, 1, d))


def q8_0(x: torch.Tensor) -> torch.Tensor:
    """ggml's reference Q8_0: q = round(x / d) half away from zero, by the reciprocal of the float32 d; d stored as
    float16."""
    b = _blocks(x)
    d = b.abs().amax(-1, keepdim=True) / 127
    y = b * _id(d)
    q = torch.sign(y) * torch.floor(y.abs() + 0.5)
    return (q * d.half().float()).reshape(x.shape)


def q4_0(x: torch.Tensor) -> torch.Tensor:
    """ggml's reference Q4_0: d = the block's signed value of largest magnitude / -8, q = trunc(x / d + 8.5)
    clipped to 0..15, minus 8; d stored as float16."""
    b = _blocks(x)
    d = b.gather(-1, b.abs().argmax(-1, keepdim=True)) / -8
    q = torch.trunc(b * _id(d) + 8.5).clamp(0, 15) - 8
    return (q * d.half().float()).reshape(x.shape)


ROUNDINGS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "float16": lambda x: x.half().float(),
    "bfloat16": lambda x: x.bfloat16().float(),
    "fp8_e4m3": lambda x: x.to(torch.float8_e4m3fn).float(),
    "fp8_e5m2": lambda x: x.to(torch.float8_e5m2).float(),
    "q8_0": q8_0,
    "q4_0": q4_0,
}


def logprobs(
    hf, ids: list[int], rounding: Callable[[torch.Tensor], torch.Tensor] | None
) -> tuple[torch.Tensor, int]:
    """Log-probabilities of every next token, [len(ids) - 1, vocab], and how many stored values were NaN."""
    from transformers.cache_utils import DynamicCache

    nans = [0]

    class RoundingCache(DynamicCache):
        def update(self, key_states, value_states, layer_idx, *args, **kwargs):  # type: ignore[no-untyped-def]
            if rounding is not None:
                key_states, value_states = rounding(key_states), rounding(value_states)
                nans[0] += int(key_states.isnan().sum() + value_states.isnan().sum())
            return super().update(key_states, value_states, layer_idx, *args, **kwargs)

    with torch.inference_mode():
        out = hf(torch.tensor([ids]), past_key_values=RoundingCache(config=hf.config), use_cache=True)
    return torch.log_softmax(out.logits[0, :-1].float(), dim=-1), nans[0]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--types", default=",".join(ROUNDINGS))
    ap.add_argument("--tokens", type=int, default=1024)
    args = ap.parse_args()
    import transformers

    model_dir = resolve_model(None).path
    ids = text_ids(transformers.AutoTokenizer.from_pretrained(model_dir), args.tokens)
    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ref, _ = logprobs(hf, ids, None)
    print(f"transformers float32, {len(ids)} tokens; K and V rounded as stored, against unrounded")
    print(f"unrounded: perplexity {perplexity(next_token_logprobs(ref, ids)):.3f}")
    print("| KV type | top-1 agreement | mean abs d logprob | max abs d logprob | perplexity | NaN values |")
    print("|---|---|---|---|---|---|")
    for name in args.types.split(","):
        if name not in ROUNDINGS:
            raise SystemExit(f"unknown type {name!r}: one of {', '.join(ROUNDINGS)}")
        lp, nans = logprobs(hf, ids, ROUNDINGS[name])
        print(f"| {name} | {cells(ref, ids, next_token_logprobs(lp, ids), lp.argmax(-1))} | {nans} |")


if __name__ == "__main__":
    main()
