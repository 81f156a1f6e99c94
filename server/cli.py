"""`brine serve [MODEL] ...`: load a model into an `AsyncEngine` and serve the OpenAI-compatible API.

`main()` is the `brine` console script; `build_parser` lists the flag groups, each a function in
`server.flags`. Argument parsing stays free of heavy imports (torch, transformers) so that `brine --help` is
instant; they are imported when `serve` runs.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Sequence

from server.flags import engine_groups, server_groups

logger = logging.getLogger("brine.serve")

_DESCRIPTION = (
    "Serve a model over an OpenAI-compatible HTTP API (/v1/chat/completions, /v1/completions, /v1/models) "
    "with a paged, prefix-cached KV store. Requests may carry a top-level `cache_salt` (a non-empty string "
    "of at most 1024 characters): cached KV blocks are only reused between requests with the same salt. "
    "The request schemas are published at /openapi.json, browsable at /docs."
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="brine", description=_DESCRIPTION)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    s = sub.add_parser("serve", help="serve a model over HTTP", description=_DESCRIPTION)
    # In `brine serve --help` order: MODEL, then one heading per group.
    engine_groups.add_model_flags(s)
    server_groups.add_http_flags(s)
    engine_groups.add_kv_cache_flags(s)
    engine_groups.add_kv_tier_flags(s)
    engine_groups.add_kv_events_flags(s)
    engine_groups.add_scheduler_flags(s)
    engine_groups.add_speculative_flags(s)
    engine_groups.add_lora_flags(s)
    engine_groups.add_structured_output_flags(s)
    server_groups.add_auth_flags(s)
    server_groups.add_limit_flags(s)
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


def api_keys(args: argparse.Namespace, environ: dict[str, str] | os._Environ[str] = os.environ) -> list[str]:
    keys = [k for k in args.api_key if k]
    if environ.get("BRINE_API_KEY"):
        keys.append(environ["BRINE_API_KEY"])
    return keys


# How long torch's OpenMP threads (libgomp) spin for more work before they sleep: ten times libgomp's default
# of 300,000 spins. With the default, the thread team is asleep after any pause in traffic, and a lone
# request's first step pays for waking it (a slower time to first token than when requests follow each
# other); spinning longer costs one core's time after each burst of work.
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
