"""OpenAI's Responses API (``POST /v1/responses``), stateless, for Codex and the newer OpenAI SDK paths.

``input`` (a string, or items: messages, ``function_call`` and
``function_call_output``) and ``instructions`` become the same
`umakit.serve.conversation.ChatCall` as a chat completion; function tools,
``tool_choice``, ``text.format`` (json_schema, json_object) and
``reasoning.effort`` map onto the same machinery. The reply is a ``response``
whose ``output`` holds reasoning, message and function_call items, or is
streamed as the API's typed events (``response.created`` ...
``response.completed``). Nothing is stored: ``previous_response_id`` and
``store: true`` with a later read are not offered, and the first is refused.
"""

from __future__ import annotations

import json
import time
from typing import Any, Literal

from pydantic import Field

from umakit.serve.conversation import ChatCall
from umakit.serve.outputs import Output, Submission, named_sse
from umakit.serve.api_errors import APIError
from umakit.serve.generation import chat_request
from umakit.serve.protocol import JSONSchemaFormat, RequestBase, WireModel, parse_request, sampling_from
from umakit.generate.constrain import Constraint
from umakit.serve.replies import REASONING, Piece
from umakit.serve.types import FinalEvent, TokenEvent

NOT_RESPONSES = ("stop", "n", "stream_options", "response_format", "max_tokens", "min_p", "repetition_penalty",
                 "top_k", "presence_penalty", "frequency_penalty", "seed", "logit_bias")


class InputPart(WireModel):
    type: str
    text: str | None = None


class InputItem(WireModel):
    type: str | None = None  # "message" (or absent, with a role), "function_call", "function_call_output", "reasoning"
    role: Literal["user", "assistant", "system", "developer"] | None = None
    content: str | list[InputPart] | None = None
    call_id: str | None = None
    name: str | None = None
    arguments: str | None = None
    output: str | list[InputPart] | None = None
    summary: list[InputPart] | None = None


class FunctionTool(WireModel):
    type: str
    name: str | None = None
    description: str | None = None
    parameters: dict | None = None
    strict: bool | None = None


class TextFormat(JSONSchemaFormat):
    type: Literal["text", "json_object", "json_schema"]


class TextOptions(WireModel):
    format: TextFormat | None = None


class Reasoning(WireModel):
    effort: str | None = None
    summary: str | None = None


class ResponsesRequest(RequestBase):
    input: str | list[InputItem]
    instructions: str | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    tools: list[FunctionTool] | None = None
    tool_choice: str | dict | None = None
    parallel_tool_calls: bool | None = None
    text: TextOptions | None = None
    reasoning: Reasoning | None = None
    previous_response_id: str | None = None
    truncation: Literal["disabled"] | None = None
    include: list[str] | None = None


def _text(content, where: str) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    for part in content:
        if part.type not in ("input_text", "output_text", "text", "summary_text", "reasoning_text"):
            raise APIError(400, f"{where}: a {part.type!r} part is not supported (text only)", param=where)
    return "\n".join(p.text or "" for p in content)


def _messages(req: ResponsesRequest) -> list[dict]:
    out = [{"role": "system", "content": req.instructions}] if req.instructions else []
    if isinstance(req.input, str):
        return out + [{"role": "user", "content": req.input}]
    reasoning = None
    for i, item in enumerate(req.input):
        where = f"input[{i}]"
        kind = item.type or "message"
        if kind == "message" and item.role is not None:
            role = "system" if item.role == "developer" else item.role
            message = {"role": role, "content": _text(item.content, where)}
            if role == "assistant" and reasoning is not None:
                message["reasoning_content"], reasoning = reasoning, None
            out.append(message)
        elif kind == "function_call":
            call = {"id": item.call_id, "type": "function", "function": {"name": item.name,
                                                                         "arguments": item.arguments or "{}"}}
            last = out[-1] if out else None
            if last is not None and last["role"] == "assistant" and last.get("tool_calls") is not None:
                last["tool_calls"].append(call)
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
                if reasoning is not None:
                    out[-1]["reasoning_content"], reasoning = reasoning, None
        elif kind == "function_call_output":
            out.append({"role": "tool", "tool_call_id": item.call_id, "content": _text(item.output, where)})
        elif kind == "reasoning":
            reasoning = _text(item.summary or item.content, where)
        else:
            raise APIError(400, f"{where}: {kind!r} items are not supported", param=where)
    return out


def _tool_choice(choice) -> str:
    if choice is None or isinstance(choice, str):
        return choice or "auto"
    if choice.get("type") == "function" and isinstance(choice.get("name"), str):
        return choice["name"]
    raise APIError(400, "tool_choice must be auto, none, required or {'type': 'function', 'name': ...}",
                   param="tool_choice")


def _call(req: ResponsesRequest) -> ChatCall:
    for i, t in enumerate(req.tools or ()):
        if t.type != "function" or not t.name:
            raise APIError(400, f"tools[{i}]: only function tools are supported, got {t.type!r}", param=f"tools[{i}]")
    tools = [{"type": "function", "function": {"name": t.name, "description": t.description or "",
                                               **({"parameters": t.parameters} if t.parameters else {})}}
             for t in req.tools] if req.tools else None
    fmt = req.text.format if req.text is not None else None
    response = None
    if fmt is not None and fmt.type == "json_object":
        response = Constraint.json_object()
    elif fmt is not None and fmt.type == "json_schema":
        if fmt.json_schema is None:
            raise APIError(400, "text.format json_schema needs a schema", param="text.format")
        response = Constraint.json_schema(fmt.json_schema)
    effort = req.reasoning.effort if req.reasoning is not None else None
    return ChatCall(messages=_messages(req), tools=tools, tool_choice=_tool_choice(req.tool_choice),
                    parallel_tool_calls=req.parallel_tool_calls is not False, response=response,
                    reasoning_effort=effort, effort_field="reasoning.effort")


def read(model, data, rid: str, timeout_s: float | None) -> Submission:
    req = parse_request(ResponsesRequest, data)
    for name in NOT_RESPONSES:
        if getattr(req, name) not in (None, False, []):
            raise APIError(400, f"'{name}' is not a Responses API field", param=name)
    if req.previous_response_id is not None:
        raise APIError(400, "previous_response_id: umakit serve stores no responses; send the whole input",
                       param="previous_response_id")
    if req.include:
        raise APIError(400, f"include: {', '.join(req.include)} is not supported", param="include")
    try:
        call = _call(req)
    except APIError:
        raise
    except Exception as e:  # a schema umakit cannot enforce
        raise APIError(400, str(e), param="text.format") from e
    gen, prepared = chat_request(model, call, req.max_output_tokens, sampling=sampling_from(req), seed=None,
                                 stop=(), logprobs=None, id=rid, timeout_s=timeout_s)
    out = ResponseOutput(rid, model.info.name, model.tokenizer, prepared.parser(), req, len(gen.prompt))
    return Submission(gen, out, bool(req.stream))


class ResponseOutput(Output):
    """A reply as a ``response`` object with reasoning, message and function_call items."""

    def __init__(self, id: str, name: str, tokenizer, parser, req: ResponsesRequest, prompt_tokens: int):
        super().__init__(id, name, tokenizer, parser)
        self.req, self.prompt_tokens = req, prompt_tokens
        self.items: list[dict] = []  # output items so far
        self.open: dict | None = None  # the reasoning or message item being streamed
        self.seq = 0

    def _event(self, kind: str, **data) -> bytes:
        self.seq += 1
        return named_sse(kind, {"type": kind, "sequence_number": self.seq - 1, **data})

    def _response(self, status: str, final: FinalEvent | None = None) -> dict:
        r = self.req
        usage = None
        if final is not None:
            u = final.usage
            usage = {"input_tokens": u.prompt_tokens, "input_tokens_details": {"cached_tokens": u.cached_tokens},
                     "output_tokens": u.completion_tokens, "output_tokens_details": {"reasoning_tokens": 0},
                     "total_tokens": u.prompt_tokens + u.completion_tokens}
        incomplete = final is not None and final.finish_reason == "length" and not self.calls
        return {"id": self.id, "object": "response", "created_at": self.created, "model": self.name,
                "status": "incomplete" if incomplete else status, "error": None,
                "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
                "instructions": r.instructions, "max_output_tokens": r.max_output_tokens,
                "output": self.items, "parallel_tool_calls": r.parallel_tool_calls is not False,
                "temperature": r.temperature, "top_p": r.top_p, "tool_choice": r.tool_choice or "auto",
                "tools": [t.model_dump(exclude_none=True) for t in r.tools or ()],
                "text": {"format": {"type": "text"}} if r.text is None else r.text.model_dump(exclude_none=True,
                                                                                              by_alias=True),
                "reasoning": None if r.reasoning is None else r.reasoning.model_dump(exclude_none=True),
                "truncation": "disabled", "store": False, "metadata": {}, "usage": usage}

    @staticmethod
    def _item(kind: str, index: int) -> dict:
        if kind == REASONING:
            return {"type": "reasoning", "id": f"rs_{index}_{time.time_ns()}", "summary": [],
                    "content": [{"type": "reasoning_text", "text": ""}], "status": "in_progress"}
        return {"type": "message", "id": f"msg_{index}_{time.time_ns()}", "role": "assistant",
                "status": "in_progress", "content": [{"type": "output_text", "text": "", "annotations": []}]}

    def _close(self, stream: bool) -> list[bytes]:
        item, self.open = self.open, None
        if item is None:
            return []
        item["status"] = "completed"
        if not stream:
            return []
        i, text = len(self.items) - 1, item["content"][0]["text"]
        if item["type"] == "reasoning":
            out = [self._event("response.reasoning_text.done", item_id=item["id"], output_index=i, content_index=0,
                               text=text)]
        else:
            part = item["content"][0]
            out = [self._event("response.output_text.done", item_id=item["id"], output_index=i, content_index=0,
                               text=text),
                   self._event("response.content_part.done", item_id=item["id"], output_index=i, content_index=0,
                               part=part)]
        return out + [self._event("response.output_item.done", output_index=i, item=item)]

    def _add(self, pieces: list[Piece], stream: bool) -> list[bytes]:
        out = []
        for p in pieces:
            kind = "reasoning" if p.kind == REASONING else "message"
            if self.open is None or self.open["type"] != kind:
                out += self._close(stream)
                self.open = self._item(p.kind, len(self.items))
                self.items.append(self.open)
                if stream:
                    i = len(self.items) - 1
                    added = json.loads(json.dumps(self.open))
                    out.append(self._event("response.output_item.added", output_index=i, item=added))
                    if kind == "message":
                        out.append(self._event("response.content_part.added", item_id=self.open["id"],
                                               output_index=i, content_index=0, part=added["content"][0]))
            self.open["content"][0]["text"] += p.text
            if stream:
                name = "response.reasoning_text.delta" if kind == "reasoning" else "response.output_text.delta"
                extra = {} if kind == "reasoning" else {"logprobs": []}
                out.append(self._event(name, item_id=self.open["id"], output_index=len(self.items) - 1,
                                       content_index=0, delta=p.text, **extra))
        return out

    def _finish(self, final: FinalEvent, stream: bool) -> list[bytes]:
        out = self._close(stream)
        for c in self.calls:
            i = len(self.items)
            item = {"type": "function_call", "id": f"fc_{i}_{time.time_ns()}", "call_id": c.id, "name": c.name,
                    "arguments": c.arguments, "status": "completed"}
            self.items.append(item)
            if stream:
                out += [self._event("response.output_item.added", output_index=i, item={**item, "arguments": "",
                                                                                        "status": "in_progress"}),
                        self._event("response.function_call_arguments.delta", item_id=item["id"], output_index=i,
                                    delta=c.arguments),
                        self._event("response.function_call_arguments.done", item_id=item["id"], output_index=i,
                                    arguments=c.arguments, name=c.name),
                        self._event("response.output_item.done", output_index=i, item=item)]
        return out

    def start(self) -> list[bytes]:
        created = self._response("in_progress")
        return [self._event("response.created", response=created),
                self._event("response.in_progress", response=created)]

    def token(self, e: TokenEvent) -> list[bytes]:
        return self._add(self.pieces(e.text), stream=True)

    def end(self, final: FinalEvent, include_usage: bool) -> list[bytes]:
        self.final = final
        out = self._add(self.rest(final.text), stream=True) + self._finish(final, stream=True)
        done = self._response("completed", final)
        kind = "response.incomplete" if done["status"] == "incomplete" else "response.completed"
        return out + [self._event(kind, response=done)]

    def full(self, tokens: list[TokenEvent], final: FinalEvent) -> dict[str, Any]:
        self.final = final
        for e in tokens:
            self._add(self.pieces(e.text), stream=False)
        self._add(self.rest(final.text), stream=False)
        self._finish(final, stream=False)
        return self._response("completed", final)

    def error(self, body: dict) -> list[bytes]:
        error = body.get("error", {})
        return [self._event("error", code=error.get("code"), message=error.get("message"), param=error.get("param"))]
