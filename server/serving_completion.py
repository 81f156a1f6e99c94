"""`POST /v1/completions`: one engine request per prompt (string, strings, token ids, lists of token ids),
`n` choices each; choice index = prompt_index * n + sequence index, as OpenAI numbers them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from fastapi import Request
from starlette.responses import Response

from engine.outputs import CompletionOutput, FinishReason, RequestOutput
from server.engine_client import EngineClient
from server.params import check_completion_features, sampling_params
from server.prompts import completion_prompts, off_loop
from server.protocol import CompletionRequest
from server.responses import CompletionLogprobs
from server.serving import Generation, Prepared, check_generation, final_reason
from server.structured import structured_spec


@dataclass(slots=True)
class _Choice:
    logprobs: CompletionLogprobs | None
    text: list[str] = field(default_factory=list)
    # Only filled when logprobs were asked for: tokens, token_logprobs, top_logprobs, text_offset.
    lp: dict[str, list[Any]] = field(
        default_factory=lambda: {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    )
    finish: FinishReason | None = None
    started: bool = False


async def prepare_completion(engine: EngineClient, req: CompletionRequest, request: Request) -> Prepared:
    """Every check of a completion request, in order, then its prompts and params: shared by the generating
    route and its `/render` twin, so a request one refuses the other refuses alike."""
    namespace = check_generation(engine, req, request, check_completion_features)
    constraint = structured_spec(req)
    vocab = engine.vocab_size  # the model's too: a token-id prompt past its embedding is a 400 here
    prompts = await off_loop(
        completion_prompts, engine.tokenizer, req.prompt, vocab, namespace, engine.max_model_len
    )
    # The longest prompt decides the context check; each prompt gets the same max_tokens.
    params = sampling_params(
        req,
        num_prompt_tokens=max(len(p) for p in prompts),
        max_model_len=engine.max_model_len,
        vocab_size=vocab,
        structured=constraint[1] if constraint else None,
    )
    return Prepared(namespace, prompts, params, constraint[0] if constraint else None)


async def create_completion(engine: EngineClient, req: CompletionRequest, request: Request) -> Response:
    """`req` comes validated from the route's typed body; `request` is watched for a disconnect."""
    generation = CompletionGeneration(engine, await prepare_completion(engine, req, request), req)
    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    return await generation.respond(request, bool(req.stream), include_usage)


class CompletionGeneration(Generation):
    """One completion request's choices, `n` per prompt; echo and logprobs included."""

    chunk_object = "text_completion"
    id_prefix = "cmpl"

    def __init__(self, engine: EngineClient, prepared: Prepared, req: CompletionRequest) -> None:
        super().__init__(engine, prepared)
        prompts = prepared.prompts
        self.echo = bool(req.echo)
        want = req.logprobs is not None
        self.choices = [
            _Choice(CompletionLogprobs(self.texts) if want else None) for _ in range(len(prompts) * self.n)
        ]
        # Echo the prompt as the client sent it when it was text; decode it when it was token ids.
        raw = [req.prompt] if isinstance(req.prompt, str) else req.prompt
        self.echo_texts = (
            [
                p if isinstance(p, str) else engine.tokenizer.decode(ids)
                for p, ids in zip(raw or [], prompts, strict=False)
            ]
            if self.echo
            else []
        )

    def add(self, prompt: int, out: RequestOutput, c: CompletionOutput) -> None:
        self._absorb(prompt, out, c)

    def body(self) -> dict[str, Any]:
        choices = [
            {
                "index": i,
                "text": "".join(choice.text),
                "logprobs": choice.lp if choice.logprobs is not None else None,
                "finish_reason": final_reason(choice.finish),
            }
            for i, choice in enumerate(self.choices)
        ]
        return self.chunk(choices, usage=self.usage())

    def deltas(self, prompt: int, out: RequestOutput, c: CompletionOutput) -> list[dict[str, Any]]:
        index, text, lp = self._absorb(prompt, out, c)
        chunks = []
        if text or lp:
            # finish_reason is null until the last chunk, as OpenAI streams it (the spec's shared
            # schema says otherwise; see tests/e2e for the SDK consequence).
            chunks.append(self.chunk([{"index": index, "text": text, "logprobs": lp, "finish_reason": None}]))
        if c.finish_reason is not None:
            reason = final_reason(c.finish_reason)
            chunks.append(
                self.chunk([{"index": index, "text": "", "logprobs": None, "finish_reason": reason}])
            )
        return chunks

    def _absorb(
        self, p: int, out: RequestOutput, c: CompletionOutput
    ) -> tuple[int, str, dict[str, Any] | None]:
        """Fold one sequence delta into its choice; returns (choice index, new text, new logprobs)."""
        index = p * self.n + c.index
        choice = self.choices[index]
        text, lp = c.text, None
        if choice.logprobs is not None:
            parts = []
            if not choice.started and self.echo and out.prompt_logprobs is not None:
                parts.append(choice.logprobs.build(list(out.prompt_logprobs), self.prepared.prompts[p]))
                # Generated tokens' offsets continue from the end of the echoed text itself.
                choice.logprobs.offset = len(self.echo_texts[p])
            if c.token_ids:
                parts.append(choice.logprobs.build(list(c.logprobs or []), list(c.token_ids)))
            if parts:
                lp = {key: [v for part in parts for v in part[key]] for key in parts[0]}
        if not choice.started and self.echo:
            text = self.echo_texts[p] + text
        choice.started = True
        choice.text.append(text)
        if lp is not None:
            for key, values in lp.items():
                choice.lp[key].extend(values)
        choice.finish = c.finish_reason or choice.finish
        return index, text, lp
