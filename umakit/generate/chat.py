"""Multi-turn chat with a KV cache kept across turns.

Each turn renders the whole conversation with the model's chat template, finds
the longest prefix shared with the tokens already in the cache, rewinds the
cache to it and prefills only the rest. Templates that re-render earlier turns
differently (or tokenizations that differ from what was generated) simply make
the shared prefix shorter: the fallback is correct, only slower.

A turn may be stopped at any moment (Ctrl-C): the prefill runs in small chunks
with ``should_stop`` polled between them, and whatever happens, the cache ends
holding a prefix of the messages (``cached_ids``), so the next turn is correct.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator, Sequence

from umakit.core import validate
from umakit.errors import InvalidArgumentError, UmakitError
from umakit.generate.stream import Chunk, GenerationStats
from umakit.generate.transcript import ChatSettings, SessionTotals, read_transcript, rescue_path, write_transcript
from umakit.plan.shapes import INTERRUPT_PREFILL_CHUNK, PREFILL_CHUNK

CUT_MARK = " [cut]"  # appended to a reply the user interrupted
THINK_START, THINK_END = "<think>", "</think>"  # a reasoning model's thinking, in the templates that mark it
# gpt-oss's harmony format: the analysis channel, then the final one (a reply may go straight to the final one)
HARMONY_START = "<|channel|>analysis<|message|>"
HARMONY_END = "<|end|><|start|>assistant<|channel|>final<|message|>"
HARMONY_LEAD = "<|channel|>final<|message|>"
GEMMA4_START, GEMMA4_END = "<|channel>thought", "<channel|>"  # Gemma 4's thought channel
DEFAULT_CONTEXT = 4096  # a model that does not say its context length
# A prefill chunk that finishes in under this doubles the next one: fast devices soon prefill at
# full size (small chunks cost prefill speed), while the next chunk, about twice as long, still
# leaves a Ctrl-C well inside the 0.5 s the chat promises.
FAST_CHUNK_S = 0.05
SLOW_CHUNK_S = 0.25  # ... and one slower than this halves the next, down to one token (MLX on a slow CPU)


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the longest shared prefix of two token lists."""
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


def _never() -> bool:
    return False


def prefill_interruptibly(engine, tokens: Sequence[int], cache, should_stop: Callable[[], bool] = _never) -> int:
    """Prefill ``tokens`` into ``cache`` chunk by chunk, stopping early once ``should_stop()``; returns how many
    went in.

    Chunks start at `INTERRUPT_PREFILL_CHUNK` tokens and double (up to `PREFILL_CHUNK`) while
    each takes under `FAST_CHUNK_S`, or halve (down to 1) while each takes over `SLOW_CHUNK_S`.
    A device clearly faster or slower than that always gets the same chunks, so the same prompt
    prefills the same way each time.
    """
    done, n = 0, INTERRUPT_PREFILL_CHUNK
    while done < len(tokens) and not should_stop():
        part = list(tokens[done:done + n])
        start = time.perf_counter()
        engine.prefill(part, cache)
        done += len(part)
        elapsed = time.perf_counter() - start
        if elapsed < FAST_CHUNK_S:
            n = min(2 * n, PREFILL_CHUNK)
        elif elapsed > SLOW_CHUNK_S:
            n = max(1, n // 2)
    return done


@dataclass
class TurnInfo:
    """What the session did before generating (for the UI's one-line notices)."""

    dropped_turns: int = 0  # oldest turns removed to fit the context
    reused_tokens: int = 0
    new_tokens: int = 0
    cancelled: bool = False  # stopped before the reply began: the message was taken back


class Stopped(UmakitError):
    """``should_stop`` ended a `ChatSession.load` before its prefill finished; nothing changed."""


class ChatSession:
    """A conversation: messages, the cache that holds them, and running totals."""

    def __init__(self, model, settings: ChatSettings | None = None, speculator=None):
        """``speculator`` (from `Model.speculator`) decodes every reply speculatively."""
        self.model = model
        self.settings = settings or ChatSettings()
        self.speculator = speculator
        self.settings.max_context = self._context_limit(self.settings.max_context)
        self.messages: list[dict] = []
        self.totals = SessionTotals()
        self.opens_thinking = False  # whether the last prompt left the reply inside the thinking markers
        self.reset()

    def _context_limit(self, wanted: int | None) -> int:
        limit = self.model.info.context_length or 0
        if wanted is None:
            return limit or DEFAULT_CONTEXT
        if limit and wanted > limit:
            raise InvalidArgumentError(f"--max-context {wanted} exceeds the model's {limit} tokens")
        return wanted

    # -- state --------------------------------------------------------------------
    def reset(self) -> None:
        """Forget the conversation and empty the cache (the system prompt stays)."""
        self.messages = []
        self.resync()

    def resync(self) -> None:
        """Empty the cache, keeping the messages: the next turn prefills them all again (after an error
        that may have left the cache in doubt)."""
        self.cache = self.model.make_cache(kv_bits=self.settings.kv_bits)
        self.cached_ids: list[int] = []
        self._mark: tuple[list[int], object] | None = None  # a cache that cannot trim: its last prompt's state

    def set_system(self, text: str | None) -> None:
        if text:
            validate.text(text, "system")
        self.settings.system = text or None

    @property
    def cache_bytes(self) -> int:
        return self.cache.nbytes

    def _conversation(self) -> list[dict]:
        sys = [{"role": "system", "content": self.settings.system}] if self.settings.system else []
        return sys + self.messages

    @property
    def thinking_switch(self) -> bool:
        """Whether the model's chat template turns thinking on and off (``enable_thinking``, as Qwen3's)."""
        return "enable_thinking" in (self.model.tokenizer.chat_template or "")

    @property
    def thinking_markers(self) -> tuple[str, str, tuple[str, ...]] | None:
        """The template's thinking markers, when it has them (`thinking_markers`)."""
        return thinking_markers(self.model.tokenizer.chat_template or "")

    def _render(self, add_generation_prompt: bool = True) -> list[int]:
        kwargs = {} if self.settings.thinking is None else {"enable_thinking": self.settings.thinking}
        tok = self.model.tokenizer
        text = tok.render_chat(self._conversation(), add_generation_prompt=add_generation_prompt, **kwargs)
        self.opens_thinking = text.rstrip().endswith(THINK_START)  # the reply begins inside the thinking
        return tok.encode(text)

    def _rewind(self, ids: Sequence[int]) -> int:
        """Make the cache hold a prefix of ``ids`` (leaving at least one token to run)."""
        keep = min(common_prefix(self.cached_ids, ids), len(ids) - 1)
        try:
            self.cache.trim(self.cache.offset - keep)
        except InvalidArgumentError:  # a recurrent state, a full sliding window: back to the last prompt's mark
            marked, mark = self._mark if self._mark is not None else ([], None)
            if mark is not None and len(marked) <= keep and list(ids[:len(marked)]) == marked:
                self.cache.rewind(mark)
                keep = len(marked)
            else:  # or start over
                self.cache, self._mark = self.model.make_cache(kv_bits=self.settings.kv_bits), None
                keep = 0
        self.cached_ids = list(ids[:keep])
        return keep

    def _fit(self, ids: list[int]) -> tuple[list[int], int]:
        """Drop the oldest turns (never the system prompt) until the prompt fits with
        room for a reply of max_tokens (at most 64 tokens of room are insisted on)."""
        limit = self.settings.max_context
        dropped = 0
        while len(ids) + min(self.settings.max_tokens, 64) > limit and len(self.messages) > 1:
            # drop the oldest user message and the reply that followed it
            cut = 2 if len(self.messages) > 2 and self.messages[1]["role"] == "assistant" else 1
            del self.messages[:cut]
            dropped += 1
            ids = self._render()
        if len(ids) >= limit:
            raise InvalidArgumentError(
                f"that message needs {len(ids)} tokens, more than the context limit of {limit}; shorten it or raise --max-context"
            )
        return ids, dropped

    # -- turns ----------------------------------------------------------------------
    def send(self, text: str, on_ready: Callable[[TurnInfo], None] | None = None,
             should_stop: Callable[[], bool] = _never) -> Iterator[Chunk]:
        """Add a user message and stream the reply.

        ``on_ready`` hears what was reused and dropped before the prefill starts;
        ``should_stop`` (Ctrl-C) is polled between prefill chunks and after each
        reply chunk. Stopped during the prefill, the message is taken back
        (``info.cancelled``) and nothing is yielded; stopped later, the partial
        reply is kept in the history, marked as cut.
        """
        validate.text(text, "message")
        self.messages.append({"role": "user", "content": text})
        info, ids = TurnInfo(), None
        engine, s = self.model.engine, self.settings
        try:
            ids, info.dropped_turns = self._fit(self._render())
            info.reused_tokens = self._rewind(ids)
            info.new_tokens = len(ids) - info.reused_tokens
            if on_ready:
                on_ready(info)
            # All but the last token go in here, where a Ctrl-C is seen between chunks; the
            # stream below runs the last one and samples.
            start = time.perf_counter()
            engine.reset_peak_memory()
            prefill_interruptibly(engine, ids[info.reused_tokens:-1], self.cache, should_stop)
            prefill_s, prefill_peak = time.perf_counter() - start, engine.peak_memory()
            self.cached_ids = list(ids[: self.cache.offset])
            if not self.cache.trimmable:  # the prompt's state, for the next turn to go back to (`_rewind`)
                self._mark = (list(self.cached_ids), self.cache.mark())
            info.cancelled = should_stop()
            if not info.cancelled:
                done = len(self.cached_ids)
                max_tokens = max(min(s.max_tokens, s.max_context - len(ids)), 1)
                stream = self.model.stream_tokens(ids[done:], self.cache, max_tokens=max_tokens, seed=s.seed,
                                                  history=ids[:done], sampling=s.sampling, speculator=self.speculator)
        except BaseException:
            self._take_back(ids)
            raise
        if info.cancelled:
            self._take_back(ids)
            self.totals.prefilled_tokens += len(self.cached_ids) - info.reused_tokens
            return
        pre = done - info.reused_tokens  # prefilled here, before the stream's own prompt
        reply, generated, stats, cut = [], [], None, False
        try:
            for chunk in stream:
                if chunk.token is not None:
                    generated.append(chunk.token)
                reply.append(chunk.text)
                if chunk.stats is not None:
                    stats = _whole_turn(chunk.stats, pre, prefill_s, prefill_peak)
                yield chunk
                if should_stop() and chunk.stats is None:
                    cut = True
                    break
        finally:
            stream.close()
            self.messages.append(self._assistant("".join(reply), cut))
            known = list(ids) + generated
            self.cached_ids = known[: self.cache.offset]
            self.cache.trim(self.cache.offset - len(self.cached_ids))
            self._count(info, stats, len(generated))

    def _assistant(self, text: str, cut: bool) -> dict:
        """The reply as the history keeps it: as it came, but a harmony reply as its final channel's text, with
        its analysis as ``thinking`` (what gpt-oss's template renders; its channel markers are no content)."""
        markers = self.thinking_markers
        if markers is None or not markers[2]:
            return {"role": "assistant", "content": text + (CUT_MARK if cut else "")}
        start, end, leads = markers
        thinking = None
        if text.startswith(start):  # the analysis first (all of it, where the reply was cut inside it)
            thinking, _, content = text[len(start):].partition(end)
        else:
            content = next((text[len(m):] for m in leads if text.startswith(m)), text)
        message = {"role": "assistant", "content": content + (CUT_MARK if cut else "")}
        if thinking:
            message["thinking"] = thinking
        return message

    def _take_back(self, ids: Sequence[int] | None) -> None:
        """Remove the user message of a turn that never began its reply; the cache keeps the part of it
        that was prefilled (the next turn's prompt starts with the same tokens up to that message)."""
        self.messages.pop()
        if ids is not None:
            self.cached_ids = list(ids[: self.cache.offset])
            self.cache.trim(self.cache.offset - len(self.cached_ids))

    def _count(self, info: TurnInfo, stats: GenerationStats | None, generated: int) -> None:
        self.totals.add(info, generated)
        if stats is not None:
            self.totals.peak_memory_bytes = max(self.totals.peak_memory_bytes, stats.peak_memory_bytes)

    # -- transcripts ------------------------------------------------------------------
    def save(self, path: str | os.PathLike) -> None:
        """Write the transcript (messages, settings, totals) as JSON, atomically."""
        write_transcript(path, self.model.info.name, self.settings, self.messages, self.totals)

    def rescue(self) -> Path:
        """Save the transcript under ``$UMAKIT_HOME/sessions/`` (for a chat that must end on an error); returns
        where. `load` brings it back."""
        path = rescue_path()
        self.save(path)
        return path

    def load(self, path: str | os.PathLike, should_stop: Callable[[], bool] = _never) -> int:
        """Restore a transcript and prefill it into a fresh cache; returns tokens prefilled.

        Any failure, or ``should_stop`` during the prefill (`Stopped`), keeps the conversation as it was.
        """
        settings, messages = read_transcript(path)
        settings.max_context = self._context_limit(settings.max_context)
        old = (self.settings, self.messages)
        self.settings, self.messages = settings, messages
        try:
            self.resync()
            ids = self._render(add_generation_prompt=False) if messages else []
            if len(ids) >= settings.max_context:
                raise InvalidArgumentError(f"the transcript needs {len(ids)} tokens, over the context limit")
            if prefill_interruptibly(self.model.engine, ids, self.cache, should_stop) < len(ids):
                raise Stopped(f"stopped loading {path}; the conversation is as it was")
        except BaseException:
            self.settings, self.messages = old  # keep the old conversation; its next turn re-prefills
            self.resync()
            raise
        self.cached_ids = ids
        return len(ids)


def _whole_turn(stats: GenerationStats, pre: int, prefill_s: float, prefill_peak: int) -> GenerationStats:
    """The stream's stats widened to the turn: the ``pre`` tokens prefilled before it, in ``prefill_s``."""
    stats.prompt_tokens += pre
    stats.cached_tokens -= pre
    stats.ttft_s += prefill_s
    stats.prefill_tps = stats.prompt_tokens / stats.ttft_s if stats.ttft_s > 0 else 0.0
    stats.peak_memory_bytes = max(stats.peak_memory_bytes, prefill_peak)
    return stats


def thinking_markers(template: str) -> tuple[str, str, tuple[str, ...]] | None:
    """(start, end, leads) of a chat template's reasoning: the reply's text between start and end is reasoning, a
    lead begins a reply that has none (and is no text of it). ``<think>`` tags where the template has them; gpt-oss's
    harmony channels (analysis, then final) where it renders them; Gemma 4's thought channel."""
    if THINK_START in template and THINK_END in template:
        return THINK_START, THINK_END, ()
    if GEMMA4_START in template and GEMMA4_END in template:
        return GEMMA4_START, GEMMA4_END, ()
    if "<|channel|>" in template and "<|message|>" in template:
        return HARMONY_START, HARMONY_END, (HARMONY_LEAD,)
    return None
