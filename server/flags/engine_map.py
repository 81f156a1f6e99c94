"""The one map from `brine serve`'s flags to `EngineConfig`: a flag that reaches the engine is declared with
`engine_flag`, whose `dest` must be the name of the field it sets, and `engine_values` copies every field
from the parsed flags by that name.

Both ends are strict, so a flag cannot silently miss the engine:
- `engine_flag` raises at parser build when its `dest` is not an `EngineConfig` field (a typo, or a field
  not added yet);
- `engine_values` raises when a field has no parsed flag and is not in `SET_OTHERWISE` (a field added
  without its flag, or a flag added with a plain `add_argument` and a misspelt `dest`).
"""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any

from engine.config import EngineConfig

# The fields no flag sets, each with who sets it instead.
SET_OTHERWISE: dict[str, str] = {
    "stat_loggers": "objects, not text: server.serve builds the Prometheus and logging stat loggers",
}

ENGINE_FIELDS = frozenset(f.name for f in dataclasses.fields(EngineConfig))
FLAG_FIELDS = ENGINE_FIELDS - SET_OTHERWISE.keys()


class UnknownEngineField(ValueError):
    """A flag or a parsed namespace does not match `EngineConfig`'s fields: a programming error."""


def engine_flag(group: argparse._ActionsContainer, *names: str, **kwargs: Any) -> argparse.Action:
    """`group.add_argument(*names, **kwargs)` for a flag whose value is the `EngineConfig` field named by its
    `dest` (argparse's own: `--block-size` gives `block_size`; pass `dest=` when the flag's name differs)."""
    action = group.add_argument(*names, **kwargs)
    if action.dest not in FLAG_FIELDS:
        why = "is set otherwise" if action.dest in SET_OTHERWISE else "is not an EngineConfig field"
        raise UnknownEngineField(f"{'/'.join(names)}: dest {action.dest!r} {why} (engine.config)")
    return action


def engine_values(args: argparse.Namespace) -> dict[str, Any]:
    """Every flag-set `EngineConfig` field's value from `args`, by name."""
    parsed = vars(args)
    missing = sorted(FLAG_FIELDS - parsed.keys())
    if missing:
        raise UnknownEngineField(
            f"EngineConfig field(s) {', '.join(missing)} have no parsed flag: declare each with engine_flag "
            "(dest = the field's name) in its group in server.flags, or list it in SET_OTHERWISE"
        )
    return {name: parsed[name] for name in FLAG_FIELDS}
