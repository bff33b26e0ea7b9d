"""A reply as a client reads it: the model's text split, as it streams, into reasoning, content and tool calls.

The model writes one stream of text. A reasoning model's thinking sits between
its template's markers (``<think>`` ... ``</think>``; the prompt may already
have opened them); a tool call is in its template's own syntax
(`umakit.serve.toolcalls`). `ReplyParser` takes the text as the scheduler
emits it and returns `Piece`s: reasoning and content are passed on as soon
as no marker can be forming in them, so a marker split across two tokens
never leaks into content; from the first sign of a tool call on, the text is
held, and parsed once the reply ends (a call that does not parse, cut by
max_tokens say, comes back as plain content, never an error). Every API
(OpenAI's chat completions, Anthropic's messages, OpenAI's responses) builds
its events from the same pieces.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from umakit.generate.stream import held_back
from umakit.serve.toolcalls import ToolCall, ToolFormat

REASONING, CONTENT = "reasoning", "content"


@dataclass(frozen=True)
class Thinking:
    """A template's thinking markers, and whether the prompt left the reply inside them."""

    start: str
    end: str
    leads: tuple[str, ...] = ()  # what begins a reply without reasoning (harmony's final channel), dropped
    open: bool = False  # the prompt ends with ``start``: the reply begins as reasoning


@dataclass
class Piece:
    kind: str  # REASONING | CONTENT
    text: str


@dataclass
class Reply:
    """A whole reply, parsed."""

    content: str = ""
    reasoning: str = ""
    calls: list[ToolCall] = field(default_factory=list)


class ReplyParser:
    """Splits one reply's text; ``tools`` is the format to parse calls in (None: no tools offered)."""

    def __init__(self, thinking: Thinking | None = None, tools: ToolFormat | None = None):
        self.thinking, self.tools = thinking, tools
        self._mode = REASONING if thinking is not None and thinking.open else None  # None: not decided yet
        self._pending = ""
        self._held: str | None = "" if tools is not None and not tools.markers else None  # a whole-reply format
        self._trim = False  # strip the blank lines between reasoning and content
        self.reply = Reply()

    def feed(self, text: str) -> list[Piece]:
        """The pieces ``text`` makes safe to pass on."""
        self._pending += text
        out: list[Piece] = []
        while self._pending:
            if not self._step(out):
                break
        return self._record(out)

    def _step(self, out: list[Piece]) -> bool:
        """Move what can move out of ``_pending``; False when the rest must wait for more text."""
        t = self.thinking
        if self._mode is None:  # the start of the reply: is it thinking?
            head = self._pending.lstrip()
            if t is not None and head.startswith(t.start):
                self._pending = head[len(t.start):]
                self._mode = REASONING
                return True
            lead = next((m for m in t.leads if head.startswith(m)), None) if t is not None else None
            if lead is not None:  # a reply with no reasoning
                self._pending, self._mode = head[len(lead):], CONTENT
                return True
            if t is not None and any(m.startswith(head) for m in (t.start, *t.leads)):
                return False  # it may still become a marker
            self._mode = CONTENT
            return True
        if self._mode == REASONING:
            exits = self.tools.exits if self.tools is not None else ()  # a call ending the reasoning (harmony's)
            found = [(i, m) for m in (t.end, *exits) if (i := self._pending.find(m)) >= 0]
            if found:
                i, end = min(found)
                out.append(Piece(REASONING, self._pending[:i]))
                if end != t.end:  # the call, parsed when the reply ends
                    self._held, self._pending, self._mode = self._pending[i:], "", CONTENT
                    return False
                self._pending = self._pending[i + len(t.end):]
                self._mode, self._trim = CONTENT, True
                return True
            keep = held_back(self._pending, [t.end, *exits])
            out.append(Piece(REASONING, self._pending[:len(self._pending) - keep]))
            self._pending = self._pending[len(self._pending) - keep:]
            return False
        if self._trim:
            stripped = self._pending.lstrip()
            if not stripped:
                self._pending = ""
                return False
            self._pending, self._trim = stripped, False
        if self._held is not None:
            self._held += self._pending
            self._pending = ""
            return False
        markers = self.tools.markers if self.tools is not None else ()
        starts = [i for i in (self._pending.find(m) for m in markers) if i >= 0]
        if starts:
            out.append(Piece(CONTENT, self._pending[:min(starts)]))
            self._held, self._pending = self._pending[min(starts):], ""
            return False
        keep = held_back(self._pending, markers)
        out.append(Piece(CONTENT, self._pending[:len(self._pending) - keep]))
        self._pending = self._pending[len(self._pending) - keep:]
        return False

    def finish(self) -> list[Piece]:
        """The pieces held back until the end; the calls, if any, are in ``reply.calls`` after this."""
        out: list[Piece] = []
        if self._pending:
            kind = REASONING if self._mode == REASONING else CONTENT
            text = self._pending.lstrip() if self._trim else self._pending
            out.append(Piece(kind, text))
            self._pending = ""
        if self._held:
            content, calls = self.tools.parse(self._held)
            self.reply.calls = calls
            out.append(Piece(CONTENT, content))
        self._held = None
        return self._record(out)

    def _record(self, pieces: list[Piece]) -> list[Piece]:
        pieces = [p for p in pieces if p.text]
        for p in pieces:
            if p.kind == REASONING:
                self.reply.reasoning += p.text
            else:
                self.reply.content += p.text
        return pieces


def parse_reply(text: str, thinking: Thinking | None = None, tools: ToolFormat | None = None) -> Reply:
    """A whole reply's text, parsed at once."""
    parser = ReplyParser(thinking, tools)
    parser.feed(text)
    parser.finish()
    return parser.reply
