"""The GPU figures of issue 33, from a machine that reaches nothing: models built from a config with random
weights, the default model's tokenizer carried, Brine and transformers side by side in one run, one JSON report.

Models (`--models`, in order): `llama8b` (Llama-3.1-8B's shape: 32 layers, 4,096 hidden, 14,336 intermediate,
32 heads, 8 KV heads, 128,256 vocabulary, untied head) and `default` (the default model's shape, SmolLM2-135M);
`--small` swaps both for a tiny shape, for a smoke run on CPU. Random weights are fine for speed: every token
costs the same work whatever it is, and `ignore_eos` keeps every stream to its length. The rotary table is
built for `--max-model-len` positions (the weights do not depend on it; the longest request here is ~2,100).

Brine runs as the server runs it (EngineCore: scheduler, prefix cache, ModelRunner, CUDA graphs unless
`--enforce-eager`), driven from this thread; transformers (`generate`, SDPA, greedy) runs the same workloads on
the same device as the in-box peer. Figures:

- TTFT of a 5-token prompt, a cold 2,000-token prompt, and the same prompt again (warm: a prefix hit);
- decode tokens/s at 1, 16, 64 and 256 concurrent streams (32-token prompts; tokens after every stream has its
  first, over the time from then to the last);
- prefix repetition: waves of requests sharing a 2,000-token prefix, each with its own 16-token suffix,
  prefix caching on against off (tokens/s of prompt + output).

Single-stream decode is also stated as a fraction of the memory-bandwidth floor: one token reads every weight
once, so the floor is `--hbm-tb-s` (H200: 4.8 TB/s) over the weights' bytes. Published vLLM figures are not
measured here and are not in this report: they go beside it in docs/benchmarks.md, with their source.

    python benchmarks/gpu_bench.py --device cuda --out $OUT/gpu_bench.json       # both models, ~3-4 minutes
    python benchmarks/gpu_bench.py --device cpu --small                          # smoke run, seconds
    python benchmarks/gpu_bench.py --prepare-assets                              # copy the tokenizer to carry

The tokenizer: `--tokenizer DIR`, else build/gpu_assets/tokenizer (written by `--prepare-assets` from the
default model here, and carried to the GPU machine: `build/` is ignored by git), else the default model where
it resolves. The report is rewritten to `--out` after every figure, so a run cut short by a timeout keeps what
it measured; `--budget-s` skips what would start after that many seconds.
"""

from __future__ import annotations

import argparse
import gc
import json
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # run as a script: `engine` from this checkout
    sys.path.insert(0, str(REPO))

from engine.config import EngineConfig  # noqa: E402
from engine.engine_core import EngineCore  # noqa: E402
from engine.sampling_params import SamplingParams  # noqa: E402

ASSETS = REPO / "build" / "gpu_assets" / "tokenizer"
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
)

SHAPES: dict[str, dict[str, Any]] = {
    "llama8b": dict(
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        vocab_size=128256,
        rope_theta=500000.0,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
    ),
    "default": dict(  # SmolLM2-135M (the default model), as benchmarks/gpu_check.sh builds it
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        head_dim=64,
        vocab_size=49152,
        rope_theta=100000.0,
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
    ),
    "tiny": dict(  # --small: a smoke run
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        vocab_size=50000,  # past the tokenizer's 49,152, as llama8b's is: sampled ids it cannot decode
        rope_theta=10000.0,
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
    ),
}


class Sizes:
    """Workload sizes: the issue's on a GPU, small ones for `--small` (same code, seconds on a CPU)."""

    def __init__(self, small: bool) -> None:
        self.short_prompt = 5
        self.long_prompt = 96 if small else 2000
        self.streams = (1, 4) if small else (1, 16, 64, 256)
        self.stream_prompt = 16 if small else 32
        self.decode_tokens = 6 if small else 32
        self.repeats = 2 if small else 3
        self.prefix = 64 if small else 2000
        self.suffix = 16
        self.waves, self.wave_size = (2, 2) if small else (4, 8)
        self.prefix_output = 4 if small else 8


def prepare_assets(dest: Path = ASSETS) -> Path:
    """Copies the default model's tokenizer files to `dest` (to be carried to the GPU machine)."""
    from engine.model.loading.files import resolve_model

    src = resolve_model(None).path
    dest.mkdir(parents=True, exist_ok=True)
    for name in TOKENIZER_FILES:
        if (src / name).exists():
            shutil.copy2(src / name, dest / name)
    return dest


def find_tokenizer(arg: str | None) -> Path:
    if arg:
        return Path(arg)
    if (ASSETS / "tokenizer.json").exists():
        return ASSETS
    from engine.model.loading.files import resolve_model

    try:
        return resolve_model(None).path
    except Exception as exc:
        raise SystemExit(
            f"no tokenizer: pass --tokenizer DIR, or run --prepare-assets where the default model resolves "
            f"and carry {ASSETS.relative_to(REPO)} ({exc})"
        ) from exc


def model_dir(shape: str, tokenizer: Path, root: Path, max_len: int) -> Path:
    """A model directory holding a config (no weights) and the tokenizer's files."""
    from transformers import LlamaConfig

    path = root / shape
    path.mkdir(parents=True, exist_ok=True)
    cfg = LlamaConfig(
        **SHAPES[shape],
        max_position_embeddings=max_len,
        bos_token_id=1,
        eos_token_id=2,
        architectures=["LlamaForCausalLM"],
    )
    cfg.save_pretrained(path)
    for name in TOKENIZER_FILES:
        if (tokenizer / name).exists():
            shutil.copy2(tokenizer / name, path / name)
    return path


def random_load(
    model_path, device, dtype, pack=True, batch_invariant=True, quantized=True, quantize_activations="none"
):
    """engine.model.loading.loader.load_model's construction, with random weights instead of a checkpoint
    (norms at 1, the rest N(0, 0.02), as transformers initialises a Llama). Its weights are dense, so the
    GGUF-only choices (quantized, quantize_activations) have nothing to apply to."""
    from engine.model.config import load_config
    from engine.model.loading.loader import empty_model

    cfg = load_config(Path(model_path))
    model, _ = empty_model(Path(model_path), cfg, device, dtype, pack, batch_invariant, quantized=False)
    gen = torch.Generator(device=device).manual_seed(0)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.fill_(1.0)
            else:
                param.normal_(0.0, 0.02, generator=gen)
    model.finish_loading(device)
    return model


class Report:
    """The JSON report, rewritten to `out` after every figure (a run cut short keeps what it measured)."""

    def __init__(self, out: Path | None, budget_s: float | None, meta: dict[str, Any]) -> None:
        self.out, self.budget_s, self.start = out, budget_s, time.perf_counter()
        self.data: dict[str, Any] = {**meta, "models": {}}

    def time_left(self) -> bool:
        return self.budget_s is None or time.perf_counter() - self.start < self.budget_s

    def put(self, model: str, side: str, key: str, value: Any) -> None:
        self.data["models"].setdefault(model, {}).setdefault(side, {})[key] = value
        self.save()

    def figure(self, model: str, side: str, key: str, fn: Callable[[], Any]) -> None:
        """Measures one figure unless the budget is spent; an error is reported in its place, not raised."""
        if not self.time_left():
            self.put(model, side, key, {"skipped": f"past --budget-s {self.budget_s}"})
            return
        try:
            self.put(model, side, key, fn())
        except Exception as exc:  # one figure failing (out of memory, ...) must not lose the others
            self.put(model, side, key, {"error": f"{type(exc).__name__}: {exc}"[:500]})
            if _device_fault(exc):
                raise

    def save(self) -> None:
        self.data["elapsed_s"] = round(time.perf_counter() - self.start, 2)
        if self.out is not None:
            self.out.parent.mkdir(parents=True, exist_ok=True)
            self.out.write_text(json.dumps(self.data, indent=2))


def _device_fault(exc: BaseException) -> bool:
    return "CUDA error" in str(exc) or "illegal memory access" in str(exc)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class BrineSide:
    """EngineCore over one ModelRunner, driven from this thread; caching on or off per core."""

    def __init__(self, path: Path, device: torch.device, dtype: str, args: argparse.Namespace) -> None:
        import engine.model_runner as model_runner
        from engine.model_runner import ModelRunner
        from engine.tokenizer import Tokenizer

        self.config = EngineConfig(
            model=str(path),
            device=str(device),
            dtype=dtype,
            block_size=16,
            kv_cache_memory=int(args.kv_gib * 2**30),
            max_num_seqs=max(256, args.max_streams),
            max_num_batched_tokens=2048,
            enforce_eager=args.enforce_eager,
        )
        real_load = model_runner.load_model
        model_runner.load_model = random_load  # type: ignore[assignment]
        try:
            t0 = time.perf_counter()
            self.runner = ModelRunner(self.config)
            self.build_s = time.perf_counter() - t0
        finally:
            model_runner.load_model = real_load
        self.tokenizer = Tokenizer(path)
        self.device = device
        self._ids = 0

    def describe(self) -> dict[str, Any]:
        r = self.runner
        graphs = r.graphs
        return {
            "build_s": round(self.build_s, 2),
            "attention": r.attention_backend,
            "cuda_graphs": graphs.captured if graphs is not None else "off",
            "cuda_graphs_capture_s": round(graphs.capture_s, 2) if graphs and graphs.capture_s else None,
            "weights_bytes": weights_bytes(r.model),
            "kv_blocks": r.num_blocks,
        }

    def core(self, caching: bool) -> EngineCore:
        import dataclasses

        return EngineCore(
            self.runner, self.tokenizer, dataclasses.replace(self.config, enable_prefix_caching=caching)
        )

    def drive(
        self, core: EngineCore, prompts: list[list[int]], max_tokens: int
    ) -> tuple[list[list[float]], float]:
        """Adds every prompt now and steps until all finish: per request the arrival time (s from the start)
        of each token, and the total time."""
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        ids = []
        t0 = time.perf_counter()
        for prompt in prompts:
            self._ids += 1
            rid = f"b{self._ids}"
            errors = core.add_request(rid, prompt, params)
            if errors:
                raise RuntimeError(errors[0].error)
            ids.append(rid)
        arrivals: dict[str, list[float]] = {rid: [] for rid in ids}
        done: set[str] = set()
        while len(done) < len(ids):
            if not core.has_work():
                raise RuntimeError(f"engine idle with {len(ids) - len(done)} requests unfinished")
            outs = core.step()
            now = time.perf_counter() - t0
            for o in outs:
                if o.error:
                    raise RuntimeError(o.error)
                for c in o.outputs:
                    arrivals[o.request_id] += [now] * len(c.token_ids)
                if o.finished:
                    done.add(o.request_id)
        return [arrivals[rid] for rid in ids], time.perf_counter() - t0


def weights_bytes(model: torch.nn.Module) -> int:
    """Bytes a decode step reads: every parameter and buffer (a packed copy of a tied head included where
    there is one), less an untied input embedding, of which a step reads one row per token."""
    seen: set[int] = set()
    embed = model.embed_tokens.weight
    if getattr(model.lm_head, "weight", None) is not embed:  # untied: a step reads one row per token of it
        seen.add(embed.data_ptr())
    total = 0
    for t in [*model.parameters(), *model.buffers()]:
        if t.data_ptr() not in seen:
            seen.add(t.data_ptr())
            total += t.numel() * t.element_size()
    return total


def _random_prompts(gen: torch.Generator, n: int, length: int, vocab: int) -> list[list[int]]:
    return [torch.randint(10, vocab, (length,), generator=gen).tolist() for _ in range(n)]


def _median_ms(xs: list[float]) -> float:
    return round(statistics.median(xs) * 1000, 2)


def brine_figures(side: BrineSide, sizes: Sizes, report: Report, name: str, vocab: int, hbm: float) -> None:
    gen = torch.Generator().manual_seed(1)
    on = side.core(caching=True)
    # Warm-up (allocations, kernel choice, FlexAttention compiled for the shapes to come): a short prompt, a
    # long one, and the most streams at once.
    side.drive(on, _random_prompts(gen, 1, 64, vocab), 4)
    side.drive(on, _random_prompts(gen, 1, sizes.long_prompt, vocab), 4)
    side.drive(on, _random_prompts(gen, max(sizes.streams), sizes.stream_prompt, vocab), 3)

    def ttft(length: int, warm: bool) -> dict[str, Any]:
        times = []
        for prompt in _random_prompts(gen, sizes.repeats, length, vocab):
            first = side.drive(on, [prompt], 1)[1]
            times.append(side.drive(on, [prompt], 1)[1] if warm else first)
        return {"ms": _median_ms(times), "runs": [round(t * 1000, 2) for t in times]}

    report.figure(name, "brine", "ttft_5", lambda: ttft(sizes.short_prompt, False))
    report.figure(name, "brine", f"ttft_{sizes.long_prompt}_cold", lambda: ttft(sizes.long_prompt, False))
    report.figure(name, "brine", f"ttft_{sizes.long_prompt}_warm", lambda: ttft(sizes.long_prompt, True))

    def decode(streams: int) -> dict[str, Any]:
        prompts = _random_prompts(gen, streams, sizes.stream_prompt, vocab)
        arrivals, _ = side.drive(on, prompts, sizes.decode_tokens)
        start = max(a[0] for a in arrivals)  # every stream has its first token
        end = max(a[-1] for a in arrivals)
        tokens = sum(sum(1 for t in a if t > start) for a in arrivals)
        out: dict[str, Any] = {"tok_s": round(tokens / (end - start), 1) if end > start else None}
        if streams == 1 and out["tok_s"]:
            floor = hbm * 1e12 / side.describe()["weights_bytes"]
            out["hbm_floor_tok_s"] = round(floor, 1)
            out["fraction_of_floor"] = float(f"{out['tok_s'] / floor:.3g}")
        return out

    for streams in sizes.streams:
        report.figure(name, "brine", f"decode_{streams}_streams", lambda s=streams: decode(s))

    def prefix_repetition(caching: bool) -> dict[str, Any]:
        core = side.core(caching)
        prefix = _random_prompts(torch.Generator().manual_seed(7), 1, sizes.prefix, vocab)[0]
        tokens = 0
        elapsed = 0.0
        for _ in range(sizes.waves):
            wave = [prefix + s for s in _random_prompts(gen, sizes.wave_size, sizes.suffix, vocab)]
            _, t = side.drive(core, wave, sizes.prefix_output)
            tokens += sum(len(p) for p in wave) + len(wave) * sizes.prefix_output
            elapsed += t
        core.reset_prefix_cache(force=True)
        return {"tok_s": round(tokens / elapsed, 1), "s": round(elapsed, 3)}

    report.figure(name, "brine", "prefix_repetition_on", lambda: prefix_repetition(True))
    report.figure(name, "brine", "prefix_repetition_off", lambda: prefix_repetition(False))
    figs = report.data["models"][name]["brine"]
    on_f, off_f = figs.get("prefix_repetition_on", {}), figs.get("prefix_repetition_off", {})
    if "tok_s" in on_f and "tok_s" in off_f:
        report.put(name, "brine", "prefix_repetition_on_over_off", round(on_f["tok_s"] / off_f["tok_s"], 2))


def hf_figures(
    path: Path, device: torch.device, dtype: torch.dtype, sizes: Sizes, report: Report, name: str
) -> None:
    """The same workloads through transformers' generate (SDPA, greedy, its own KV cache; no prefix cache)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.from_pretrained(path)
    t0 = time.perf_counter()
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(cfg, dtype=dtype, attn_implementation="sdpa").eval()
    report.put(name, "transformers", "build_s", round(time.perf_counter() - t0, 2))
    vocab = cfg.vocab_size
    gen = torch.Generator().manual_seed(1)

    def generate(prompts: list[list[int]], new: int) -> float:
        ids = torch.tensor(prompts, device=device)
        _sync(device)
        t = time.perf_counter()
        with torch.inference_mode():
            model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=new,
                min_new_tokens=new,
                do_sample=False,
                pad_token_id=0,
            )
        _sync(device)
        return time.perf_counter() - t

    generate(_random_prompts(gen, 1, 64, vocab), 4)  # warm-up

    def ttft(length: int) -> dict[str, Any]:
        times = [generate(p, 1) for p in [[x] for x in _random_prompts(gen, sizes.repeats, length, 1000)]]
        return {"ms": _median_ms(times)}

    report.figure(name, "transformers", "ttft_5", lambda: ttft(sizes.short_prompt))
    report.figure(name, "transformers", f"ttft_{sizes.long_prompt}_cold", lambda: ttft(sizes.long_prompt))

    def decode(streams: int) -> dict[str, Any]:
        prompts = _random_prompts(gen, streams, sizes.stream_prompt, vocab)
        first = generate(prompts, 1)
        total = generate(prompts, sizes.decode_tokens)
        return {"tok_s": round(streams * (sizes.decode_tokens - 1) / max(total - first, 1e-9), 1)}

    for streams in sizes.streams:
        report.figure(name, "transformers", f"decode_{streams}_streams", lambda s=streams: decode(s))

    def prefix_repetition() -> dict[str, Any]:
        prefix = _random_prompts(torch.Generator().manual_seed(7), 1, sizes.prefix, vocab)[0]
        tokens, elapsed = 0, 0.0
        for _ in range(sizes.waves):
            wave = [prefix + s for s in _random_prompts(gen, sizes.wave_size, sizes.suffix, vocab)]
            elapsed += generate(wave, sizes.prefix_output)
            tokens += sum(len(p) for p in wave) + len(wave) * sizes.prefix_output
        return {"tok_s": round(tokens / elapsed, 1), "s": round(elapsed, 3)}

    report.figure(name, "transformers", "prefix_repetition", prefix_repetition)


def _free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--models", default="llama8b,default", help="comma-separated: llama8b, default")
    parser.add_argument(
        "--small", action="store_true", help="a tiny shape and small workloads (CPU smoke run)"
    )
    parser.add_argument("--dtype", default=None, help="default: bfloat16 on CUDA, auto on CPU")
    parser.add_argument(
        "--tokenizer", default=None, help="directory with the default model's tokenizer files"
    )
    parser.add_argument(
        "--prepare-assets", action="store_true", help=f"copy the tokenizer to {ASSETS} and exit"
    )
    parser.add_argument("--out", type=Path, default=None, help="JSON report, rewritten after every figure")
    parser.add_argument(
        "--budget-s", type=float, default=None, help="start no figure after this many seconds"
    )
    parser.add_argument("--kv-gib", type=float, default=None, help="KV pool (default: 24 GiB CUDA, 0.25 CPU)")
    parser.add_argument("--max-model-len", type=int, default=4096)
    parser.add_argument("--hbm-tb-s", type=float, default=4.8, help="memory bandwidth for the floor (H200)")
    parser.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    parser.add_argument("--no-hf", action="store_true", help="skip the transformers peer")
    args = parser.parse_args(argv)
    if args.prepare_assets:
        print(prepare_assets())
        return {}
    device = torch.device(args.device)
    dtype_name = args.dtype or ("bfloat16" if device.type == "cuda" else "auto")
    if args.kv_gib is None:
        args.kv_gib = 24.0 if device.type == "cuda" else 0.25
    sizes = Sizes(args.small)
    args.max_streams = max(sizes.streams)
    tokenizer = find_tokenizer(args.tokenizer)
    shapes = ["tiny"] if args.small else [m.strip() for m in args.models.split(",") if m.strip()]
    meta: dict[str, Any] = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "dtype": dtype_name,
        "small": args.small,
        "enforce_eager": args.enforce_eager,
        "hbm_tb_s": args.hbm_tb_s,
        "tokenizer": str(tokenizer),
        "note": "random weights; published vLLM figures are not measured here (see docs/benchmarks.md)",
    }
    report = Report(args.out, args.budget_s, meta)
    with tempfile.TemporaryDirectory(prefix="brine-gpu-bench-") as tmp:
        for shape in shapes:
            if not report.time_left():
                report.put(shape, "brine", "skipped", f"past --budget-s {args.budget_s}")
                continue
            path = model_dir(shape, tokenizer, Path(tmp), args.max_model_len)
            try:
                side = BrineSide(path, device, dtype_name, args)
            except Exception as exc:
                report.put(shape, "brine", "error", f"{type(exc).__name__}: {exc}"[:500])
                if _device_fault(exc):
                    break
                continue
            report.put(shape, "brine", "setup", side.describe())
            vocab = min(side.runner.vocab_size, side.tokenizer.vocab_size)
            brine_figures(side, sizes, report, shape, vocab, args.hbm_tb_s)
            torch_dtype = side.runner.dtype
            del side
            _free(device)
            if not args.no_hf and report.time_left():
                hf_figures(path, device, torch_dtype, sizes, report, shape)
                _free(device)
    report.save()
    print(json.dumps(report.data, indent=2))
    return report.data


if __name__ == "__main__":
    main()
