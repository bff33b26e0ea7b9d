"""A chat's settings and running totals, and its transcript on disk: JSON that `umakit run`'s /save writes and
/load reads back, for a chat in this process or attached to a server."""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

from umakit.core import validate
from umakit.core.affine import KV_BITS
from umakit.core.fsutil import atomic_file
from umakit.core.home import home_dir
from umakit.errors import InvalidArgumentError
from umakit.generate.sampling import DEFAULT_MAX_TOKENS, SamplingParams

TRANSCRIPT_VERSION = 1
SESSIONS_DIR = "sessions"  # under $UMAKIT_HOME: transcripts saved when a chat had to end on an error
ROLES = ("system", "user", "assistant")
MIN_CONTEXT = 16  # the smallest --max-context a chat takes


@dataclass
class SessionTotals:
    turns: int = 0
    prefilled_tokens: int = 0
    reused_tokens: int = 0
    generated_tokens: int = 0
    dropped_turns: int = 0
    peak_memory_bytes: int = 0

    def add(self, info, generated: int) -> None:
        """One turn: its `umakit.generate.chat.TurnInfo` (what was prefilled, reused, dropped) and its reply's
        tokens."""
        self.turns += 1
        self.prefilled_tokens += info.new_tokens
        self.reused_tokens += info.reused_tokens
        self.generated_tokens += generated
        self.dropped_turns += info.dropped_turns


@dataclass
class ChatSettings:
    """How a session generates; saved with its transcripts."""

    system: str | None = None  # the system prompt, kept when old turns are dropped
    max_tokens: int = DEFAULT_MAX_TOKENS  # per reply
    max_context: int | None = None  # None: the model's own context length
    kv_bits: int | None = None  # 4 or 8: a quantized KV cache; None: the compute dtype
    seed: int | None = None  # makes every reply's sampling reproducible
    sampling: SamplingParams = field(default_factory=SamplingParams)
    thinking: bool | None = None  # a reasoning model's switch (the template's enable_thinking); None: its default

    def __post_init__(self):
        # Settings come from CLI flags, /set and transcript files alike: checked here once.
        if self.system is not None:
            validate.text(self.system, "system")
        validate.max_tokens(self.max_tokens)
        if self.max_context is not None:
            validate.integer("max_context", self.max_context, MIN_CONTEXT)
        if self.kv_bits is not None and (isinstance(self.kv_bits, bool) or self.kv_bits not in KV_BITS):
            raise InvalidArgumentError(f"kv_bits must be 4, 8 or null, got {self.kv_bits!r}")
        validate.seed(self.seed)
        if self.thinking is not None and not isinstance(self.thinking, bool):
            raise InvalidArgumentError(f"thinking must be true, false or null, got {self.thinking!r}")
        if not isinstance(self.sampling, SamplingParams):
            raise InvalidArgumentError(f"sampling must be SamplingParams, got {type(self.sampling).__name__}")

    def to_dict(self) -> dict:
        """The JSON form of a transcript's ``settings``."""
        return asdict(self)  # sampling as a nested dict

    @classmethod
    def from_dict(cls, data: dict) -> "ChatSettings":
        """Settings from `to_dict`'s form; missing keys keep their defaults, unknown ones are an error."""
        if not isinstance(data, dict) or not isinstance(data.get("sampling", {}), dict):
            raise InvalidArgumentError("settings must be an object, with sampling an object")
        data = dict(data)
        sampling = data.pop("sampling", {})
        ours, theirs = {f.name for f in fields(cls)}, {f.name for f in fields(SamplingParams)}
        unknown = (set(data) - ours) | (set(sampling) - theirs)
        if unknown:
            raise InvalidArgumentError(f"unknown setting(s) {', '.join(sorted(unknown))}")
        return cls(**data, sampling=SamplingParams(**sampling))


def _check_messages(messages) -> list[dict]:
    validate.messages(messages)
    for i, m in enumerate(messages):
        if not (isinstance(m, dict) and {"role", "content"} <= set(m)):
            raise InvalidArgumentError(f"message {i} needs role and content")
        if m["role"] not in ROLES or not isinstance(m["content"], str):
            raise InvalidArgumentError(f"message {i} needs a role of {', '.join(ROLES)} and a string content")
    return [{"role": m["role"], "content": m["content"]} for m in messages]


def write_transcript(path: str | os.PathLike, model: str, settings: ChatSettings, messages: list[dict],
                     totals: SessionTotals) -> None:
    """A chat's transcript as JSON, written atomically (what `read_transcript` reads back)."""
    if Path(path).is_dir():
        raise InvalidArgumentError(f"{path} is a directory; give a file name for the transcript")
    data = {"version": TRANSCRIPT_VERSION, "model": model, "settings": settings.to_dict(), "messages": messages,
            "totals": asdict(totals)}
    with atomic_file(path, "w", encoding="utf-8") as f:
        json.dump(data, f, ensure_ascii=False, indent=2)


def read_transcript(path: str | os.PathLike) -> tuple[ChatSettings, list[dict]]:
    """A transcript's settings and messages, checked."""
    text = validate.read_text(path, "transcript")
    try:
        data = json.loads(text)
        if not isinstance(data, dict) or "messages" not in data:
            raise InvalidArgumentError("it is not an object with messages")
        return ChatSettings.from_dict(data.get("settings", {})), _check_messages(data["messages"])
    except (ValueError, KeyError, TypeError) as e:  # InvalidArgumentError is a ValueError
        raise InvalidArgumentError(f"{path} is not a umakit transcript: {e}") from e


def rescue_path() -> Path:
    """Where a chat that must end on an error saves its transcript: a new file under ``$UMAKIT_HOME/sessions/``."""
    return home_dir(SESSIONS_DIR) / (time.strftime("%Y%m%d-%H%M%S") + f"-{os.getpid()}.json")
