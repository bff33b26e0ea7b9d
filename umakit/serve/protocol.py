"""OpenAI's wire format: request models that validate once, the mapping to a `GenerationRequest`,
the response and chunk shapes, and every error body, built in one place (`APIError`).

Only the fields umakit supports are declared; the rest are ignored, as
OpenAI's API ignores what it does not know. Sampling ranges are
`umakit.generate.sampling.SamplingParams`'s own checks, turned into 400s that name the
field.
"""

from __future__ import annotations

import math
import time
from typing import Literal, Sequence

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from umakit.errors import InvalidArgumentError, UmakitError
from umakit.generate.sampling import DEFAULT_MAX_TOKENS, SamplingParams
from umakit.serve.types import GenerationRequest, Usage

MAX_STOP = 4  # stop strings per request, as OpenAI allows
MAX_TOP_LOGPROBS = 20
INT64 = 2**63
SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")

# status -> (OpenAI error type, default code)
ERROR_TYPES = {
    400: ("invalid_request_error", None),
    401: ("invalid_request_error", "invalid_api_key"),
    404: ("invalid_request_error", "model_not_found"),
    405: ("invalid_request_error", "method_not_allowed"),
    413: ("invalid_request_error", "request_too_large"),
    429: ("rate_limit_error", "rate_limit_exceeded"),
    500: ("server_error", None),
    503: ("server_error", "unavailable"),
    504: ("server_error", "timeout"),
}


class APIError(Exception):
    """An HTTP error answered in OpenAI's shape: ``{"error": {"message", "type", "param", "code"}}``."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.headers = status, message, param, headers or {}
        kind, default_code = ERROR_TYPES.get(status, ERROR_TYPES[500 if status >= 500 else 400])
        self.type, self.code = kind, code if code is not None else default_code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


# -- requests ----------------------------------------------------------------------------------------
class _Model(BaseModel):
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)


class StreamOptions(_Model):
    include_usage: bool | None = False


class ContentPart(_Model):
    type: str
    text: str | None = None


class ChatMessage(_Model):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None

    @field_validator("content")
    @classmethod
    def _text_only(cls, content):
        if isinstance(content, list):
            for part in content:
                if part.type != "text" or part.text is None:
                    raise ValueError(f"only text content parts are supported, got a {part.type!r} part")
        return content

    def as_message(self) -> dict:
        """The message as a chat template takes it: a system role for OpenAI's 'developer', text joined."""
        content = self.content
        if isinstance(content, list):
            content = "\n".join(p.text for p in content)
        return {"role": "system" if self.role == "developer" else self.role, "content": content or ""}


class _Request(_Model):
    model: str
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    seed: int | None = Field(None, ge=-INT64, lt=INT64)
    stop: str | list[str] | None = None
    n: int | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None

    @field_validator("stop")
    @classmethod
    def _stops(cls, stop):
        stops = [stop] if isinstance(stop, str) else stop or []
        if len(stops) > MAX_STOP:
            raise ValueError(f"at most {MAX_STOP} stop strings, got {len(stops)}")
        if any(s == "" for s in stops):
            raise ValueError("stop strings must not be empty")
        return stops

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def requested_max_tokens(self) -> int | None:
        return self.max_tokens


class ChatRequest(_Request):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool | None = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def logprobs_count(self) -> int | None:
        if self.top_logprobs is not None and not self.logprobs:
            raise APIError(400, "top_logprobs needs logprobs set to true", param="top_logprobs")
        return (self.top_logprobs or 0) if self.logprobs else None


class CompletionRequest(_Request):
    prompt: str | list[str]
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, prompt):
        if isinstance(prompt, list):
            if len(prompt) != 1:
                raise ValueError(f"one prompt per request, got a list of {len(prompt)}")
            return prompt[0]
        return prompt

    def logprobs_count(self) -> int | None:
        return self.logprobs


# Every field name of the models above: a validation error's location keeps these and indices,
# not pydantic's union-member tags.
_FIELDS = frozenset(name for m in (ChatRequest, CompletionRequest, ChatMessage, ContentPart, StreamOptions)
                    for name in m.model_fields)


def parse_request(cls: type[_Request], data) -> _Request:
    """``data`` (decoded JSON) validated as ``cls``; the first problem becomes a 400 naming its field."""
    if not isinstance(data, dict):
        raise APIError(400, "the request body must be a JSON object")
    try:
        return cls.model_validate(data)
    except ValidationError as e:
        err = e.errors(include_url=False)[0]
        param = ""
        for part in err["loc"]:
            if isinstance(part, int):
                param += f"[{part}]"
            elif part in _FIELDS:
                param += f".{part}" if param else part
        message = err["msg"].removeprefix("Value error, ")
        if err["type"] == "missing":
            message = f"you must provide '{param}'"
        raise APIError(400, f"invalid '{param}': {message}" if err["type"] != "missing" else message,
                       param=param or None) from e


def sampling_from(req: _Request) -> SamplingParams:
    """The request's sampling settings over umakit's defaults; each is checked alone, so a 400 names it."""
    given = {k: getattr(req, k) for k in SAMPLING_FIELDS if getattr(req, k) is not None}
    for key, value in given.items():
        try:
            SamplingParams().with_overrides(**{key: value})
        except InvalidArgumentError as e:
            raise APIError(400, str(e), param=key) from e
    return SamplingParams().with_overrides(**given)


def generation_request(req: _Request, model, *, id: str, timeout_s: float | None) -> GenerationRequest:
    """Validate what the models alone cannot (model name, n, context) and build the scheduler's request."""
    if req.model != model.info.name:
        raise APIError(404, f"the model '{req.model}' does not exist; this server serves '{model.info.name}'",
                       param="model")
    if req.n not in (None, 1):
        raise APIError(400, f"n must be 1: umakit serve returns one choice per request (got n={req.n})", param="n")
    logprobs = req.logprobs_count()
    sampling = sampling_from(req)
    where = "messages" if isinstance(req, ChatRequest) else "prompt"
    try:
        if isinstance(req, ChatRequest):
            prompt = model.encode(messages=[m.as_message() for m in req.messages])
        else:
            prompt = model.encode(req.prompt, raw=True)
    except UmakitError as e:  # a chat template that refuses the conversation, for one
        raise APIError(400, str(e), param=where) from e
    if not prompt:
        raise APIError(400, f"the {where} is empty", param=where)
    return GenerationRequest(prompt=prompt, max_tokens=_max_tokens(req, len(prompt), model.info.context_length),
                             sampling=sampling, seed=req.seed,  # seed_or_random maps any int64 into range
                             stop=tuple(req.stop or ()), logprobs=logprobs,
                             timeout_s=timeout_s, id=id)


def _max_tokens(req: _Request, prompt_tokens: int, limit: int) -> int:
    """The tokens asked for, or by default as many as fit up to `DEFAULT_MAX_TOKENS`; 400 when they do not fit."""
    asked = req.requested_max_tokens()
    if not limit:
        return asked or DEFAULT_MAX_TOKENS
    if prompt_tokens + (asked or 1) > limit:
        where = "messages" if isinstance(req, ChatRequest) else "prompt"
        raise APIError(
            400, f"This model's maximum context length is {limit} tokens. However, you requested "
                 f"{prompt_tokens + (asked or 1)} tokens ({prompt_tokens} in the {where}, {asked or 1} in the "
                 f"completion). Please reduce the length of the {where} or completion.",
            param=where, code="context_length_exceeded")
    return asked or min(DEFAULT_MAX_TOKENS, limit - prompt_tokens)


# -- responses ---------------------------------------------------------------------------------------
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
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]]
    text_offset: list[int]


class ChatDelta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChatMessageOut(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


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
        out.token_logprobs.append(_finite(e.logprob))
        out.top_logprobs.append({tokenizer.decode([t]): _finite(lp) for t, lp in e.top_logprobs or ()})
        out.text_offset.append(offset)
        offset += len(text)
    return out
