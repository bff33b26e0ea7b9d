"""Multi-turn chat with a KV cache kept across turns.

Each turn renders the whole conversation with the model's chat template, finds
the longest prefix shared with the tokens already in the cache, rewinds the
cache to it and prefills only the rest. Templates that re-render earlier turns
differently (or tokenizations that differ from what was generated) simply make
the shared prefix shorter: the fallback is correct, only slower.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Callable, Iterator, Sequence

from .errors import InvalidArgumentError, UmakitError
from .fsutil import atomic_file
from .generation import Chunk, GenerationStats
from .sampling import DEFAULT_MAX_TOKENS, SamplingParams

CUT_MARK = " [cut]"  # appended to a reply the user interrupted
TRANSCRIPT_VERSION = 1


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the longest shared prefix of two token lists."""
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


@dataclass
class SessionTotals:
    turns: int = 0
    prefilled_tokens: int = 0
    reused_tokens: int = 0
    generated_tokens: int = 0
    dropped_turns: int = 0
    peak_memory_bytes: int = 0


@dataclass
class TurnInfo:
    """What the session did before generating (for the UI's one-line notices)."""

    dropped_turns: int = 0  # oldest turns removed to fit the context
    reused_tokens: int = 0
    new_tokens: int = 0


@dataclass
class ChatSettings:
    """How a session generates; saved with its transcripts."""

    system: str | None = None  # the system prompt, kept when old turns are dropped
    max_tokens: int = DEFAULT_MAX_TOKENS  # per reply
    max_context: int | None = None  # None: the model's own context length
    kv_bits: int | None = None  # 4 or 8: a quantized KV cache; None: the compute dtype
    seed: int | None = None  # makes every reply's sampling reproducible
    sampling: SamplingParams = field(default_factory=SamplingParams)

    def to_dict(self) -> dict:
        """The JSON form of a transcript's ``settings``."""
        return asdict(self)  # sampling as a nested dict

    @classmethod
    def from_dict(cls, data: dict) -> "ChatSettings":
        """Settings from `to_dict`'s form; missing keys keep their defaults, unknown ones are an error."""
        data = dict(data)
        sampling = SamplingParams(**data.pop("sampling", {}))
        unknown = set(data) - {f.name for f in fields(cls)}
        if unknown:
            raise ValueError(f"unknown setting(s) {', '.join(sorted(unknown))}")
        return cls(**data, sampling=sampling)


class ChatSession:
    """A conversation: messages, the cache that holds them, and running totals."""

    def __init__(self, model, settings: ChatSettings | None = None, speculator=None):
        """``speculator`` (from `Model.speculator`) decodes every reply speculatively."""
        self.model = model
        self.settings = settings or ChatSettings()
        self.speculator = speculator
        limit = model.info.context_length or 0
        if self.settings.max_context is None:
            self.settings.max_context = limit or 4096
        elif limit and self.settings.max_context > limit:
            raise InvalidArgumentError(f"--max-context {self.settings.max_context} exceeds the model's {limit} tokens")
        self.messages: list[dict] = []
        self.totals = SessionTotals()
        self.reset()

    # -- state --------------------------------------------------------------------
    def reset(self) -> None:
        """Forget the conversation and empty the cache (the system prompt stays)."""
        self.messages = []
        self.cache = self.model.make_cache(kv_bits=self.settings.kv_bits)
        self.cached_ids: list[int] = []

    def set_system(self, text: str | None) -> None:
        self.settings.system = text or None

    @property
    def cache_bytes(self) -> int:
        return self.cache.nbytes

    def _conversation(self) -> list[dict]:
        sys = [{"role": "system", "content": self.settings.system}] if self.settings.system else []
        return sys + self.messages

    def _render(self, add_generation_prompt: bool = True) -> list[int]:
        return self.model.tokenizer.encode_chat(self._conversation(), add_generation_prompt=add_generation_prompt)

    def _rewind(self, ids: Sequence[int]) -> int:
        """Make the cache hold a prefix of ``ids`` (leaving at least one token to run)."""
        keep = min(common_prefix(self.cached_ids, ids), len(ids) - 1)
        try:
            self.cache.trim(self.cache.offset - keep)
        except InvalidArgumentError:  # e.g. a full sliding-window cache: start over
            self.cache = self.model.make_cache(kv_bits=self.settings.kv_bits)
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
            self.messages.pop()
            raise InvalidArgumentError(
                f"that message needs {len(ids)} tokens, more than the context limit of {limit}; shorten it or raise --max-context"
            )
        return ids, dropped

    # -- turns ----------------------------------------------------------------------
    def send(self, text: str, on_ready: Callable[[TurnInfo], None] | None = None,
             should_stop: Callable[[], bool] = lambda: False) -> Iterator[Chunk]:
        """Add a user message and stream the reply.

        ``on_ready`` hears what was reused and dropped before generation starts;
        ``should_stop`` is polled after each chunk (Ctrl-C): the partial reply is
        kept in the history, marked as cut.
        """
        self.messages.append({"role": "user", "content": text})
        ids, dropped = self._fit(self._render())
        reused = self._rewind(ids)
        new = ids[reused:]
        info = TurnInfo(dropped_turns=dropped, reused_tokens=reused, new_tokens=len(new))
        if on_ready:
            on_ready(info)
        s = self.settings
        max_tokens = max(min(s.max_tokens, s.max_context - len(ids)), 1)
        stream = self.model.stream_tokens(new, self.cache, max_tokens=max_tokens, seed=s.seed,
                                          history=ids[:reused], sampling=s.sampling, speculator=self.speculator)
        reply, generated, stats, cut = [], [], None, False
        try:
            for chunk in stream:
                if chunk.token is not None:
                    generated.append(chunk.token)
                reply.append(chunk.text)
                if chunk.stats is not None:
                    stats = chunk.stats
                yield chunk
                if should_stop() and chunk.stats is None:
                    cut = True
                    break
        finally:
            stream.close()
            content = "".join(reply) + (CUT_MARK if cut else "")
            self.messages.append({"role": "assistant", "content": content})
            known = list(ids) + generated
            self.cached_ids = known[: self.cache.offset]
            self.cache.trim(self.cache.offset - len(self.cached_ids))
            self._count(info, stats, len(generated))

    def _count(self, info: TurnInfo, stats: GenerationStats | None, generated: int) -> None:
        t = self.totals
        t.turns += 1
        t.prefilled_tokens += info.new_tokens
        t.reused_tokens += info.reused_tokens
        t.generated_tokens += generated
        t.dropped_turns += info.dropped_turns
        if stats is not None:
            t.peak_memory_bytes = max(t.peak_memory_bytes, stats.peak_memory_bytes)

    # -- transcripts ------------------------------------------------------------------
    def save(self, path: str | Path) -> None:
        """Write the transcript (messages, settings, totals) as JSON, atomically."""
        data = {
            "version": TRANSCRIPT_VERSION,
            "model": self.model.info.name,
            "settings": self.settings.to_dict(),
            "messages": self.messages,
            "totals": asdict(self.totals),
        }
        with atomic_file(path, "w", encoding="utf-8") as f:
            json.dump(data, f, ensure_ascii=False, indent=2)

    def load(self, path: str | Path) -> int:
        """Restore a transcript and prefill it into a fresh cache; returns tokens prefilled."""
        try:
            data = json.loads(Path(path).read_text(encoding="utf-8"))
            messages = data["messages"]
            settings = ChatSettings.from_dict(data.get("settings", {}))
            if not all(isinstance(m, dict) and {"role", "content"} <= set(m) for m in messages):
                raise ValueError("each message needs role and content")
        except FileNotFoundError as e:
            raise InvalidArgumentError(f"no such transcript: {path}") from e
        except (ValueError, KeyError, TypeError, UnicodeDecodeError) as e:
            raise InvalidArgumentError(f"{path} is not a umakit transcript: {e}") from e
        except UmakitError:
            raise
        old = (self.settings, self.messages)
        self.settings, self.messages = settings, messages
        try:
            self.cache = self.model.make_cache(kv_bits=settings.kv_bits)
            ids = self._render(add_generation_prompt=False) if messages else []
            if len(ids) >= settings.max_context:
                raise InvalidArgumentError(f"the transcript needs {len(ids)} tokens, over the context limit")
            self.model.engine.prefill(ids, self.cache)
        except BaseException:
            self.settings, self.messages = old  # keep the old conversation; its next turn re-prefills
            self.cache = self.model.make_cache(kv_bits=self.settings.kv_bits)
            self.cached_ids = []
            raise
        self.cached_ids = ids
        return len(ids)
