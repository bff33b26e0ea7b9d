"""Anthropic's Messages API (``POST /v1/messages``), for Claude Code and the ``anthropic`` SDK.

A request becomes the same `umakit.serve.conversation.ChatCall` as an OpenAI
chat: content blocks to messages (``tool_use`` to an assistant's tool calls,
``tool_result`` to tool messages, ``thinking`` to its reasoning), ``system``
first, ``input_schema`` tools to functions, ``tool_choice`` any/tool/none to
required/named/none. It runs on the same scheduler, prompt cache and limits.
A final assistant message is a prefill: the reply continues its text.
The reply comes back as content blocks (thinking, text, tool_use) with
Anthropic's stop reasons, or streamed as its event types (``message_start``,
``content_block_*``, ``message_delta``, ``message_stop``); errors have its
shape, ``{"type": "error", "error": {"type", "message"}}``. Fields it does
not implement are refused by name, as in the OpenAI routes.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import Field

from umakit.errors import InvalidArgumentError
from umakit.generate.constrain import Constraint
from umakit.serve.conversation import ChatCall, prepare
from umakit.serve.outputs import Output, Submission, named_sse
from umakit.serve.api_errors import APIError
from umakit.serve.generation import chat_request
from umakit.serve.protocol import INT64, RequestBase, WireModel, parse_request, sampling_from
from umakit.serve.replies import REASONING, Piece
from umakit.serve.types import FinalEvent, TokenEvent

MAX_STOP_SEQUENCES = 16
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 500: "api_error",
               503: "overloaded_error", 504: "api_error"}
STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use"}


class Block(WireModel):
    type: str
    text: str | None = None
    id: str | None = None  # tool_use
    name: str | None = None
    input: dict | None = None
    tool_use_id: str | None = None  # tool_result
    content: str | list[dict] | None = None
    is_error: bool | None = None
    thinking: str | None = None  # thinking (its signature is not checked)


class Message(WireModel):
    role: Literal["user", "assistant"]
    content: str | list[Block]


class Tool(WireModel):
    name: str
    description: str | None = None
    input_schema: dict
    type: str | None = None  # "custom" or absent; Anthropic's server tools are refused


class ToolChoice(WireModel):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class Thinking(WireModel):
    type: Literal["enabled", "disabled", "adaptive", "between_tools"]
    budget_tokens: int | None = None
    display: str | None = None


class OutputFormat(WireModel):
    type: Literal["json_schema"]
    json_schema: dict = Field(alias="schema")


class OutputConfig(WireModel):
    effort: Literal["low", "medium", "high", "xhigh", "max"] | None = None
    format: OutputFormat | None = None


class MessagesRequest(RequestBase):
    # OpenAI's field names the base declares that Anthropic's API does not have are refused below.
    max_tokens: int = Field(ge=1)
    messages: list[Message] = Field(min_length=1)
    system: str | list[Block] | None = None
    stop_sequences: list[str] | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    thinking: Thinking | None = None
    output_config: OutputConfig | None = None
    seed: int | None = Field(None, ge=-INT64, lt=INT64)  # umakit's, for reproducible sampling


# Fields that cannot change the answer (prompt-cache hints, routing, accounting): accepted and unused.
IGNORED = frozenset({"metadata", "service_tier", "cache_control", "inference_geo", "speed", "user_profile_id",
                     "workspace_id", "diagnostics"})

NOT_ANTHROPIC = ("stop", "n", "stream_options", "response_format", "min_p", "repetition_penalty",
                 "presence_penalty", "frequency_penalty", "logit_bias")


def error_body(err: APIError) -> dict:
    return {"type": "error", "error": {"type": ERROR_TYPES.get(err.status, "api_error"), "message": err.message}}


def _text(content, where: str) -> str:
    """A tool result's or system's content: a string or text blocks."""
    if content is None or isinstance(content, str):
        return content or ""
    parts = []
    for block in content:
        block = block if isinstance(block, dict) else block.model_dump()
        if block.get("type") != "text":
            raise APIError(400, f"{where}: only text content is supported, got a {block.get('type')!r} block",
                           param=where)
        parts.append(block.get("text") or "")
    return "\n".join(parts)


def _messages(req: MessagesRequest) -> list[dict]:
    out = [{"role": "system", "content": _text(req.system, "system")}] if req.system else []
    for i, m in enumerate(req.messages):
        where = f"messages[{i}].content"
        if isinstance(m.content, str):
            out.append({"role": m.role, "content": m.content})
            continue
        text, calls, thinking = [], [], []
        for block in m.content:
            if block.type == "text":
                text.append(block.text or "")
            elif block.type == "tool_use" and m.role == "assistant":
                calls.append({"id": block.id, "type": "function",
                              "function": {"name": block.name, "arguments": json.dumps(block.input or {})}})
            elif block.type == "tool_result" and m.role == "user":
                result = _text(block.content, where)
                out.append({"role": "tool", "tool_call_id": block.tool_use_id,
                            "content": f"Error: {result}" if block.is_error else result})
            elif block.type in ("thinking", "redacted_thinking") and m.role == "assistant":
                thinking.append(block.thinking or "")
            else:
                raise APIError(400, f"{where}: a {block.type!r} block is not supported in a {m.role} message",
                               param=where)
        if text or calls or m.role == "assistant":
            message = {"role": m.role, "content": "\n".join(text) if text or not calls else None}
            if calls:
                message["tool_calls"] = calls
            if thinking:
                message["reasoning_content"] = "\n".join(thinking)
            out.append(message)
    return out


def _call(req: MessagesRequest) -> ChatCall:
    tools = None
    for i, t in enumerate(req.tools or ()):
        if t.type not in (None, "custom"):
            raise APIError(400, f"tools[{i}]: server tools ({t.type}) are not supported", param=f"tools[{i}]")
    if req.tools:
        tools = [{"type": "function", "function": {"name": t.name, "description": t.description or "",
                                                   "parameters": t.input_schema}} for t in req.tools]
    choice, parallel = "auto", True
    if req.tool_choice is not None:
        c = req.tool_choice
        choice = {"auto": "auto", "any": "required", "none": "none"}.get(c.type) or c.name or ""
        parallel = not c.disable_parallel_tool_use
    kwargs: dict[str, Any] = {}
    config = req.output_config or OutputConfig()
    effort = None if config.effort is None else "high" if config.effort in ("xhigh", "max") else config.effort
    if req.thinking is not None and req.thinking.type != "disabled":
        effort = effort or "medium"  # mapped onto the template's switch; refused where it has none
    elif req.thinking is not None:
        kwargs["enable_thinking"] = False
    response = None if config.format is None else Constraint.json_schema(config.format.json_schema)
    messages, prefill = _prefill(_messages(req), len(req.messages) - 1)
    asked = "thinking" if req.thinking is not None and config.effort is None else "output_config.effort"
    return ChatCall(messages=messages, tools=tools, tool_choice=choice, parallel_tool_calls=parallel,
                    response=response, template_kwargs=kwargs, reasoning_effort=effort, effort_field=asked,
                    continue_final=prefill)


def _prefill(messages: list[dict], index: int) -> tuple[list[dict], bool]:
    """The messages, and whether the last is an assistant's text that the reply continues (a prefill); an
    empty one is dropped, since the reply starts where it would."""
    last = messages[-1]
    if last["role"] != "assistant" or last.get("tool_calls"):
        return messages, False
    if not last["content"]:
        return messages[:-1], False
    if last["content"] != last["content"].rstrip():
        raise APIError(400, "messages: a final assistant message (a prefill) may not end in whitespace",
                       param=f"messages[{index}].content")
    return messages, True


def read(model, data, rid: str, timeout_s: float | None):
    req = parse_request(MessagesRequest, data, IGNORED)
    for name in NOT_ANTHROPIC:
        if getattr(req, name) not in (None, False, []):
            raise APIError(400, f"'{name}' is not a Messages API field", param=name)
    stops = req.stop_sequences or []
    if len(stops) > MAX_STOP_SEQUENCES or any(s == "" for s in stops):
        raise APIError(400, f"stop_sequences: at most {MAX_STOP_SEQUENCES}, none empty", param="stop_sequences")
    try:
        call = _call(req)
    except InvalidArgumentError as e:  # a schema umakit cannot enforce
        raise APIError(400, str(e), param="output_config.format") from e
    gen, prepared = chat_request(model, call, req.max_tokens, sampling=sampling_from(req), seed=req.seed,
                                 stop=stops, logprobs=None, id=rid, timeout_s=timeout_s)
    out = MessagesOutput(rid, model.info.name, model.tokenizer, prepared.parser(), len(gen.prompt))
    return Submission(gen, out, bool(req.stream))


class CountRequest(MessagesRequest):
    max_tokens: int | None = Field(None, ge=1)  # not part of a count


def count_tokens(model, data) -> dict:
    """``POST /v1/messages/count_tokens``: the prompt's tokens as the request would be run (tools included)."""
    req = parse_request(CountRequest, data, IGNORED)
    try:
        count = len(prepare(model, _call(req)).prompt)
    except InvalidArgumentError as e:
        raise APIError(400, str(e), param="messages") from e
    # umakit's extension (clients keep unknown fields): the room there is, for a client that fits its turns to it
    return {"input_tokens": count, "umakit": {"context_length": model.info.context_length or None}}


class MessagesOutput(Output):
    """A reply as Anthropic's ``message``: blocks of thinking, text and tool_use."""

    def __init__(self, id: str, name: str, tokenizer, parser, prompt_tokens: int):
        super().__init__(id, name, tokenizer, parser)
        self.prompt_tokens = prompt_tokens
        self.open: str | None = None  # the kind of the block being streamed
        self.index = -1
        self.generated = 0

    def _message(self, content: list, stop_reason: str | None, stop: str | None, output_tokens: int) -> dict:
        return {"id": self.id, "type": "message", "role": "assistant", "model": self.name, "content": content,
                "stop_reason": stop_reason, "stop_sequence": stop,
                "usage": {"input_tokens": self.prompt_tokens, "output_tokens": output_tokens}}

    def _stop(self, final: FinalEvent) -> tuple[str, str | None]:
        if final.stop is not None:
            return "stop_sequence", final.stop
        return STOP_REASONS[self.finish_reason(final)], None

    def start(self) -> list[bytes]:
        return [named_sse("message_start", {"type": "message_start", "message": self._message([], None, None, 0)})]

    def _close(self) -> list[bytes]:
        if self.open is None:
            return []
        self.open = None
        return [named_sse("content_block_stop", {"type": "content_block_stop", "index": self.index})]

    def _block(self, block: dict) -> list[bytes]:
        out = self._close()
        self.index += 1
        self.open = block["type"]
        return out + [named_sse("content_block_start", {"type": "content_block_start", "index": self.index,
                                                        "content_block": block})]

    def _events(self, pieces: list[Piece]) -> list[bytes]:
        out = []
        for p in pieces:
            kind = "thinking" if p.kind == REASONING else "text"
            if self.open != kind:
                out += self._block({"type": "thinking", "thinking": "", "signature": ""} if kind == "thinking"
                                   else {"type": "text", "text": ""})
            delta = ({"type": "thinking_delta", "thinking": p.text} if kind == "thinking"
                     else {"type": "text_delta", "text": p.text})
            out.append(named_sse("content_block_delta", {"type": "content_block_delta", "index": self.index,
                                                         "delta": delta}))
        return out

    def token(self, e: TokenEvent) -> list[bytes]:
        return self._events(self.pieces(e.text))

    def end(self, final: FinalEvent, include_usage: bool) -> list[bytes]:
        self.final = final
        out = self._events(self.rest(final.text))
        for c in self.calls:
            out += self._block({"type": "tool_use", "id": c.id, "name": c.name, "input": {}})
            out.append(named_sse("content_block_delta", {"type": "content_block_delta", "index": self.index,
                                                         "delta": {"type": "input_json_delta",
                                                                   "partial_json": c.arguments}}))
        out += self._close()
        reason, stop = self._stop(final)
        out.append(named_sse("message_delta", {"type": "message_delta",
                                               "delta": {"stop_reason": reason, "stop_sequence": stop},
                                               "usage": {"output_tokens": final.usage.completion_tokens}}))
        return out + [named_sse("message_stop", {"type": "message_stop"})]

    def full(self, tokens: list[TokenEvent], final: FinalEvent) -> dict:
        self.final = final
        pieces = [p for e in tokens for p in self.pieces(e.text)] + self.rest(final.text)
        content: list[dict] = []
        for p in pieces:  # adjacent pieces of one kind make one block
            kind = "thinking" if p.kind == REASONING else "text"
            if content and content[-1]["type"] == kind:
                content[-1][kind] += p.text
            else:
                content.append({"type": "thinking", "thinking": p.text, "signature": ""} if kind == "thinking"
                               else {"type": "text", "text": p.text})
        content += [{"type": "tool_use", "id": c.id, "name": c.name, "input": json.loads(c.arguments)}
                    for c in self.calls]
        reason, stop = self._stop(final)
        return self._message(content, reason, stop, final.usage.completion_tokens)

    def error(self, body: dict) -> list[bytes]:
        return [named_sse("error", body)]
