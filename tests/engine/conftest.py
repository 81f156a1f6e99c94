"""Fixtures for the model tests: tiny random checkpoints of every supported architecture, saved the way a
real model directory is (config.json + model.safetensors), with the transformers model kept as the reference,
and a small driver (`Paged`) that runs our model over requests with explicit, non-contiguous block tables,
and `HostSyncs`, which records what would make the host wait for a GPU. `cached` and `uncached`: module-scoped
engines on the real default model, with and without prefix caching, for the modules that compare them (each
such module gets its own pair; after each of its tests no block may still be in use).

(CUDA-marked tests are skipped by the suite-wide hook in tests/conftest.py.)
"""

from __future__ import annotations

import os
import random
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from tiny_config import TINY
from torch.overrides import TorchFunctionMode

# name -> (transformers config class name, extra config); covers each family's differences.
ARCHS: dict[str, tuple[str, dict]] = {
    "llama": ("LlamaConfig", dict(tie_word_embeddings=True)),
    "llama3_rope": (
        "LlamaConfig",
        dict(
            rope_parameters=dict(
                rope_type="llama3",
                rope_theta=500000.0,
                factor=8.0,
                low_freq_factor=1.0,
                high_freq_factor=4.0,
                # 64, not 32: with head_dim 16 the second frequency (wavelength ~32.5) must fall inside the
                # smoothing band [64 / 4, 64 / 1], or the smoothing formula is never run.
                original_max_position_embeddings=64,
            )
        ),
    ),
    "mistral": ("MistralConfig", dict(sliding_window=None, num_key_value_heads=1)),
    "mistral_window": ("MistralConfig", dict(sliding_window=6)),
    "qwen2": ("Qwen2Config", dict(tie_word_embeddings=True)),
    "qwen3": ("Qwen3Config", dict(head_dim=32)),
}


@pytest.fixture(params=list(ARCHS))
def arch(request: pytest.FixtureRequest) -> str:
    """Each supported architecture variant in turn."""
    return request.param


@dataclass
class TinyModel:
    path: Path
    hf: torch.nn.Module  # transformers' model with the very same weights, float32, eval mode

    def logits(self, token_ids: list[int]) -> torch.Tensor:
        """[len(token_ids), vocab] reference logits of the whole sequence."""
        with torch.no_grad():
            return self.hf(torch.tensor([token_ids])).logits[0].float()


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], TinyModel]:
    import transformers

    cache: dict[str, TinyModel] = {}

    def make(name: str) -> TinyModel:
        if name not in cache:
            cls_name, extra = ARCHS[name]
            cfg = getattr(transformers, cls_name)(**{**TINY, **extra})
            torch.manual_seed(1234)
            hf = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
            path = tmp_path_factory.mktemp(name)
            hf.save_pretrained(path, safe_serialization=True)
            cache[name] = TinyModel(path, hf)
        return cache[name]

    return make


class Paged:
    """Runs our model step by step over a paged cache; hands out block ids in shuffled order. `backend`:
    the attention (default: the runner's choice on CPU, the SDPA reference elsewhere); `stack`: a native
    layer stack to hand the model in every step's context; `kv_dtype`: the cache's (default: the model's)."""

    def __init__(
        self,
        model,
        num_blocks: int = 96,
        block_size: int = 4,
        seed: int = 0,
        backend=None,
        stack=None,
        kv_dtype: torch.dtype | None = None,
    ) -> None:
        from attention_helpers import build_metadata

        from engine.model.attention.chooser import select_backend
        from engine.model.attention.sdpa import SdpaBackend
        from engine.model.models.context import ForwardContext

        self._build, self._context = build_metadata, ForwardContext
        cfg = model.cfg
        self.model, self.block_size, self.num_blocks = model, block_size, num_blocks
        weight = model.embed_tokens.weight
        self.device = weight.device
        if backend is None and self.device.type == "cpu":
            backend = select_backend(self.device, num_blocks, block_size, head_dim=cfg.head_dim)
        self.backend = backend if backend is not None else SdpaBackend(self.device)
        self.stack = stack
        shape = (num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim)
        kv_dtype = kv_dtype or weight.dtype
        self.k = [torch.zeros(shape, dtype=kv_dtype, device=self.device) for _ in range(cfg.num_layers)]
        self.v = [torch.zeros_like(x) for x in self.k]
        self.free = list(range(num_blocks))
        random.Random(seed).shuffle(self.free)  # deliberately non-contiguous tables

    def alloc(self, n: int) -> list[int]:
        out, self.free = self.free[:n], self.free[n:]
        return out

    def table_for(self, num_tokens: int) -> list[int]:
        return self.alloc(-(-num_tokens // self.block_size))

    def step(
        self, batch: list[tuple[list[int], int, list[int]]], between_layers: Callable[[], None] | None = None
    ) -> list[torch.Tensor]:
        """batch: (new token ids, num already computed, block table) per request -> logits of every new
        token, per request. `between_layers`: the context's hook, called between two layers."""
        logits = self.step_rows(batch, None, between_layers)
        return list(logits.split([len(n) for n, _, _ in batch]))

    def step_rows(
        self,
        batch: list[tuple[list[int], int, list[int]]],
        rows: list[int] | None,
        between_layers: Callable[[], None] | None = None,
    ) -> torch.Tensor:
        """The logits of the step's token rows `rows` (None: every row), as the runner asks for them: the
        rows on the device and on the host (ForwardContext.logits_rows)."""
        ids = [t for new, _, _ in batch for t in new]
        pos = [p for new, start, _ in batch for p in range(start, start + len(new))]
        meta = self._build(
            [s for _, s, _ in batch],
            [len(n) for n, _, _ in batch],
            [t for _, _, t in batch],
            self.block_size,
            self.device,
        )
        dev = torch.tensor([ids, pos], dtype=torch.int64).to(self.device)
        wanted = list(range(len(ids))) if rows is None else rows
        indices = torch.tensor(wanted, dtype=torch.int64, device=self.device)
        ctx = self._context.for_step(
            self.backend, meta, dev[1], self.k, self.v, indices, self.stack, between_layers, wanted
        )
        return self.model(dev[0], ctx)


@pytest.fixture
def paged() -> type[Paged]:
    return Paged


class HostSyncs(TorchFunctionMode):
    """Records, while active, every call that makes the host wait for a CUDA device: reading values back
    (`tolist`, `item`, ...), indexing with a Python list or a bool mask (the list is copied synchronously, the
    mask needs `nonzero`), `torch.tensor(..., device=...)` and `.to(device)` without `non_blocking`.

    Nothing waits on CPU, so this is how CPU tests hold the runner to one sync per step. `events` holds
    (what, where) pairs, `where` being the first frame outside torch.
    """

    READS = frozenset({"tolist", "item", "cpu", "numpy", "nonzero", "__bool__", "__int__", "__float__"})

    def __init__(self) -> None:
        super().__init__()
        self.events: list[tuple[str, str]] = []

    def _record(self, what: str) -> None:
        frame = sys._getframe(2)
        while frame.f_back is not None and f"{os.sep}torch{os.sep}" in frame.f_code.co_filename:
            frame = frame.f_back
        self.events.append((what, f"{Path(frame.f_code.co_filename).name}:{frame.f_lineno}"))

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if name in self.READS:
            self._record(name)
        elif name in ("__getitem__", "__setitem__") and _syncing_index(args[1]):
            self._record(f"{name} with a list or mask")
        elif name == "tensor" and kwargs.get("device") is not None:
            self._record("torch.tensor(device=...)")
        elif name == "to" and not kwargs.get("non_blocking") and _names_device(args[1:], kwargs):
            self._record("blocking .to(device)")
        return func(*args, **kwargs)

    def reads(self) -> list[str]:
        return [what for what, _ in self.events if what in self.READS]


def _syncing_index(index: object) -> bool:
    parts = index if isinstance(index, tuple) else (index,)
    return any(isinstance(p, list) or (isinstance(p, torch.Tensor) and p.dtype == torch.bool) for p in parts)


def _names_device(args: tuple, kwargs: dict) -> bool:
    return "device" in kwargs or any(isinstance(a, torch.device | str) for a in args)


@pytest.fixture
def host_syncs() -> type[HostSyncs]:
    return HostSyncs


@pytest.fixture
def fresh_dynamo() -> None:
    """Forgets what torch.compile compiled before this test. torch 2.13's inductor, compiling a second
    FlexBackend's flex_attention in one process on an AVX512-BF16 EPYC (Zen 4), wrote C++ that does not
    compile (`cur_qSplitSize9` was not declared), or computed wrong values where it reused the first one's; each
    test passed alone, and with a reset before it. A server compiles one FlexBackend per process."""
    torch._dynamo.reset()


DEFAULT_ENGINE_BLOCKS = 512  # 8192 tokens of KV: plenty, and small enough for a shared CPU machine


def default_engine(enable_prefix_caching: bool):
    from engine.async_engine import AsyncEngine
    from engine.config import EngineConfig

    config = EngineConfig(
        num_blocks=DEFAULT_ENGINE_BLOCKS, enable_prefix_caching=enable_prefix_caching, device="cpu"
    )
    return AsyncEngine.from_config(config)


@pytest.fixture(scope="module")
def cached():
    engine = default_engine(True)
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def uncached():
    engine = default_engine(False)
    yield engine
    engine.shutdown()


@pytest.fixture(autouse=True)
def no_leaks(request):
    """After a test using `cached` or `uncached`: every KV block is back."""
    yield
    for name in ("cached", "uncached"):
        if name in request.fixturenames:
            assert request.getfixturevalue(name).num_used_blocks() == 0
