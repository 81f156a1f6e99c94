"""`POST /v1/chat/completions`: messages -> chat template -> engine -> a `chat.completion` object, or a stream
of `chat.completion.chunk` events (role chunk, content deltas, a finish chunk per choice, optional usage
chunk, `[DONE]`).

A forced tool call (`server.structured.ToolCallPlan`) is reported as `message.tool_calls` with finish reason
"tool_calls"; streamed, a named function's arguments go out as OpenAI's tool-call deltas as they are made
(id and name first), and a "required" call, whose function is known only once its name is complete, goes out
whole when the sequence ends. With `tool_choice: "auto"` on a model whose template has its own tool-call
format, the output is split into content and calls by `server.tool_parsers`, streamed as it is made.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from fastapi import Request
from starlette.responses import Response

from engine.outputs import CompletionOutput, FinishReason, RequestOutput, TokenLogprob
from server.engine_client import EngineClient
from server.errors import bad_request
from server.params import check_chat_features, sampling_params
from server.prompts import off_loop, render_chat
from server.protocol import ChatCompletionRequest
from server.responses import chat_logprobs
from server.retention import chat_retention
from server.serving import Generation, Prepared, check_generation, final_reason
from server.structured import ToolCallPlan, new_tool_call_id, structured_spec, tool_call_plan
from server.tool_parsers import HermesToolParser, parse_tool_calls, supports_hermes_tools


@dataclass(slots=True)
class _Choice:
    text: list[str] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish: FinishReason | None = None


@dataclass(slots=True)
class PreparedChat(Prepared):
    tools: ToolCallPlan | None = None  # a forced tool call
    auto_tools: bool = False  # tool_choice "auto" on a template with its own tool-call format


async def prepare_chat(engine: EngineClient, req: ChatCompletionRequest, request: Request) -> PreparedChat:
    """Every check of a chat request, in order, then its prompt and params: shared by the generating route
    and its `/render` twin, so a request one refuses the other refuses alike."""
    namespace = check_generation(engine, req, request, check_chat_features)
    auto_tools = (
        bool(req.tools) and req.tool_choice in (None, "auto") and supports_hermes_tools(engine.tokenizer)
    )
    tools = tool_call_plan(req, auto_tools)
    constraint = structured_spec(req)
    if tools is not None and constraint is not None:
        raise bad_request(
            f"{constraint[0]} cannot be combined with a forced tool call (tool_choice).", constraint[0]
        )
    if tools is not None:
        constraint = ("tools", tools.spec)
    prompt = await off_loop(
        render_chat,
        engine.tokenizer,
        req.messages,
        add_generation_prompt=bool(req.add_generation_prompt),
        continue_final_message=bool(req.continue_final_message),
        chat_template_kwargs=req.chat_template_kwargs,
        tools=req.tools if req.tool_choice != "none" else None,
        reuse=True,
        namespace=namespace,
        limit=engine.max_model_len,
    )
    params = sampling_params(
        req,
        num_prompt_tokens=len(prompt),
        max_model_len=engine.max_model_len,
        vocab_size=engine.tokenizer.vocab_size,
        structured=constraint[1] if constraint else None,
    )
    params.retention_s, params.retention_tokens = await chat_retention(engine, req, prompt, namespace)
    return PreparedChat(namespace, [prompt], params, constraint[0] if constraint else None, tools, auto_tools)


async def create_chat_completion(
    engine: EngineClient, req: ChatCompletionRequest, request: Request
) -> Response:
    """`req` comes validated from the route's typed body; `request` is watched for a disconnect."""
    generation = ChatGeneration(engine, await prepare_chat(engine, req, request))
    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    return await generation.respond(request, bool(req.stream), include_usage)


class ChatGeneration(Generation):
    """One chat request's choices: collected into `message`s, or streamed as content (or tool-call) deltas."""

    chunk_object = "chat.completion.chunk"
    id_prefix = "chatcmpl"

    def __init__(self, engine: EngineClient, prepared: PreparedChat) -> None:
        super().__init__(engine, prepared)
        self.tools = prepared.tools
        self.auto_tools = prepared.auto_tools
        # tool_choice "auto", streaming: one parser per choice splits its text into content and calls.
        self.parsers = [HermesToolParser() for _ in range(self.n)] if self.auto_tools else None
        self.want_logprobs = prepared.params.logprobs is not None
        self.choices = [_Choice() for _ in range(self.n)]
        self.call_ids: list[str | None] = [None] * self.n  # streaming a named call: its id, once sent

    def add(self, prompt: int, out: RequestOutput, c: CompletionOutput) -> None:
        choice = self.choices[c.index]
        choice.text.append(c.text)
        choice.logprobs.extend(c.logprobs or ())
        choice.finish = c.finish_reason or choice.finish

    def body(self) -> dict[str, Any]:
        body = []
        for i, choice in enumerate(self.choices):
            logprobs = None
            if self.want_logprobs:
                logprobs = {"content": chat_logprobs(choice.logprobs, self.texts), "refusal": None}
            reason = final_reason(choice.finish)
            message: dict[str, Any] = {"role": "assistant", "content": "".join(choice.text), "refusal": None}
            call = _tool_call(self.tools, "".join(choice.text), reason)
            if call is not None:
                message["content"], message["tool_calls"] = None, [call]
                reason = "tool_calls" if reason == "stop" else reason
            elif self.auto_tools:
                message["content"], calls = parse_tool_calls(message["content"])
                if calls:
                    message["tool_calls"] = calls
                    reason = "tool_calls" if reason == "stop" else reason
            body.append({"index": i, "message": message, "logprobs": logprobs, "finish_reason": reason})
        return {**self.chunk(body, usage=self.usage()), "object": "chat.completion"}

    def opening(self) -> list[dict[str, Any]]:
        # The role comes first, in a chunk of its own per choice, as OpenAI sends it.
        delta = {"role": "assistant", "content": ""}
        return [
            self.chunk([{"index": i, "delta": delta, "logprobs": None, "finish_reason": None}])
            for i in range(self.n)
        ]

    def deltas(self, prompt: int, out: RequestOutput, c: CompletionOutput) -> list[dict[str, Any]]:
        if self.tools is not None:
            self.choices[c.index].text.append(c.text)
            return [
                self.chunk([{"index": c.index, "delta": delta, "logprobs": None, "finish_reason": reason}])
                for delta, reason in self._tool_deltas(c, "".join(self.choices[c.index].text))
            ]
        if self.parsers is not None:
            return self._parsed_chunks(self.parsers[c.index], c)
        chunks = []
        if c.text or (self.want_logprobs and c.logprobs):
            logprobs = None
            if self.want_logprobs:
                logprobs = {"content": chat_logprobs(c.logprobs or [], self.texts), "refusal": None}
            delta = {"content": c.text}
            chunks.append(
                self.chunk([{"index": c.index, "delta": delta, "logprobs": logprobs, "finish_reason": None}])
            )
        if c.finish_reason is not None:
            reason = final_reason(c.finish_reason)
            chunks.append(
                self.chunk([{"index": c.index, "delta": {}, "logprobs": None, "finish_reason": reason}])
            )
        return chunks

    def _parsed_chunks(self, parser: HermesToolParser, c: CompletionOutput) -> list[dict[str, Any]]:
        """The chunks for one output of a tool_choice "auto" sequence: the parser's content and tool-call
        deltas (the first carries the output's logprobs), then the finish."""
        deltas, reason = parser.step(c.text, final_reason(c.finish_reason) if c.finish_reason else None)
        logprobs = None
        if self.want_logprobs and c.logprobs:
            logprobs = {"content": chat_logprobs(c.logprobs, self.texts), "refusal": None}
            deltas = deltas or [{"content": ""}]  # text held back by the parser still has its logprobs sent
        chunks = [
            self.chunk(
                [
                    {
                        "index": c.index,
                        "delta": d,
                        "logprobs": logprobs if i == 0 else None,
                        "finish_reason": None,
                    }
                ]
            )
            for i, d in enumerate(deltas)
        ]
        if reason is not None:
            chunks.append(
                self.chunk([{"index": c.index, "delta": {}, "logprobs": None, "finish_reason": reason}])
            )
        return chunks

    def _tool_deltas(self, c: CompletionOutput, text: str) -> list[tuple[dict[str, Any], str | None]]:
        """(delta, finish_reason) chunks for one output of a forced-call sequence; `text` is all of it so far."""
        assert self.tools is not None
        out: list[tuple[dict[str, Any], str | None]] = []
        named = self.tools.name
        call_ids = self.call_ids
        if named is not None and c.text:
            if call_ids[c.index] is None:
                call_ids[c.index] = new_tool_call_id()
                head = {"index": 0, "id": call_ids[c.index], "type": "function"}
                out.append(
                    ({"tool_calls": [{**head, "function": {"name": named, "arguments": c.text}}]}, None)
                )
            else:
                out.append(({"tool_calls": [{"index": 0, "function": {"arguments": c.text}}]}, None))
        if c.finish_reason is None:
            return out
        reason = final_reason(c.finish_reason)
        if named is not None:
            return [*out, ({}, "tool_calls" if reason == "stop" and call_ids[c.index] else reason)]
        call = _tool_call(self.tools, text, reason)
        if call is None:  # a "required" call cut short: what it made is plain content
            return [({"content": text}, None), ({}, reason)] if text else [({}, reason)]
        return [({"tool_calls": [{"index": 0, **call}]}, None), ({}, "tool_calls")]


def _tool_call(tools: ToolCallPlan | None, text: str, reason: str) -> dict[str, Any] | None:
    """The tool call a finished forced-call sequence made. A named call cut short (max_tokens) is still that
    call, with its partial arguments, as the stream already sent them; a "required" call cut short has no
    known function, so it is None (the text is content)."""
    if tools is None:
        return None
    parsed = tools.parse(text) if reason == "stop" else None
    if parsed is None and tools.name is not None and text:
        parsed = (tools.name, text)
    if parsed is None:
        return None
    name, arguments = parsed
    return {"id": new_tool_call_id(), "type": "function", "function": {"name": name, "arguments": arguments}}
