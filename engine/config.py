"""`EngineConfig`: every engine setting, built once (from `brine serve`'s flags, by `server.serve.engine_config`,
or by a test or benchmark) and passed whole to the components, each of which reads the fields it needs:

- `ModelRunner`: model, device, dtype, block_size, kv_cache_memory, num_blocks, max_num_batched_tokens,
  max_num_seqs (to size attention buffers), batch_invariant, quantization, quantize_activations, enforce_eager, and the LoRA
  fields (enable_lora, lora_modules, max_loras, max_lora_rank: engine.lora.manager.LoRAManager.from_config);
- `EngineCore`: max_model_len, enable_prefix_caching, prefix_caching_hash_algo, express_lane, stat_loggers, the KV tiers
  (kv_host_memory, kv_disk_dir, kv_disk_size, kv_disk_key_file) and max_retained_fraction;
- `Scheduler`: max_num_seqs, max_num_batched_tokens, max_model_len, speculative_config;
- `AsyncEngine.from_config`: served_model_name, kv_events_endpoint, threads, and the grammar engine's
  grammar_compile_workers, grammar_compile_timeout, grammar_cache_memory, grammar_mask_budget_ms.

A new engine setting touches three files: its field here (and its reader's line above), its flag in its group
in `server.flags` (declared with `engine_flag`, the field's name as `dest`), and its one reader. Nothing between
them re-lists it: `server.serve.engine_config` copies every field by name, and raises for a field with no flag
unless `server.flags.engine_map.SET_OTHERWISE` says what sets it instead (`stat_loggers`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.spec_config import SpeculativeConfig
from metrics.stats import StatLogger

KV_CACHE_DTYPES = ("auto", "float16")  # --kv-cache-dtype


@dataclass(slots=True)
class EngineConfig:
    model: str | None = None  # resolved by engine.model.files.resolve_model
    served_model_name: str | None = None
    device: str = "auto"
    dtype: str = "auto"
    block_size: int = 16
    enable_prefix_caching: bool = True
    prefix_caching_hash_algo: str = "sha256"
    kv_cache_memory: int | None = None  # bytes
    num_blocks: int | None = None  # overrides kv_cache_memory (tests use tiny pools)
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None  # default: the model's
    # Express passes between the layers of a long step for owners running few sequences (engine.express).
    express_lane: bool = True
    batch_invariant: bool = True  # same bits whatever shares a step; off trades that for speed
    quantization: str = "auto"  # auto: a GGUF's Q4_1/Q8_0 run as stored (quant_linear); none: dequantized
    # q8: those linears (the head too) quantize their inputs to int8 per block of 32 (csrc/quant_q8.h); auto:
    # where the CPU's kernel tier is faster with it (loading.loader.Q8_AUTO_TIERS: AVX512 without BF16, AVX2);
    # none (the default): the exact float path, which answers as transformers does (docs/determinism.md)
    quantize_activations: str = "none"
    # auto: the KV cache in `dtype`; float16: under float32 activations on CPU, half the bytes per cached token
    # (engine.model.device.resolve_kv_dtype; invariant like every path: keys and values widen exactly)
    kv_cache_dtype: str = "auto"  # one of KV_CACHE_DTYPES
    enforce_eager: bool = (
        False  # run the layers one Python call at a time, never as one native call (native_stack)
    )
    kv_events_endpoint: str | None = None  # tcp://HOST:PORT: publish KV events there (replay at PORT + 1)
    threads: int | None = None  # torch's intra-op threads (engine.threads); None: torch's default
    # KV tiers behind the pool (engine.kv_tiers; EngineCore reads them): host RAM (bytes), a disk dir bounded
    # by kv_disk_size bytes, and the file holding the disk tier's secret (default: generated into the dir).
    kv_host_memory: int | None = None
    kv_disk_dir: str | None = None
    kv_disk_size: int = 10 * 2**30
    kv_disk_key_file: str | None = None
    # Retention requests (kv_cache.retention) may hold at most this fraction of the KV pool.
    max_retained_fraction: float = 0.5
    # Structured outputs (engine.structured_output, engine.grammar_sandbox): compiles run in this many worker
    # processes at once, each at most this long (seconds); compiled grammars are kept up to this many bytes;
    # a request whose grammar masks (its n sequences together) cost more CPU per token than this is refused,
    # or fails.
    grammar_compile_workers: int = 2
    grammar_compile_timeout: float = 10.0
    grammar_cache_memory: int = 256 * 1024 * 1024
    grammar_mask_budget_ms: float = 10.0
    # A directory of operator-declared public grammars (engine.grammar_public), compiled at start and shared by
    # every namespace; None: every compiled grammar is private to the namespace that sent it.
    public_grammar_dir: str | None = None
    # Prompt-lookup speculative decoding (engine.spec_decode); None: off. Same tokens either way, only faster.
    speculative_config: SpeculativeConfig | None = None
    # LoRA adapters (engine.lora; ModelRunner reads them): off unless enable_lora; lora_modules are loaded at
    # start, (name, PEFT directory) each; at most max_loras loaded at once, each of rank <= max_lora_rank.
    enable_lora: bool = False
    lora_modules: list[tuple[str, str]] = field(default_factory=list)
    max_loras: int = 8
    max_lora_rank: int = 64
    stat_loggers: list[StatLogger] = field(default_factory=list)
