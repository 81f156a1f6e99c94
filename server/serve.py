"""What `brine serve` does once its arguments are parsed: resolve the model, build the engine with a
Prometheus and a logging stat logger, say what was loaded, and run uvicorn until interrupted.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
from typing import Any

logger = logging.getLogger("brine.serve")


def _kv_summary(engine: Any) -> str:
    tokens = engine.num_blocks * engine.block_size
    return f"KV cache: {engine.num_blocks} blocks x {engine.block_size} tokens = {tokens} tokens"


def _prefix_caching_summary(requested: bool, enabled: bool) -> str:
    if enabled:
        return "prefix caching: on (default; --no-enable-prefix-caching turns it off)"
    if requested:
        return "prefix caching: off (the model cannot use it: its attention is not causal)"
    return "prefix caching: off (--no-enable-prefix-caching)"


def serve(args: argparse.Namespace, api_keys: list[str]) -> int:
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s", force=True
    )
    import uvicorn

    from engine.async_engine import AsyncEngine
    from engine.model.files import ModelNotFoundError, resolve_model
    from metrics.log_stats import LoggingStatLogger
    from metrics.prometheus import PrometheusStatLogger
    from server.app import create_app
    from server.cli import engine_config

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
        engine = AsyncEngine.from_config(config)
    except (ValueError, OSError) as exc:
        logger.error("could not start the engine: %s", exc)
        return 1
    try:
        logger.info(
            "serving %s: max_model_len %d, %s, %s",
            engine.model_name,
            engine.max_model_len,
            _kv_summary(engine),
            _prefix_caching_summary(args.enable_prefix_caching, engine.enable_prefix_caching),
        )
        logger.info(
            "API key %s; listening on http://%s:%d",
            f"required ({len(api_keys)} key(s))" if api_keys else "not required",
            args.host,
            args.port,
        )
        app = create_app(engine, api_keys=api_keys, metrics=prometheus)
        # Access logs carry method, path and status only: request bodies (and their cache_salt) never
        # reach a log.
        uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level)
    finally:
        engine.shutdown()
    return 0
