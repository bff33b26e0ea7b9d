"""`umakit run` attached to a running `umakit serve`: the chat's session, with the model in the server.

`RemoteChat` keeps the conversation here and sends it whole each turn; the server's prompt cache finds the
part it has seen, so a turn prefills only its new tokens there, as a chat in this process does with its own
cache. It answers to everything the chat's UI (`umakit.cli.chat_ui.Repl`) asks of a `ChatSession`: ``send``
streams a reply as `Chunk`s and can be stopped at any moment (the reply is read on a thread, so a Ctrl-C is
seen within `POLL_S` even while the server is still prefilling), ``save``, ``load`` and ``rescue`` write and
read the same transcripts, and turns that no longer fit the model's context are dropped oldest first.
A reasoning model's thinking, which the server sends apart, comes back between the template's markers, where
the UI shows it dimmed.
"""

from __future__ import annotations

import os
import queue
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

from umakit.cli import attach
from umakit.core import validate
from umakit.errors import InvalidArgumentError
from umakit.generate.chat import CUT_MARK, THINK_END, THINK_START, TurnInfo
from umakit.generate.stream import Chunk
from umakit.generate.transcript import ChatSettings, SessionTotals, read_transcript, rescue_path, write_transcript

POLL_S = 0.05  # how often a waiting turn looks for a Ctrl-C


@dataclass
class Served:
    """A turn's figures as the server measured them (the UI's footer)."""

    ttft_s: float
    line: str  # decode speed and bandwidth, and which server


def _never() -> bool:
    return False


class RemoteChat:
    """A conversation with a model that a umakit server holds (see the module's docstring)."""

    def __init__(self, url: str, model: str, settings: ChatSettings, api_key: str | None = None):
        self.url, self.model_name, self.api_key = url, model, api_key
        self.settings = settings
        self.messages: list[dict] = []
        self.totals = SessionTotals()
        self.opens_thinking = False  # the server's thinking comes apart, never inside the reply's text
        self.thinking_markers: tuple[str, str] | None = None  # set once the server has sent thinking
        self.thinking_switch = True  # the server's template takes enable_thinking, or ignores it

    @classmethod
    def connect(cls, url: str, model: str, settings: ChatSettings, api_key: str | None = None) -> RemoteChat | None:
        """A chat with ``model`` at ``url``; None when no umakit server answers there or it does not serve the
        model. A server that hosts models by name loads it now (its token count needs the model), so the first
        turn does not wait for the load."""
        if not attach.server_at(url):
            return None
        chat = cls(url, model, settings, api_key)
        return chat if chat._prompt_tokens([{"role": "user", "content": "hi"}]) is not None else None

    # -- what the UI reads and changes ------------------------------------------------------------------
    def reset(self) -> None:
        self.messages = []

    def resync(self) -> None:
        """Nothing to do: the server's cache is checked against the whole conversation on every turn."""

    def set_system(self, text: str | None) -> None:
        if text:
            validate.text(text, "system")
        self.settings.system = text or None

    def save(self, path: str | os.PathLike) -> None:
        write_transcript(path, self.model_name, self.settings, self.messages, self.totals)

    def rescue(self) -> Path:
        path = rescue_path()
        self.save(path)
        return path

    def load(self, path: str | os.PathLike, should_stop: Callable[[], bool] = _never) -> int:
        """Restore a transcript; the server prefills it with the next turn, so none is prefilled now (0)."""
        settings, messages = read_transcript(path)
        if settings.kv_bits is not None:
            raise InvalidArgumentError(f"{path} asks for kv_bits {settings.kv_bits}, which the server at "
                                       f"{self.url} chooses; start `umakit run --no-server` to load it here")
        self.settings, self.messages = settings, messages
        return 0

    # -- turns --------------------------------------------------------------------------------------------
    def send(self, text: str, on_ready: Callable[[TurnInfo], None] | None = None,
             should_stop: Callable[[], bool] = _never) -> Iterator[Chunk]:
        """Add a user message and stream the reply, as `ChatSession.send` does: stopped before the reply
        begins, the message is taken back (``info.cancelled``); stopped, or cut by an error, in the middle,
        the partial reply stays in the history, marked as cut."""
        validate.text(text, "message")
        self.messages.append({"role": "user", "content": text})
        info = TurnInfo()
        try:
            reply = self._request(info)
        except BaseException:
            self.messages.pop()
            raise
        if on_ready:
            on_ready(info)
        shown, said, reasoning, cut = [], [], False, False  # said: the reply's content, what the history keeps
        try:
            for thinking, piece in _pumped(reply, should_stop):
                if not thinking:
                    said.append(piece)
                if thinking and not reasoning:
                    piece, reasoning, self.thinking_markers = THINK_START + piece, True, (THINK_START, THINK_END)
                elif reasoning and not thinking:
                    piece, reasoning = THINK_END + piece, False
                shown.append(piece)
                yield Chunk(piece)
            if should_stop():
                cut = True
            else:
                usage = reply.usage
                info.reused_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
                info.new_tokens = usage.get("prompt_tokens", 0) - info.reused_tokens
                own = usage.get("umakit") or {}
                yield Chunk("", finish_reason=reply.finish,
                            stats=Served(own.get("ttft_s", 0.0), attach.served_figures(reply)))
        except BaseException:
            cut = True
            raise
        finally:
            reply.close()
            if not shown and cut:
                info.cancelled = True
                self.messages.pop()
            else:
                # the content alone: a template renders its own thinking markers (gpt-oss's channels, say)
                self.messages.append({"role": "assistant", "content": "".join(said) + (CUT_MARK if cut else "")})
                self.totals.add(info, reply.usage.get("completion_tokens", 0))  # a cut reply's: never came

    def _request(self, info: TurnInfo) -> attach.Attached:
        """Send the conversation, its oldest turns (never the system prompt) dropped until it fits the model's
        context with room for a reply (at most 64 tokens of room insisted on), as a chat in this process does."""
        s = self.settings
        while True:
            counted = self._prompt_tokens(self.messages)
            if counted is None:
                raise InvalidArgumentError(f"the server at {self.url} no longer serves {self.model_name}")
            tokens, limit = counted
            if s.max_context:  # a loaded transcript's own limit, within the model's
                limit = min(limit or s.max_context, s.max_context)
            if not limit or tokens + min(s.max_tokens, 64) <= limit or len(self.messages) <= 1:
                break
            del self.messages[:2 if len(self.messages) > 2 and self.messages[1]["role"] == "assistant" else 1]
            info.dropped_turns += 1
        if limit and tokens >= limit:
            raise InvalidArgumentError(f"that message needs {tokens} tokens, more than the context limit of {limit}; "
                                       "shorten it")
        reply = attach.post(self.url, "chat/completions",
                            self._body(min(s.max_tokens, limit - tokens) if limit else s.max_tokens), self.api_key)
        if reply is None:
            raise InvalidArgumentError(f"the server at {self.url} no longer serves {self.model_name}")
        return reply

    def _prompt_tokens(self, messages: list[dict]) -> tuple[int, int | None] | None:
        """(the conversation's prompt tokens, the model's context length) as the server counts them; None when
        it does not serve the model. A server that hosts models by name loads it for the count."""
        body = {"model": self.model_name, "messages": messages, **self._thinking()}
        if self.settings.system:
            body["system"] = self.settings.system
        answer = attach.post_json(self.url, "messages/count_tokens", body, self.api_key)
        if answer is None:
            return None
        return answer["input_tokens"], (answer.get("umakit") or {}).get("context_length")

    def _thinking(self) -> dict:
        thinking = self.settings.thinking
        return {} if thinking is None else {"thinking": {"type": "enabled", "budget_tokens": 1024} if thinking
                                            else {"type": "disabled"}}

    def _body(self, max_tokens: int) -> dict:
        s = self.settings
        system = [{"role": "system", "content": s.system}] if s.system else []
        body = {"model": self.model_name, "messages": system + self.messages, "max_tokens": max_tokens,
                "stream": True, "stream_options": {"include_usage": True},
                "temperature": s.sampling.temperature, "top_p": s.sampling.top_p, "top_k": s.sampling.top_k,
                "min_p": s.sampling.min_p, "repetition_penalty": s.sampling.repetition_penalty,
                "presence_penalty": s.sampling.presence_penalty, "frequency_penalty": s.sampling.frequency_penalty}
        if s.seed is not None:
            body["seed"] = s.seed
        if s.thinking is not None:
            body["chat_template_kwargs"] = {"enable_thinking": s.thinking}
        return body


_END = object()


def _pumped(reply: attach.Attached, should_stop: Callable[[], bool]) -> Iterator[tuple[bool, str]]:
    """``reply.deltas()`` read on a thread, so that ``should_stop`` is seen every `POLL_S` while the server is
    silent (prefilling); ends early once it says stop, or raises what the reading raised."""
    items: queue.Queue = queue.Queue()

    def read():
        try:
            for item in reply.deltas():
                items.put(item)
            items.put(_END)
        except BaseException as e:  # handed to the chat's thread, which reports it
            items.put(e)

    threading.Thread(target=read, name="umakit-attached-reply", daemon=True).start()
    while not should_stop():
        try:
            item = items.get(timeout=POLL_S)
        except queue.Empty:
            continue
        if item is _END:
            return
        if isinstance(item, BaseException):
            raise item
        yield item
