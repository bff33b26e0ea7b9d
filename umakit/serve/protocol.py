"""OpenAI's requests: models that validate once, the refusal of fields umakit does not implement, and the
sampling settings they carry (`umakit.serve.generation` maps a request to the scheduler's).

The fields umakit implements are declared. Any other top-level field is refused with a 400 that names it, as
OpenAI's API refuses an argument it does not recognise: a field that would change the answer is never accepted and
dropped. A few that cannot change it (``user``, ``metadata``, ...) are accepted. Sampling ranges are
`umakit.generate.sampling.SamplingParams`'s own checks, turned into 400s that name the field.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from umakit.errors import InvalidArgumentError
from umakit.generate.constrain import Constraint
from umakit.generate.sampling import SamplingParams
from umakit.serve.conversation import ChatCall
from umakit.serve.api_errors import APIError

MAX_STOP = 4  # stop strings per request, as OpenAI allows
MAX_STOP_CHARS = 1000  # each one's length: every new token's text is matched against each stop string's tail
UNKNOWN_CONTEXT_MAX_TOKENS = 1 << 20  # max_tokens's bound where the model does not state its context length
MAX_TOP_LOGPROBS = 20
INT64 = 2**63
SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty",
                   "frequency_penalty", "logit_bias")
# Fields that cannot change the answer: accepted, and otherwise unused.
IGNORED = frozenset({"user", "metadata", "store", "service_tier", "safety_identifier", "prompt_cache_key"})
# Why some fields clients send are refused (any other unknown field is refused too).
REFUSED = {
    "functions": "'functions' is not supported: use 'tools'",
    "function_call": "'function_call' is not supported: use 'tool_choice'",
    "audio": "audio output is not supported", "prediction": "predicted outputs are not supported",
    "web_search_options": "web search is not supported",
    **{k: f"{k} is not supported" for k in ("best_of",)},
}

# -- requests ----------------------------------------------------------------------------------------
class WireModel(BaseModel):
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False, populate_by_name=True)


class StreamOptions(WireModel):
    include_usage: bool | None = False


class ContentPart(WireModel):
    type: str
    text: str | None = None


class CalledFunction(WireModel):
    name: str
    arguments: str | dict = "{}"


class MessageToolCall(WireModel):
    id: str | None = None
    type: Literal["function"] = "function"
    function: CalledFunction


class ChatMessage(WireModel):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[MessageToolCall] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None  # a reasoning model's thinking, as llama.cpp and vLLM return it
    reasoning: str | None = None  # ... and as OpenRouter and Ollama do
    prefix: bool | None = None  # Mistral's and DeepSeek's: the reply continues this message (the last, an assistant's)

    @field_validator("content")
    @classmethod
    def _text_only(cls, content):
        if isinstance(content, list):
            for part in content:
                if part.type != "text" or part.text is None:
                    raise ValueError(f"only text content parts are supported, got a {part.type!r} part")
        return content

    def as_message(self) -> dict:
        """The message as `umakit.serve.conversation.ChatCall` takes it: a system role for OpenAI's 'developer',
        text parts joined, tool calls with their arguments as JSON text."""
        content = self.content
        if isinstance(content, list):
            content = "\n".join(p.text for p in content)
        out = {"role": "system" if self.role == "developer" else self.role,
               "content": content if content is not None or self.tool_calls else ""}
        if self.tool_calls:
            out["tool_calls"] = [{"id": c.id, "type": "function", "function": {
                "name": c.function.name, "arguments": c.function.arguments if isinstance(c.function.arguments, str)
                else json.dumps(c.function.arguments)}} for c in self.tool_calls]
        if self.role == "tool":
            out["tool_call_id"] = self.tool_call_id
        if self.name is not None:
            out["name"] = self.name
        thinking = self.reasoning_content if self.reasoning_content is not None else self.reasoning
        if thinking is not None:
            out["reasoning_content"] = thinking
        return out


class FunctionDef(WireModel):
    name: str
    description: str | None = None
    parameters: dict | None = None
    strict: bool | None = None


class ToolDef(WireModel):
    type: Literal["function"]
    function: FunctionDef


class ChosenFunction(WireModel):
    name: str


class NamedToolChoice(WireModel):
    type: Literal["function"]
    function: ChosenFunction


class JSONSchemaFormat(WireModel):
    name: str | None = None
    description: str | None = None
    json_schema: dict | bool | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(WireModel):
    """OpenAI's ``text``, ``json_object`` and ``json_schema``; llama.cpp's ``json_object`` with a ``schema``;
    and umakit's ``regex``, ``choice`` and ``grammar`` (a Lark grammar, llguidance's dialect)."""

    type: Literal["text", "json_object", "json_schema", "regex", "choice", "grammar"]
    json_schema: JSONSchemaFormat | None = None
    schema_: dict | None = Field(None, alias="schema")
    regex: str | None = None
    choices: list[str] | None = None
    grammar: str | None = None

    def constraint(self) -> Constraint | None:
        t = self.type
        if t == "text":
            return None
        if t == "json_object":
            return Constraint.json_schema(self.schema_) if self.schema_ is not None else Constraint.json_object()
        if t == "json_schema":
            if self.json_schema is None or self.json_schema.json_schema is None:
                raise APIError(400, "response_format json_schema needs json_schema.schema",
                               param="response_format.json_schema")
            return Constraint.json_schema(self.json_schema.json_schema)
        if t == "regex":
            return Constraint.regex(self.regex)
        if t == "choice":
            return Constraint.choice(self.choices or [])
        return Constraint.grammar(self.grammar)


class RequestBase(WireModel):
    model_config = ConfigDict(extra="allow", allow_inf_nan=False, populate_by_name=True)  # extras: refused by name

    model: str
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None  # token ids (as JSON's keys are text) to the bias added to each
    seed: int | None = Field(None, ge=-INT64, lt=INT64)
    stop: str | list[str] | None = None
    n: int | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    response_format: ResponseFormat | None = None
    # vLLM's: a caller's own namespace in the prompt cache, so that no other caller can time its prompts' reuse
    cache_salt: str | None = Field(None, min_length=1, max_length=256)

    @field_validator("stop")
    @classmethod
    def _stops(cls, stop):
        stops = [stop] if isinstance(stop, str) else stop or []
        if len(stops) > MAX_STOP:
            raise ValueError(f"at most {MAX_STOP} stop strings, got {len(stops)}")
        if any(s == "" for s in stops):
            raise ValueError("stop strings must not be empty")
        if any(len(s) > MAX_STOP_CHARS for s in stops):
            raise ValueError(f"a stop string may be at most {MAX_STOP_CHARS} characters long")
        return stops

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def requested_max_tokens(self) -> int | None:
        return self.max_tokens


class ChatRequest(RequestBase):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool | None = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    tools: list[ToolDef] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    reasoning_effort: str | None = None
    modalities: list[Literal["text"]] | None = None
    continue_final_message: bool | None = None  # vLLM's: the reply continues the last (assistant) message
    add_generation_prompt: bool | None = None  # vLLM's: False ends the prompt after the messages

    def chat_call(self) -> ChatCall:
        """The request in the terms every chat API shares."""
        for i, m in enumerate(self.messages):
            if m.role == "tool" and not m.tool_call_id:
                raise APIError(400, "a tool message needs the tool_call_id it answers", param=f"messages[{i}]")
            if m.prefix and (i < len(self.messages) - 1 or m.role != "assistant"):
                raise APIError(400, "only the last message, an assistant's, may be a prefix", param=f"messages[{i}]")
        choice = self.tool_choice
        return ChatCall(
            messages=[m.as_message() for m in self.messages],
            tools=[t.model_dump(exclude_none=True) for t in self.tools] if self.tools else None,
            tool_choice=choice.function.name if isinstance(choice, NamedToolChoice) else choice or "auto",
            parallel_tool_calls=self.parallel_tool_calls is not False,
            response=self.response_format.constraint() if self.response_format else None,
            template_kwargs=dict(self.chat_template_kwargs or {}), reasoning_effort=self.reasoning_effort,
            generation_prompt=self.add_generation_prompt,
            continue_final=bool(self.continue_final_message or self.messages[-1].prefix))

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def logprobs_count(self) -> int | None:
        if self.top_logprobs is not None and not self.logprobs:
            raise APIError(400, "top_logprobs needs logprobs set to true", param="top_logprobs")
        return (self.top_logprobs or 0) if self.logprobs else None


class CompletionRequest(RequestBase):
    prompt: str | list[int] | list[str] | list[list[int]]  # text or token ids, one prompt or several, as OpenAI's
    max_tokens: int | None = Field(None, ge=0)  # 0 with echo: the prompt scored, nothing generated
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    echo: bool | None = False  # the prompt's text before the reply's, and with logprobs its tokens' too
    suffix: str | None = None  # the text after the reply: fill in the middle (a code model's markers)

    def prompts(self) -> list[str | list[int]]:
        """Each prompt the request gives (a list of texts or of token-id lists is several, each a choice)."""
        p = self.prompt
        return [p] if isinstance(p, str) or not p or isinstance(p[0], int) else list(p)

    def logprobs_count(self) -> int | None:
        return self.logprobs


# Every field name of the models above: a validation error's location keeps these and indices,
# not pydantic's union-member tags.
_FIELDS = frozenset(
    field.alias or name for m in (ChatRequest, CompletionRequest, ChatMessage, ContentPart, StreamOptions,
                                  CalledFunction, MessageToolCall, FunctionDef, ToolDef, ChosenFunction,
                                  NamedToolChoice, JSONSchemaFormat, ResponseFormat)
    for name, field in m.model_fields.items())


def parse_request(cls: type[RequestBase], data, ignored: frozenset[str] = IGNORED) -> RequestBase:
    """``data`` (decoded JSON) validated as ``cls``; the first problem becomes a 400 naming its field."""
    if not isinstance(data, dict):
        raise APIError(400, "the request body must be a JSON object")
    try:
        req = cls.model_validate(data)
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
    refuse_unknown(req.model_extra or {}, ignored)
    return req


def refuse_unknown(extra: dict, ignored: frozenset[str] = IGNORED) -> None:
    """A 400 naming the first field umakit does not implement (those in ``ignored`` pass, as does a null: a
    client that writes every field it knows, null where unset, asks for nothing by it)."""
    for key, value in extra.items():
        if key not in ignored and value is not None:
            reason = REFUSED.get(key, f"unrecognized request argument supplied: {key}")
            raise APIError(400, f"{reason} (umakit serve refuses fields it does not implement)", param=key)


def sampling_from(req: RequestBase) -> SamplingParams:
    """The request's sampling settings over umakit's defaults; each is checked alone, so a 400 names it."""
    given = {k: getattr(req, k) for k in SAMPLING_FIELDS if getattr(req, k) is not None}
    for key, value in given.items():
        try:
            SamplingParams().with_overrides(**{key: value})
        except InvalidArgumentError as e:
            raise APIError(400, str(e), param=key) from e
    return SamplingParams().with_overrides(**given)
