"""A byte-level tokenizer with three special tokens and a ChatML template, standing in for
`engine.tokenizer.Tokenizer` in server tests. Each ASCII character is one token, so tests can count tokens
by counting characters."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

EOS_ID, IM_START_ID, IM_END_ID = 0, 1, 2
_SPECIAL = {"<|endoftext|>": EOS_ID, "<|im_start|>": IM_START_ID, "<|im_end|>": IM_END_ID}
_SPECIAL_TEXT = {v: k for k, v in _SPECIAL.items()}
_OFFSET = 3  # byte b is token b + 3


class FakeTokenizer:
    eos_token_ids = frozenset({EOS_ID})
    vocab_size = 256 + _OFFSET

    def __init__(self) -> None:
        self.template_calls: list[dict[str, Any]] = []

    def encode(self, text: str, add_special_tokens: bool = True, **_reuse: object) -> list[int]:
        ids: list[int] = []
        i = 0
        while i < len(text):
            for name, tid in _SPECIAL.items():
                if text.startswith(name, i):
                    ids.append(tid)
                    i += len(name)
                    break
            else:
                ids.extend(b + _OFFSET for b in text[i].encode("utf-8"))
                i += 1
        return ids

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        out, buf = [], bytearray()
        for t in token_ids:
            if t >= _OFFSET:
                buf.append(t - _OFFSET)
                continue
            out.append(buf.decode("utf-8", errors="replace"))
            buf.clear()
            if not skip_special_tokens:
                out.append(_SPECIAL_TEXT[t])
        out.append(buf.decode("utf-8", errors="replace"))
        return "".join(out)

    def token_to_str(self, token_id: int) -> str:
        return self.decode([token_id], skip_special_tokens=False)

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        **kwargs: Any,
    ) -> str:
        self.template_calls.append(
            {"messages": messages, "add_generation_prompt": add_generation_prompt, **kwargs}
        )
        if kwargs.get("fail"):
            raise ValueError("Could not apply the chat template: roles must alternate")
        parts = [f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages]
        if continue_final_message:
            parts[-1] = parts[-1].removesuffix("<|im_end|>\n")
        if add_generation_prompt:
            parts.append("<|im_start|>assistant\n")
        return "".join(parts)
