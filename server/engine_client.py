"""The engine surface the server depends on, as a Protocol.

The real `engine.async_engine.AsyncEngine` satisfies it, and so does the fake in `tests/server/fake_engine.py`,
which lets the HTTP layer be tested in milliseconds without loading a model. Keep this list minimal: every
member here is one more thing both implementations must agree on.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any, Protocol

from engine.outputs import RequestOutput
from engine.sampling_params import SamplingParams
from kv_cache.namespace import CacheNamespace, Owner


class TokenizerLike(Protocol):
    eos_token_ids: Any  # list[int] / set[int]; only passed through

    def encode(self, text: str) -> list[int]: ...

    def decode(self, token_ids: list[int]) -> str: ...

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        **kwargs: Any,
    ) -> str: ...


class EngineClient(Protocol):
    tokenizer: TokenizerLike
    model_name: str
    max_model_len: int
    enable_prefix_caching: bool
    block_size: int
    num_blocks: int  # KV capacity

    def generate(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams,
        *,
        request_id: str | None = None,
        namespace: CacheNamespace | None = None,
        owner: str | None = None,
    ) -> AsyncIterator[RequestOutput]: ...

    async def abort(self, request_id: str) -> None: ...

    def is_healthy(self) -> bool: ...

    def reset_prefix_cache(self) -> bool: ...

    def forget_prefix_cache(self, owner: Owner) -> int: ...

    def num_used_blocks(self) -> int: ...

    def kv_event_sources(self) -> dict[str, dict[str, Any]]: ...

    def shutdown(self) -> None: ...


def vocab_size(tokenizer: TokenizerLike) -> int | None:
    """The tokenizer's vocabulary size, if it tells: token ids at or above it are rejected with a 400
    instead of reaching the model's embedding lookup (an index error there would kill the engine).

    The largest of the candidates wins because HF's `vocab_size` leaves out added (special) tokens that
    `len()` counts, and rejecting a real special token id would be a false 400.
    """
    candidates = [getattr(tokenizer, name, None) for name in ("vocab_size", "n_vocab")]
    try:
        candidates.append(len(tokenizer))  # type: ignore[arg-type]
    except TypeError:
        pass
    sizes = [c for c in candidates if isinstance(c, int) and c > 0]
    return max(sizes) if sizes else None
