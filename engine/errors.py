"""Errors the engine raises that callers tell apart by type, not by the words of their message."""

from __future__ import annotations


class ModelNotFoundError(ValueError):
    """The name does not lead to a model we can load locally; the message says what was tried. Raised while
    resolving (`engine.model.files`) and while converting a GGUF (`engine.model.gguf_convert`)."""


class PromptTokenError(ValueError):
    """A prompt holds a token id that the model cannot embed or the tokenizer cannot decode: the client's 400
    naming `prompt`. Checked before the request is queued, so the step that would batch it never sees it."""

    def __init__(self, vocab_size: int) -> None:
        super().__init__(f"prompt contains a token id outside the vocabulary (ids 0..{vocab_size - 1}).")
        self.param = "prompt"


class ContextLengthError(ValueError):
    """Prompt plus output cannot fit the model's context (`max_model_len`): the client's to fix, a 400 with
    OpenAI's code `context_length_exceeded`. A ValueError, so callers that only know "this request can never
    run" keep treating it as one. `param`: the request field to name, where the raiser knows it."""

    def __init__(self, max_model_len: int, detail: str, param: str | None = None) -> None:
        super().__init__(f"This model's maximum context length is {max_model_len} tokens. However, {detail}")
        self.param = param
