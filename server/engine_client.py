"""The engine surface the server depends on, as a Protocol.

The real `engine.async_engine.AsyncEngine` satisfies it, and so does the fake in `tests/server/fake_engine.py`,
which lets the HTTP layer be tested in milliseconds without loading a model. Keep this list minimal: every
member here is one more thing both implementations must agree on.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Sequence
from typing import Any, Protocol

from engine.outputs import RequestOutput
from engine.request import Origin
from engine.sampling_params import SamplingParams
from kv_cache.namespace import CacheNamespace, Owner


class TokenizerLike(Protocol):
    """What the server reads from `engine.tokenizer.Tokenizer` (and the fake in tests/server)."""

    eos_token_ids: frozenset[int]
    # Added (special) tokens included: token ids at or above it are rejected with a 400 instead of reaching
    # the model's embedding lookup (an index error there would kill the engine).
    vocab_size: int

    def encode(
        self,
        text: str,
        add_special_tokens: bool = True,
        *,
        reuse: bool = False,
        namespace: CacheNamespace | None = None,
        limit: int | None = None,
    ) -> list[int]: ...

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str: ...

    def token_to_str(self, token_id: int) -> str: ...

    def __hash__(self) -> int: ...  # by identity: server.tool_parsers caches one answer per tokenizer

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        **kwargs: Any,
    ) -> str: ...


class EngineClient(Protocol):
    @property
    def tokenizer(self) -> TokenizerLike: ...  # read-only here, so a narrower tokenizer type satisfies it

    model_name: str
    max_model_len: int
    # The token ids a prompt may hold: the smaller of the model's and the tokenizer's vocabularies (the
    # tokenizer's alone would let an id past the model's embedding through); None: no bound is known.
    vocab_size: int | None
    enable_prefix_caching: bool
    block_size: int
    num_blocks: int  # KV capacity

    def generate(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams,
        *,
        request_id: str | None = None,
        origin: Origin | None = None,
    ) -> AsyncGenerator[RequestOutput, None]: ...

    async def abort(self, request_id: str) -> None: ...

    def is_healthy(self) -> bool: ...

    def reset_prefix_cache(self, force: bool = False) -> bool: ...

    def forget_prefix_cache(self, owner: Owner) -> int: ...

    def kv_event_sources(self) -> dict[str, dict[str, Any]]: ...

    def shutdown(self) -> None: ...
