"""`brine serve`'s flags, one function per group (`server.cli.build_parser` calls them in help order).

- `types`: the argparse types that check a flag's value (sizes, fractions, ports, NAME=PATH, JSON);
- `engine_map`: `engine_flag`, for a flag whose value is an `EngineConfig` field, and the strict copy of parsed
  flags into that config (`engine_values`);
- `engine_groups`: the flags that reach the engine (model, KV cache, tiers, events, scheduler, speculative
  decoding, LoRA, structured outputs);
- `server_groups`: the flags the server itself reads (HTTP, authentication and tenancy, per-request limits).

A new engine setting is its `EngineConfig` field, its `engine_flag` line in its group here, and its reader.
"""
