"""`LoRAManager`: the loaded adapters (by name), and the row groups of the step being run.

Rules a caller keeps:
- `load` and `unload` may be called from any thread (the server's); the engine thread calls `resolve` when a
  request is added and `step()` around each forward. A request holds its `LoRAAdapter` from `resolve` to its
  end, so an adapter unloaded (or replaced) while requests run leaves them on the weights they started with.
- At most `max_loras` adapters are loaded at once (`--max-loras`): on CPU every loaded adapter is resident, so
  this bounds their memory; a load beyond it is refused until one is unloaded.
- A request names its adapter through its cache namespace (`CacheNamespace.lora`: name and fingerprint), so
  the weights it runs are the ones its cache key names; a fingerprint that no longer matches (the adapter was
  reloaded between the server's check and the engine's add) fails that request, never runs other weights.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import threading
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING

import torch
from torch import nn

from engine.lora.adapter import LoRAAdapter
from engine.lora.delta import TargetDelta
from engine.lora.peft_format import TARGETS, LoRAError, TargetShape, load_peft
from engine.model.kernels.invariance import NotInvariantError
from engine.model.layers.lora import LoRAStep
from engine.model.models.llama import LlamaForCausalLM
from kv_cache.namespace import CacheNamespace

if TYPE_CHECKING:
    from engine.config import EngineConfig

logger = logging.getLogger(__name__)
MAX_NAME_CHARS = 256
# Each fused linear of the model and the PEFT targets whose outputs it holds side by side, in column order.
FUSED: dict[str, tuple[str, ...]] = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "o_proj": ("o_proj",),
    "gate_up_proj": ("gate_proj", "up_proj"),
    "down_proj": ("down_proj",),
}


def fused_columns(out_features: dict[str, int]) -> dict[str, dict[str, tuple[int, int]]]:
    """{fused linear: {target: (first column, end column)}} from each target's output width."""
    out: dict[str, dict[str, tuple[int, int]]] = {}
    for fused, targets in FUSED.items():
        c0, cols = 0, {}
        for t in targets:
            cols[t] = (c0, c0 + out_features[t])
            c0 += out_features[t]
        out[fused] = cols
    return out


def check_name(name: object) -> str:
    if not isinstance(name, str) or not name or len(name) > MAX_NAME_CHARS or not name.isprintable():
        raise LoRAError(f"an adapter name must be 1 to {MAX_NAME_CHARS} printable characters", "lora_name")
    if any(c.isspace() for c in name) or "=" in name:
        raise LoRAError("an adapter name must not contain whitespace or '='", "lora_name")
    return name


class LoRAManager:
    def __init__(
        self,
        model: LlamaForCausalLM,
        device: torch.device,
        *,
        max_loras: int,
        max_lora_rank: int,
        batch_invariant: bool = True,
        reserved_names: Sequence[str] = (),
    ) -> None:
        if max_loras < 1 or max_lora_rank < 1:
            raise ValueError("--max-loras and --max-lora-rank must be at least 1")
        cfg = model.cfg
        q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        h, inter = cfg.hidden_size, cfg.intermediate_size
        self.shapes = {
            "q_proj": TargetShape(h, q),
            "k_proj": TargetShape(h, kv),
            "v_proj": TargetShape(h, kv),
            "o_proj": TargetShape(q, h),
            "gate_proj": TargetShape(h, inter),
            "up_proj": TargetShape(h, inter),
            "down_proj": TargetShape(inter, h),
        }
        assert set(self.shapes) == set(TARGETS)
        self.columns = fused_columns({t: s.out_features for t, s in self.shapes.items()})
        self.num_layers = cfg.num_layers
        self.device = device
        self.max_loras, self.max_lora_rank = max_loras, max_lora_rank
        self.batch_invariant = batch_invariant
        self.reserved = frozenset(reserved_names)  # the base model's name(s)
        self.current = LoRAStep()  # the model's wrappers read it; this manager sets it around each step
        self.num_wrapped = model.enable_lora(self.current)
        self._adapters: dict[str, LoRAAdapter] = {}
        self._lock = threading.Lock()
        self._ids = itertools.count(1)

    @classmethod
    def from_config(cls, config: EngineConfig, model: LlamaForCausalLM, device: torch.device) -> LoRAManager:
        """Has `model` wrap its linears and loads `config.lora_modules`; ValueError (LoRAError) naming the bad module."""
        manager = cls(
            model,
            device,
            max_loras=config.max_loras,
            max_lora_rank=config.max_lora_rank,
            batch_invariant=config.batch_invariant,
            reserved_names=[n for n in (config.served_model_name,) if n],
        )
        for name, path in config.lora_modules:
            try:
                adapter = manager.load(name, path)
            except LoRAError as exc:
                raise LoRAError(f"--lora-modules {name}: {exc}") from None
            logger.info(
                "LoRA adapter %s: rank %d, %d targets, from %s", name, adapter.rank, adapter.num_targets, path
            )
        return manager

    # ---- the registry (any thread) ---------------------------------------------------------------------

    def load(self, name: str, path: str, replace: bool = False) -> LoRAAdapter:
        """Loads the adapter at `path` as `name`; LoRAError (a 400 for the server) if it cannot be.
        `replace`: an adapter already loaded under `name` gives way to this one (running requests keep it)."""
        check_name(name)
        if name in self.reserved:
            raise LoRAError("an adapter cannot take the base model's name", "lora_name")
        with self._lock:
            self._check_room(name, replace)
        peft = load_peft(path, self.shapes, self.num_layers, self.max_lora_rank)
        try:
            deltas = self._fuse(peft.weights)
        # This CPU's kernel for the adapter's shapes: refused, never run unsafely.
        except NotInvariantError as exc:
            raise LoRAError(str(exc), None) from None
        with self._lock:
            self._check_room(name, replace)  # again: another load may have won the race meanwhile
            adapter = LoRAAdapter(
                name, peft.path, peft.fingerprint, peft.rank, next(self._ids), deltas, len(peft.weights)
            )
            self._adapters[name] = adapter
        return adapter

    def _fuse(self, weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]) -> dict:
        """{(layer, fused linear): its delta}: the targets' A stacked, their B block-diagonal."""
        deltas: dict[tuple[int, str], nn.Module] = {}
        for layer in range(self.num_layers):
            for fused, cols in self.columns.items():
                present = [(t, weights[(layer, t)]) for t in cols if (layer, t) in weights]
                if not present:
                    continue
                a = torch.cat([a for _, (a, _) in present])  # [targets * r, in]
                width = max(c1 for c0, c1 in cols.values())
                b = torch.zeros(width, a.shape[0])  # [out, targets * r]
                r0 = 0
                for t, (a_t, b_t) in present:
                    c0, c1 = cols[t]
                    b[c0:c1, r0 : r0 + a_t.shape[0]] = b_t
                    r0 += a_t.shape[0]
                deltas[(layer, fused)] = TargetDelta(a, b, self.device, self.batch_invariant)
        return deltas

    def _check_room(self, name: str, replace: bool) -> None:
        if name in self._adapters:
            if replace:
                return
            raise LoRAError(
                "an adapter of this name is already loaded (unload it first, or load_inplace)", "lora_name"
            )
        if len(self._adapters) >= self.max_loras:
            raise LoRAError(
                f"{self.max_loras} adapters are loaded, the --max-loras limit: unload one first", None
            )

    def unload(self, name: str) -> bool:
        """Forgets `name` (False if it was not loaded). Requests running on it finish on it."""
        with self._lock:
            return self._adapters.pop(name, None) is not None

    def get(self, name: str) -> LoRAAdapter | None:
        with self._lock:
            return self._adapters.get(name)

    def adapters(self) -> list[LoRAAdapter]:
        """The loaded adapters, in load order."""
        with self._lock:
            return sorted(self._adapters.values(), key=lambda a: a.lora_id)

    # ---- the engine thread -----------------------------------------------------------------------------

    def resolve(self, namespace: CacheNamespace | None) -> LoRAAdapter | None:
        """The adapter a request's namespace names (None: the base model); LoRAError if it is gone or changed."""
        if namespace is None or namespace.lora is None:
            return None
        name, fp = namespace.lora
        adapter = self.get(name)
        if adapter is None or adapter.fingerprint != fp:
            raise LoRAError("the request's LoRA adapter was unloaded or replaced before it started", "model")
        return adapter

    @contextlib.contextmanager
    def step(self, reqs: Sequence[object]) -> Iterator[None]:
        """Sets the row groups of a step whose requests (ScheduledRequest: `new_token_ids`, `lora`) are laid
        out in this order, for the duration of its forward; then restores the groups it found, so that an
        express step run inside another step's pause (engine.express) hands that step back its own."""
        rows: dict[int, tuple[LoRAAdapter, list[int]]] = {}
        row0 = 0
        for r in reqs:
            n = len(r.new_token_ids)  # type: ignore[attr-defined]
            adapter: LoRAAdapter | None = getattr(r, "lora", None)
            if adapter is not None:
                rows.setdefault(id(adapter), (adapter, []))[1].extend(range(row0, row0 + n))
            row0 += n
        outer = self.current.groups
        self.current.groups = [
            (adapter, torch.tensor(ids, dtype=torch.int64, device=self.device))
            for adapter, ids in sorted(rows.values(), key=lambda g: g[0].lora_id)
        ]
        try:
            yield
        finally:
            self.current.groups = outer
