"""The argparse types of `brine serve`'s flags: each turns a flag's text into its value or raises
`argparse.ArgumentTypeError`, which argparse prints as a usage error (exit status 2) naming the flag.

Nothing here imports torch: `brine --help` stays instant. The types that need the engine's own parser
(`speculative_config`, `kv_events_endpoint`) import it when a value is given.
"""

from __future__ import annotations

import argparse

from server.memory_size import parse_memory


def memory(text: str) -> int:
    try:
        return parse_memory(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def fraction(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"must be between 0 and 1, got {value}")
    return value


def positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def positive_int(value: str) -> int:
    """As `positive`, with a message for text that is not a number too (the LoRA flags')."""
    try:
        n = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value!r}") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value!r}")
    return n


def positive_float(text: str) -> float:
    value = float(text)
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a positive number, got {text}")
    return value


def non_negative(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
    return value


def port(text: str) -> int:
    value = int(text)
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"must be a TCP port (0-65535), got {value}")
    return value


def speculative_config(value: str) -> object:
    from engine.spec_config import SpeculativeConfig

    try:
        return SpeculativeConfig.from_json(value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def lora_module(value: str) -> tuple[str, str]:
    name, sep, path = value.partition("=")
    if not sep or not name or not path:
        raise argparse.ArgumentTypeError(f"expected NAME=PATH, got {value!r}")
    return name, path


def kv_events_endpoint(value: str) -> str:
    from engine.kv_event_publisher import replay_endpoint_for

    try:
        replay_endpoint_for(value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return value
