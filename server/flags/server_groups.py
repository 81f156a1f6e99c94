"""`brine serve`'s flags that the server itself reads (`server.serve`: listening, logging, keys, tenancy,
`server.limits.RequestLimits`), one function per group. None of them reaches `EngineConfig`.
"""

from __future__ import annotations

import argparse

from server.flags import types


def add_http_flags(s: argparse.ArgumentParser) -> None:
    g = s.add_argument_group("HTTP server")
    g.add_argument("--host", default="127.0.0.1", help="address to listen on (default: %(default)s)")
    g.add_argument(
        "--port", type=types.port, default=8000, help="TCP port to listen on (default: %(default)s)"
    )
    g.add_argument(
        "--log-level",
        default="info",
        choices=("critical", "error", "warning", "info", "debug"),
        help="log level for Brine and uvicorn (default: %(default)s)",
    )


def add_auth_flags(s: argparse.ArgumentParser) -> None:
    g = s.add_argument_group("authentication and tenancy")
    g.add_argument(
        "--api-key",
        action="append",
        default=[],
        help="require 'Authorization: Bearer <key>' on every route but GET/HEAD /health (/docs and /openapi.json "
        "included); repeat for several keys. The BRINE_API_KEY environment variable adds one more.",
    )
    g.add_argument(
        "--allow-unauthenticated",
        action="store_true",
        help="serve with no API key (and no --tenants) on an address other than loopback; without it such a "
        "server refuses to start, so an image or a copied command line never serves everyone by accident",
    )
    g.add_argument(
        "--tenants",
        default=None,
        metavar="FILE",
        help="tenants' API keys: one 'TENANT SHA256HEX' line per key (blank and '#' lines ignored; `brine "
        "tenant-key TENANT` makes a key and its line). A tenant's key puts its requests in that tenant's "
        "own cache namespace and reaches only generation, /v1/models, /tokenize, /detokenize and a "
        "/reset_prefix_cache of its own blocks; --api-key keys stay the operator's",
    )
    g.add_argument(
        "--salt-header",
        default=None,
        metavar="NAME",
        help="take the cache namespace of requests not made with a tenant's key from this request header "
        "(a gateway sets it from its own authentication; the body's cache_salt partitions further; a "
        "generation request without it is a 400). Only behind a gateway that strips it from clients' requests",
    )
    g.add_argument(
        "--require-cache-salt",
        action="store_true",
        help="refuse (400) generation requests with no cache namespace: no tenant key, no --salt-header "
        "header and no cache_salt",
    )
    g.add_argument(
        "--public-prefix",
        action="append",
        default=[],
        metavar="FILE",
        help="a prompt prefix published to every tenant (repeatable): a .json list of chat messages (e.g. "
        "the system prompt), else plain text for /v1/completions. The KV blocks lying wholly inside it are "
        "cached once for all tenants; the rest of a prompt stays in its own namespace. Longest match wins",
    )


def add_limit_flags(s: argparse.ArgumentParser) -> None:
    g = s.add_argument_group(
        "per-request limits", "what one request may ask for; more is a 400 naming the parameter"
    )
    g.add_argument(
        "--max-stop-strings",
        type=types.positive,
        default=4,
        metavar="N",
        help="stop strings per request (default: %(default)s, as OpenAI)",
    )
    g.add_argument(
        "--max-stop-string-chars",
        type=types.positive,
        default=1024,
        metavar="N",
        help="characters per stop string (default: %(default)s)",
    )
    g.add_argument(
        "--max-stop-token-ids",
        type=types.positive,
        default=256,
        metavar="N",
        help="stop_token_ids entries per request (default: %(default)s)",
    )
    g.add_argument(
        "--max-logit-bias",
        type=types.positive,
        default=1024,
        metavar="N",
        help="logit_bias entries per request (default: %(default)s)",
    )
    g.add_argument(
        "--max-prompts-per-request",
        type=types.positive,
        default=128,
        metavar="N",
        help="prompts in one /v1/completions request (default: %(default)s)",
    )
    g.add_argument(
        "--max-requests-per-namespace",
        type=types.non_negative,
        default=256,
        metavar="N",
        help="generation requests one namespace (tenant, gateway value or salt; all unsalted requests "
        "together) may have running or queued at once; more is a 429 with Retry-After (default: "
        "%(default)s; 0: no cap)",
    )
    g.add_argument(
        "--max-seqs-per-request",
        type=types.positive,
        default=256,
        metavar="N",
        help="sequences one request may start: prompts x n (default: %(default)s)",
    )
    g.add_argument(
        "--max-detokenize-tokens",
        type=types.positive,
        default=32768,
        metavar="N",
        help="token ids one /detokenize request may send (default: %(default)s)",
    )
