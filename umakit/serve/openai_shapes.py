"""OpenAI's response shapes: completions, chat completions, their chunks, usage and log-probabilities."""

from __future__ import annotations

import math
import time
from typing import ClassVar, Literal, Sequence

from pydantic import BaseModel, Field, model_serializer

from umakit.serve.types import Usage


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0


class UmakitUsage(BaseModel):
    """umakit's own figures for the request (an extension: OpenAI clients keep unknown fields)."""

    ttft_s: float
    decode_tps: float
    achieved_gbps: float
    peak_gbps: float
    mbu: float
    batch_rows: float


class UsageInfo(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails
    umakit: UmakitUsage

    @classmethod
    def of(cls, u: Usage) -> UsageInfo:
        return cls(prompt_tokens=u.prompt_tokens, completion_tokens=u.completion_tokens,
                   total_tokens=u.prompt_tokens + u.completion_tokens,
                   prompt_tokens_details=PromptTokensDetails(cached_tokens=u.cached_tokens),
                   umakit=UmakitUsage(ttft_s=u.ttft_s, decode_tps=u.decode_tps, achieved_gbps=u.achieved_gbps,
                                      peak_gbps=u.peak_gbps, mbu=u.mbu, batch_rows=u.batch_rows))


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob]


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float | None]  # None: a prompt's first token, which nothing predicted
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]

    def joined(self, after: CompletionLogprobs | None) -> CompletionLogprobs:
        if after is None:
            return self
        return CompletionLogprobs(tokens=self.tokens + after.tokens,
                                  token_logprobs=self.token_logprobs + after.token_logprobs,
                                  top_logprobs=self.top_logprobs + after.top_logprobs,
                                  text_offset=self.text_offset + after.text_offset)


class FunctionCallOut(BaseModel):
    name: str
    arguments: str  # JSON text


class ToolCallOut(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCallOut


class ToolCallDelta(ToolCallOut):
    index: int


class _Sparse(BaseModel):
    """Fields left None in ``_optional`` are left out of the JSON (a reply without reasoning has no such key)."""

    _optional: ClassVar[frozenset[str]] = frozenset()

    @model_serializer(mode="wrap")
    def _drop_absent(self, handler):
        return {k: v for k, v in handler(self).items() if v is not None or k not in self._optional}


class ChatDelta(_Sparse):
    _optional = frozenset({"role", "content", "reasoning_content", "reasoning", "tool_calls"})

    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning_content: str | None = None  # both names: clients read one or the other
    reasoning: str | None = None
    tool_calls: list[ToolCallDelta] | None = None


class ChatMessageOut(_Sparse):
    _optional = frozenset({"reasoning_content", "reasoning", "tool_calls"})

    role: Literal["assistant"] = "assistant"
    content: str | None
    reasoning_content: str | None = None
    reasoning: str | None = None
    tool_calls: list[ToolCallOut] | None = None


class ChatChoice(BaseModel):
    index: int = 0
    message: ChatMessageOut
    logprobs: ChatLogprobs | None = None
    finish_reason: str


class ChatChunkChoice(BaseModel):
    index: int = 0
    delta: ChatDelta
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None


class _Response(BaseModel):
    id: str
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    usage: UsageInfo | None = None


class ChatCompletion(_Response):
    object: Literal["chat.completion"] = "chat.completion"
    choices: list[ChatChoice]


class ChatCompletionChunk(_Response):
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    choices: list[ChatChunkChoice]


class Completion(_Response):
    object: Literal["text_completion"] = "text_completion"
    choices: list[CompletionChoice]


def _finite(x: float) -> float:
    return x if math.isfinite(x) else -9999.0  # a logprob of -inf (a token masked out) is not valid JSON


def chat_logprobs(tokenizer, entries: Sequence) -> ChatLogprobs:
    """OpenAI's chat logprobs of ``entries``: `TokenEvent`s that carry a logprob."""
    def top(token: int, logprob: float) -> TopLogprob:
        text = tokenizer.decode([token])
        return TopLogprob(token=text, logprob=_finite(logprob), bytes=list(text.encode()))

    return ChatLogprobs(content=[
        TokenLogprob(**top(e.token, e.logprob).model_dump(), top_logprobs=[top(t, lp) for t, lp in e.top_logprobs or ()])
        for e in entries])


def completion_logprobs(tokenizer, entries: Sequence, offset: int = 0) -> CompletionLogprobs:
    """The legacy completions shape: parallel lists; ``offset`` is the text already sent before these tokens."""
    out = CompletionLogprobs(tokens=[], token_logprobs=[], top_logprobs=[], text_offset=[])
    for e in entries:
        text = tokenizer.decode([e.token])
        out.tokens.append(text)
        out.token_logprobs.append(None if e.logprob is None else _finite(e.logprob))
        top: dict[str, float] = {}
        for t, lp in e.top_logprobs or ():  # most likely first: of two tokens with one text, the likelier's
            top.setdefault(tokenizer.decode([t]), _finite(lp))
        out.top_logprobs.append(None if e.logprob is None else top)
        out.text_offset.append(offset)
        offset += len(text)
    return out
