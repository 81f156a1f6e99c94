"""The model directory's tokenizer: encode, decode, EOS ids and the chat template.

Wraps `transformers.AutoTokenizer` for the chat template (so Jinja helpers such as `raise_exception` and
`strftime_now` behave exactly as the model's authors tested them) and calls its Rust `tokenizers` backend
directly for encode/decode, which is faster and does no post-hoc space cleanup, so incremental decoding of a
window of ids agrees with decoding everything at once.
"""

from __future__ import annotations

import json
import logging
import os
from array import array
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from engine.errors import ContextLengthError
from engine.piece_cache import PieceCache
from engine.split_encode import special_prefix, split, split_for_reuse, why_not_splittable
from kv_cache.namespace import CacheNamespace, Owner

logger = logging.getLogger(__name__)

# Reused pieces looked up and encoded at a time when a prompt has a token limit: how far past the limit (at
# most 16 x 2 KB of text) a too-long prompt is tokenized before it is refused.
REUSE_GROUP = 16
LONG_DECODE = 1024  # ids; shorter lists (the detokenizer's windows) decode in less than the batch's overhead


class Tokenizer:
    def __init__(self, model_path: str | Path) -> None:
        from transformers import AutoTokenizer  # heavy import: only when a real tokenizer is made

        self.path = Path(model_path)
        self.hf = AutoTokenizer.from_pretrained(str(self.path))
        # The Rust tokenizer behind the fast HF tokenizer.
        self.backend = self.hf.backend_tokenizer
        self.eos_token_ids: frozenset[int] = frozenset(self._find_eos_ids())
        self.vocab_size: int = self.backend.get_vocab_size(with_added_tokens=True)
        # A long text is encoded in pieces where that gives exactly its tokens (split_encode); 0: never.
        config = json.loads(self.backend.to_str())
        why_not = why_not_splittable(config)
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        self.encode_pieces = 0 if why_not else cores
        # What the post-processor puts before a whole text (Llama 3's BOS) and pieces encoded without special
        # tokens leave out.
        self.special_prefix: list[int] = [] if why_not else special_prefix(config)
        # Pieces of earlier prompts, reused where a prompt repeats them (engine.piece_cache); only where pieces
        # are exact, as above.
        self.pieces = PieceCache()
        # Characters one token stands for at most, where that is provable: a byte-level BPE token stands for at
        # most as many characters as its vocabulary string has (one per byte), and NFC composes at most 4 code
        # points into one (Greek: alpha + 3 marks). A text longer than limit x this has more than `limit`
        # tokens: refused without tokenizing it. None: no bound (other tokenizers are tokenized whole).
        self.max_chars_per_token: int | None = None
        if not why_not:
            longest = max(len(t) for t in self.backend.get_vocab(with_added_tokens=True))
            self.max_chars_per_token = longest * (4 if config.get("normalizer") else 1)
        if why_not:
            logger.debug("long prompts are encoded whole: %s", why_not)

    def __len__(self) -> int:
        return self.vocab_size

    def encode(
        self,
        text: str,
        add_special_tokens: bool = True,
        *,
        reuse: bool = False,
        namespace: CacheNamespace | None = None,
        limit: int | None = None,
    ) -> list[int]:
        """`add_special_tokens=False` for text rendered by the chat template, which already has them.

        Through `encode_batch`, which releases the GIL while the Rust tokenizer works (`encode` holds it): the
        server tokenizes in a worker thread, and a megabyte-long prompt must not stall the event loop and the
        engine thread for a second. A long text is cut into pieces that encode to exactly its tokens
        (engine/split_encode.py) and encoded on the backend's threads; the pieces get no special tokens, which
        is all the post-processor would add but the special tokens before the text (`special_prefix`), which
        are put back once (split_encode checks that it adds nothing else).

        `reuse`: the pieces of a prompt (a generation request's, in `namespace`) are looked up among, and kept
        with, the pieces of earlier prompts in the same namespace (engine.piece_cache), so a repeated document
        is tokenized once.

        `limit`: a prompt's most tokens (the context length). A text found to have more is refused with
        `ContextLengthError` before the rest of it is tokenized: at once where `max_chars_per_token` proves it,
        else after the piece (or group of pieces) that passes the limit. Without pieces, tokenized whole."""
        if limit is not None and self.max_chars_per_token and len(text) > limit * self.max_chars_per_token:
            raise _too_long(limit)
        if not self.encode_pieces:
            return self.backend.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids
        prefix = self.special_prefix if add_special_tokens else []
        if reuse:
            pieces = split_for_reuse(text)
            if len(pieces) > 1:
                return self._encode_reusing(pieces, namespace, list(prefix), limit)
        pieces = split(text, self.encode_pieces)
        if len(pieces) == 1:
            return self.backend.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids
        out = list(prefix)
        step = self.encode_pieces if limit is not None else len(pieces)  # one batch on the backend's threads
        for at in range(0, len(pieces), step):
            if limit is not None and len(out) > limit:
                raise _too_long(limit)
            batch = self.backend.encode_batch(pieces[at : at + step], add_special_tokens=False)
            out += [i for enc in batch for i in enc.ids]
        return out

    def _encode_reusing(
        self, pieces: list[str], namespace: CacheNamespace | None, out: list[int], limit: int | None
    ) -> list[int]:
        step = REUSE_GROUP if limit is not None else len(pieces)
        for at in range(0, len(pieces), step):
            if limit is not None and len(out) > limit:
                raise _too_long(limit)
            group = pieces[at : at + step]
            found = self.pieces.lookup(namespace, group)
            missing = [p for p, ids in zip(group, found, strict=True) if ids is None]
            if missing:  # one batch, on the backend's threads
                batch = self.backend.encode_batch(missing, add_special_tokens=False)
                fresh = [array("i", enc.ids) for enc in batch]
                self.pieces.store(namespace, missing, fresh)
                new = iter(fresh)
                found = [ids if ids is not None else next(new) for ids in found]
            for ids in found:
                assert ids is not None
                out.extend(ids)
        return out

    def forget_pieces(self, owner: Owner | None = None) -> None:
        """Forgets the reused pieces of every namespace (None), or of those `owner` owns: a prefix cache reset
        forgets what could time a repeat of its prompts."""
        self.pieces.forget(owner)

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        ids = list(token_ids)
        if len(ids) > LONG_DECODE:
            # `decode` holds the GIL throughout (131,072 ids: 74 ms, and every other thread, the event loop's
            # included, waits); `decode_batch` releases it while the Rust side works.
            return self.backend.decode_batch([ids], skip_special_tokens=skip_special_tokens)[0]
        return self.backend.decode(ids, skip_special_tokens=skip_special_tokens)

    def token_to_str(self, token_id: int) -> str:
        """Text of a single token (for logprobs); may be U+FFFD for a partial UTF-8 byte."""
        return self.backend.decode([token_id], skip_special_tokens=False)

    @property
    def chat_template(self) -> str | None:
        return getattr(self.hf, "chat_template", None)

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        **chat_template_kwargs: Any,
    ) -> str:
        """Renders messages with the model's chat template. Raises ValueError when the model has none or the
        template rejects the messages (the server turns that into a 400)."""
        if not self.chat_template:
            raise ValueError("This model has no chat template; use the completions endpoint instead.")
        if continue_final_message and add_generation_prompt:
            # The two contradict each other; continuing the last message wins, as in vLLM.
            add_generation_prompt = False
        try:
            text = self.hf.apply_chat_template(
                messages,
                tokenize=False,
                add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message,
                **chat_template_kwargs,
            )
        except Exception as exc:  # jinja errors, raise_exception(...) inside the template
            raise ValueError(f"Could not apply the chat template: {exc}") from exc
        return text if isinstance(text, str) else str(text)

    def _find_eos_ids(self) -> set[int]:
        """The engine's one EOS set, as vLLM makes it: the tokenizer's EOS plus the generation config's
        `eos_token_id` (an int or a list): generation_config.json's, or config.json's where there is no
        readable generation_config.json (as transformers' `GenerationConfig.from_model_config`). The scheduler
        stops on these and the sampler masks them under min_tokens (`ScheduledRequest.eos_token_ids`)."""
        ids: set[int] = set()
        if self.hf.eos_token_id is not None:
            ids.add(int(self.hf.eos_token_id))
        eos = self._config_value("generation_config.json", "eos_token_id")
        if eos is _MISSING:
            eos = self._config_value("config.json", "eos_token_id")
        if isinstance(eos, int):
            ids.add(eos)
        elif isinstance(eos, list):
            ids.update(int(i) for i in eos if isinstance(i, int))
        return ids

    def _config_value(self, name: str, key: str) -> Any:
        """`key` of the model directory's JSON file `name`; _MISSING when the file is absent or unreadable."""
        path = self.path / name
        if not path.is_file():
            return _MISSING
        try:
            config = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as exc:
            logger.warning("ignoring unreadable %s: %s", path, exc)
            return _MISSING
        return config.get(key) if isinstance(config, dict) else None


_MISSING = object()  # a config file that is not there (None: there, without the key)


def _too_long(limit: int) -> ContextLengthError:
    return ContextLengthError(limit, f"your prompt has more than {limit} tokens.")
