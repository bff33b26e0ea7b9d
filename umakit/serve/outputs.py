"""What one request's events become for its API: server-sent events as they come, or one JSON body at the end.

The HTTP layer (app.py) drives an `Output` the same way for every API: `start`,
then `token` for each `TokenEvent`, then `end` with the `FinalEvent` (streamed),
or `full` with all of them (not streamed); an error after the stream began
goes out as `error`'s events. A chat's text goes through its
`umakit.serve.replies.ReplyParser`, so reasoning, content and tool calls reach
each API as its own parts. OpenAI's chat completions and completions are
here; Anthropic's messages and OpenAI's responses have their own modules.
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass

from umakit.serve.replies import CONTENT, Piece, ReplyParser
from umakit.serve.openai_shapes import (ChatChoice, ChatChunkChoice, ChatCompletion, ChatCompletionChunk, ChatDelta,
                                 ChatMessageOut, Completion, CompletionChoice, FunctionCallOut, ToolCallDelta,
                                 ToolCallOut, UsageInfo, chat_logprobs, completion_logprobs)
from umakit.serve.types import FinalEvent, GenerationRequest, TokenEvent

DONE = b"data: [DONE]\n\n"
FINISH_TOOL_CALLS = "tool_calls"


@dataclass(frozen=True)
class Submission:
    """A request read by its API: what to submit to the scheduler, and the `Output` its events become."""

    request: GenerationRequest
    output: Output
    stream: bool
    include_usage: bool = False


def sse(chunk) -> bytes:
    """A pydantic model (or a dict) as one ``data:`` event."""
    body = chunk.model_dump_json() if hasattr(chunk, "model_dump_json") else json.dumps(chunk)
    return b"data: " + body.encode() + b"\n\n"


def request_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def named_sse(event: str, data: dict) -> bytes:
    """An event with a type line (Anthropic's and the Responses API's streams)."""
    return f"event: {event}\ndata: {json.dumps(data)}\n\n".encode()


class Output:
    """One request's answer in one API's shape (a subclass per API)."""

    def __init__(self, id: str, name: str, tokenizer, parser: ReplyParser | None = None, echo: str | None = None):
        self.id, self.name, self.tokenizer, self.parser = id, name, tokenizer, parser
        self.echo = echo  # the prompt's text, to begin the reply's (a completion's echo)
        self.index = 0  # the choice's, among a request's several (choices.py)
        self.created = int(time.time())
        self.final: FinalEvent | None = None

    def _meta(self) -> dict:
        return {"id": self.id, "created": self.created, "model": self.name}

    def start(self) -> list[bytes]:
        return []

    def token(self, e: TokenEvent) -> list[bytes]:
        raise NotImplementedError

    def end(self, final: FinalEvent, include_usage: bool) -> list[bytes]:
        raise NotImplementedError

    def full(self, tokens: list[TokenEvent], final: FinalEvent) -> dict:
        raise NotImplementedError

    def error(self, body: dict) -> list[bytes]:
        return [sse(body), DONE]

    def pieces(self, text: str) -> list[Piece]:
        """``text``'s parts of the reply (all content, without a parser)."""
        return self.parser.feed(text) if self.parser is not None else ([Piece(CONTENT, text)] if text else [])

    def rest(self, text: str) -> list[Piece]:
        """The parts of the reply's last text and of whatever the parser held back."""
        return self.pieces(text) + (self.parser.finish() if self.parser is not None else [])

    @property
    def calls(self) -> list:
        return self.parser.reply.calls if self.parser is not None else []

    def finish_reason(self, final: FinalEvent) -> str:
        return FINISH_TOOL_CALLS if self.calls else final.finish_reason


class ChatOutput(Output):
    """OpenAI's chat completions: ``chat.completion`` and ``chat.completion.chunk``."""

    def _chunk(self, delta: ChatDelta, finish: str | None = None, scored=()) -> bytes:
        return sse(ChatCompletionChunk(**self._meta(), choices=[ChatChunkChoice(
            index=self.index, delta=delta, finish_reason=finish,
            logprobs=chat_logprobs(self.tokenizer, scored) if scored else None)]))

    @staticmethod
    def _delta(piece: Piece) -> ChatDelta:
        if piece.kind == CONTENT:
            return ChatDelta(content=piece.text)
        return ChatDelta(reasoning_content=piece.text, reasoning=piece.text)

    def start(self) -> list[bytes]:
        return [self._chunk(ChatDelta(role="assistant", content=""))]

    def token(self, e: TokenEvent) -> list[bytes]:
        pieces = self.pieces(e.text)
        scored = [e] if e.logprob is not None else []
        if not pieces:  # text held back (a stop string or a marker may be forming)
            return [self._chunk(ChatDelta(content=""), scored=scored)] if scored else []
        return [self._chunk(self._delta(p), scored=scored if i == len(pieces) - 1 else ())
                for i, p in enumerate(pieces)]

    def end(self, final: FinalEvent, include_usage: bool) -> list[bytes]:
        self.final = final
        out = [self._chunk(self._delta(p)) for p in self.rest(final.text)]
        if self.calls:
            out.append(self._chunk(ChatDelta(tool_calls=[
                ToolCallDelta(index=i, id=c.id, function=FunctionCallOut(name=c.name, arguments=c.arguments))
                for i, c in enumerate(self.calls)])))
        out.append(self._chunk(ChatDelta(), self.finish_reason(final)))
        return out + ([self.usage_chunk(final)] if include_usage else []) + [DONE]

    def usage_chunk(self, final: FinalEvent) -> bytes:
        return sse(ChatCompletionChunk(**self._meta(), choices=[], usage=UsageInfo.of(final.usage)))

    def full(self, tokens: list[TokenEvent], final: FinalEvent) -> dict:
        self.final = final
        for e in tokens:
            self.pieces(e.text)
        self.rest(final.text)
        reply = self.parser.reply if self.parser is not None else None
        content = reply.content if reply is not None else "".join(e.text for e in tokens) + final.text
        calls = [ToolCallOut(id=c.id, function=FunctionCallOut(name=c.name, arguments=c.arguments))
                 for c in self.calls]
        reasoning = reply.reasoning if reply is not None and reply.reasoning else None
        scored = [e for e in tokens if e.logprob is not None]
        message = ChatMessageOut(content=content if content or not calls else None, tool_calls=calls or None,
                                 reasoning_content=reasoning, reasoning=reasoning)
        return ChatCompletion(**self._meta(), usage=UsageInfo.of(final.usage), choices=[ChatChoice(
            message=message, finish_reason=self.finish_reason(final),
            logprobs=chat_logprobs(self.tokenizer, scored) if scored else None)]).model_dump(mode="json")


class CompletionOutput(Output):
    """OpenAI's legacy completions: ``text_completion``; with ``echo``, the prompt's text begins the reply's, and
    with prompt scores (`FinalEvent.prompt_scores`) its tokens begin the logprobs."""

    def __init__(self, id: str, name: str, tokenizer, parser: ReplyParser | None = None, echo: str | None = None):
        super().__init__(id, name, tokenizer, parser, echo)
        self.sent = 0  # characters streamed so far: the logprobs' text_offset

    def _piece(self, text: str, scored=(), finish: str | None = None) -> bytes:
        logprobs = completion_logprobs(self.tokenizer, scored, self.sent) if scored else None
        self.sent += len(text)
        return sse(Completion(**self._meta(), choices=[CompletionChoice(index=self.index, text=text,
                                                                        logprobs=logprobs, finish_reason=finish)]))

    def start(self) -> list[bytes]:
        return [self._piece(self.echo)] if self.echo else []

    def token(self, e: TokenEvent) -> list[bytes]:
        if not e.text and e.logprob is None:
            return []  # text held back while a stop string may still form
        return [self._piece(e.text, [e] if e.logprob is not None else ())]

    def end(self, final: FinalEvent, include_usage: bool) -> list[bytes]:
        self.final = final
        out = [self._piece(final.text)] if final.text else []
        out.append(self._piece("", finish=final.finish_reason))
        return out + ([self.usage_chunk(final)] if include_usage else []) + [DONE]

    def usage_chunk(self, final: FinalEvent) -> bytes:
        return sse(Completion(**self._meta(), choices=[], usage=UsageInfo.of(final.usage)))

    def full(self, tokens: list[TokenEvent], final: FinalEvent) -> dict:
        self.final = final
        echo = self.echo or ""
        scored = [e for e in tokens if e.logprob is not None]
        logprobs = completion_logprobs(self.tokenizer, scored, len(echo)) if scored else None
        if final.prompt_scores:  # the prompt's tokens first, their offsets from the text's start
            logprobs = completion_logprobs(self.tokenizer, final.prompt_scores).joined(logprobs)
        return Completion(**self._meta(), usage=UsageInfo.of(final.usage), choices=[CompletionChoice(
            text=echo + "".join(e.text for e in tokens) + final.text, finish_reason=final.finish_reason,
            logprobs=logprobs)]).model_dump(mode="json")
