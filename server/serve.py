"""What `brine serve` does once its arguments are parsed: resolve the model, build the engine with a
Prometheus and a logging stat logger, say what was loaded, and run uvicorn until interrupted or the engine
dies (`server.supervise`: then the exit status is non-zero, for a supervisor to restart it).

Access logs carry the client address, method, path and status only: the query string is cut off (a client may
put a key there, `?api_key=...`) and request bodies (and their cache_salt) never reach a log.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import ipaddress
import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # heavy imports (torch) happen inside serve() only
    from engine.async_engine import AsyncEngine
    from engine.config import EngineConfig
    from metrics.stats import StatLogger
    from server.limits import RequestLimits
    from server.tenancy import TenancyConfig

logger = logging.getLogger("brine.serve")


class DropQueryString(logging.Filter):
    """Cuts the query string off uvicorn's access-log lines, whose arguments are
    (client, method, path with query, http version, status)."""

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args
        if isinstance(args, tuple) and len(args) == 5 and isinstance(args[2], str) and "?" in args[2]:
            record.args = (args[0], args[1], args[2].split("?", 1)[0], args[3], args[4])
        return True


def log_config() -> dict[str, Any]:
    """uvicorn's own logging config, with `DropQueryString` on its access-log handler."""
    from uvicorn.config import LOGGING_CONFIG

    config = copy.deepcopy(LOGGING_CONFIG)
    config.setdefault("filters", {})["drop_query_string"] = {"()": DropQueryString}
    config["handlers"]["access"]["filters"] = ["drop_query_string"]
    return config


def engine_config(args: argparse.Namespace, stat_loggers: list[StatLogger]) -> EngineConfig:
    """Every `EngineConfig` field from the flag of the same name (`server.flags.engine_map`, which raises for
    a field without its flag): a new engine flag is its field and its `engine_flag` line, nothing here."""
    from engine.config import EngineConfig
    from server.flags.engine_map import engine_values

    return EngineConfig(**engine_values(args), stat_loggers=stat_loggers)


def request_limits(args: argparse.Namespace) -> RequestLimits:
    from server.limits import RequestLimits

    return RequestLimits(
        max_stop_strings=args.max_stop_strings,
        max_stop_string_chars=args.max_stop_string_chars,
        max_stop_token_ids=args.max_stop_token_ids,
        max_logit_bias=args.max_logit_bias,
        max_requests_per_namespace=args.max_requests_per_namespace,
        max_prompts=args.max_prompts_per_request,
        max_seqs_per_request=args.max_seqs_per_request,
        max_detokenize_tokens=args.max_detokenize_tokens,
    )


def _kv_summary(engine: AsyncEngine) -> str:
    tokens = engine.num_blocks * engine.block_size
    return f"KV cache: {engine.num_blocks} blocks x {engine.block_size} tokens = {tokens} tokens"


def _prefix_caching_summary(requested: bool, enabled: bool) -> str:
    if enabled:
        return "prefix caching: on (default; --no-enable-prefix-caching turns it off)"
    if requested:
        return "prefix caching: off (the model cannot use it: its attention is not causal)"
    return "prefix caching: off (--no-enable-prefix-caching)"


def _tenancy(args: argparse.Namespace, api_keys: list[str]) -> TenancyConfig:
    """The TenancyConfig the flags ask for; ValueError (a message naming the file and line) if unusable."""
    from server.lora_access import parse_tenant_loras
    from server.tenancy import TenancyConfig
    from server.tenants import key_hash, load_tenants

    tenants = load_tenants(args.tenants) if args.tenants else None
    if tenants is not None and any(key_hash(k) in tenants for k in api_keys):
        raise ValueError("a key given with --api-key or BRINE_API_KEY is also a tenant's key in --tenants")
    # load_tenants has read and checked the file: its loras= fields are well formed.
    tenant_loras = (
        parse_tenant_loras(Path(args.tenants).read_text(encoding="utf-8")) if args.tenants else None
    )
    return TenancyConfig(tenants, args.salt_header, args.require_cache_salt, tenant_loras)


def is_loopback(host: str) -> bool:
    """True for an address only this machine reaches (127.0.0.0/8, ::1, localhost)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:  # a host name: it may resolve to any interface
        return False


def auth_mode(args: argparse.Namespace, api_keys: list[str], tenancy: TenancyConfig) -> str:
    """How clients are authenticated, as the startup log says it; ValueError when the server would serve
    every route to anyone on an address others reach and the operator did not say so (--allow-unauthenticated).
    """
    if api_keys or tenancy.tenants is not None:
        tenant_keys = len(tenancy.tenants) if tenancy.tenants is not None else 0
        return f"required ({len(api_keys)} operator key(s), {tenant_keys} tenant key(s))"
    if args.allow_unauthenticated:
        return "not required (--allow-unauthenticated: anyone who reaches the port may use every route)"
    if is_loopback(args.host):
        return "not required (listening on loopback only)"
    raise ValueError(
        f"refusing to serve {args.host} without an API key: set BRINE_API_KEY (or --api-key, or --tenants), "
        "or pass --allow-unauthenticated to serve everyone who reaches the port"
    )


def serve(args: argparse.Namespace, api_keys: list[str]) -> int:
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s", force=True
    )
    from engine.async_engine import AsyncEngine
    from engine.errors import ModelNotFoundError
    from engine.model.loading.files import resolve_model
    from metrics.log_stats import LoggingStatLogger
    from metrics.prometheus import PrometheusStatLogger
    from server import supervise
    from server.app import create_app
    from server.public_prefix import read_public_prefix, render_public_prefix

    # Configuration files first: a bad line refuses to start before the (slow) model load.
    try:
        tenancy = _tenancy(args, api_keys)
        auth = auth_mode(args, api_keys, tenancy)
        prefixes = [read_public_prefix(p) for p in args.public_prefix]
    except ValueError as exc:
        logger.error("%s", exc)
        return 1
    try:
        # Resolve once here (the stat loggers need the served name before the engine exists), then hand the
        # engine the resolved directory so it does not resolve (or convert) again.
        files = resolve_model(args.model)
    except ModelNotFoundError as exc:
        logger.error("%s", exc)
        return 1
    name = args.served_model_name or files.name
    prometheus = PrometheusStatLogger(name)
    config = engine_config(args, [prometheus, LoggingStatLogger()])
    config = dataclasses.replace(config, model=str(files.path), served_model_name=name)
    logger.info("loading %s from %s", name, files.source)
    try:
        engine = AsyncEngine.from_config(config, prestart_grammar_workers=True)
    except (ValueError, OSError) as exc:
        logger.error("could not start the engine: %s", exc)
        return 1
    try:
        if prefixes:
            try:
                public = [render_public_prefix(engine.tokenizer, p) for p in prefixes]
            except ValueError as exc:
                logger.error("%s", exc)
                return 1
            engine.set_public_prefixes(public)
            for p, tokens in zip(prefixes, public, strict=True):
                logger.info(
                    "public prefix %s (%s): %d tokens, %d full KV blocks shared by every tenant",
                    p.path,
                    p.kind,
                    len(tokens),
                    len(tokens) // engine.block_size,
                )
        logger.info(
            "serving %s: max_model_len %d, %s, %s",
            engine.model_name,
            engine.max_model_len,
            _kv_summary(engine),
            _prefix_caching_summary(args.enable_prefix_caching, engine.enable_prefix_caching),
        )
        logger.info("API key %s; listening on http://%s:%d", auth, args.host, args.port)
        if tenancy.tenants is not None:
            # Counts only: the log never names a tenant.
            logger.info(
                "tenants: %d tenant(s), %d key(s) from %s%s",
                len(set(tenancy.tenants.values())),
                len(tenancy.tenants),
                args.tenants,
                "" if api_keys else "; no operator key, so /metrics and a global reset are unreachable",
            )
        if tenancy.salt_header:
            logger.info(
                "cache namespace from the %s header (trusted: a gateway must set it)", tenancy.salt_header
            )
        app = create_app(
            engine, api_keys=api_keys, metrics=prometheus, tenancy=tenancy, limits=request_limits(args)
        )
        status = supervise.run(
            app, engine, host=args.host, port=args.port, log_level=args.log_level, log_config=log_config()
        )
    finally:
        engine.shutdown()
    return status
