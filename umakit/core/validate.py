"""Checks for every value a user gives umakit, in one place.

CLI flags, chat ``/set``, batch lines and API keyword arguments all pass
through these functions (most via `umakit.generate.sampling.SamplingParams`, which
validates itself), so the same bad value gets the same message everywhere:
numbers must be finite and in range, integers must be integers (never bools),
seeds must fit in 64 bits, and text must be valid UTF-8, with the byte offset
of the first bad byte named.
"""

from __future__ import annotations

import math
import numbers
import os
from pathlib import Path

from umakit.errors import InvalidArgumentError

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1

# name -> (integer?, low, high, low open?, high open?): the range of each sampling setting.
SAMPLING_RANGES: dict[str, tuple[bool, float | None, float | None, bool, bool]] = {
    "temperature": (False, 0, None, False, False),
    "top_p": (False, 0, 1, True, False),
    "top_k": (True, 0, None, False, False),
    "min_p": (False, 0, 1, False, True),
    "repetition_penalty": (False, 0, None, True, False),
    "repetition_context": (True, 1, None, False, False),
    "presence_penalty": (False, -2, 2, False, False),  # OpenAI's range
    "frequency_penalty": (False, -2, 2, False, False),
}


def _interval(lo, hi, lo_open: bool, hi_open: bool) -> str:
    if hi is None:
        return f"{'>' if lo_open else '>='} {lo}"
    return f"in {'(' if lo_open else '['}{lo}, {hi}{')' if hi_open else ']'}"


def number(name: str, value, lo: float | None = None, hi: float | None = None,
           lo_open: bool = False, hi_open: bool = False) -> float:
    """``value`` (returned as given) if it is a finite real number within the bounds; else `InvalidArgumentError`."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise InvalidArgumentError(f"{name} must be a number, got {value!r}")
    try:
        x = float(value)
    except OverflowError:
        raise InvalidArgumentError(f"{name} is too large: {value}") from None
    if not math.isfinite(x):
        raise InvalidArgumentError(f"{name} must be a finite number, got {value!r}")
    if ((lo is not None and (x < lo or (lo_open and x == lo)))
            or (hi is not None and (x > hi or (hi_open and x == hi)))):
        raise InvalidArgumentError(f"{name} must be {_interval(lo, hi, lo_open, hi_open)}, got {value!r}")
    return value


def integer(name: str, value, lo: int | None = None, hi: int | None = None) -> int:
    """``value`` (returned as given) if it is an integer (not a bool, not a float) within ``[lo, hi]``."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise InvalidArgumentError(f"{name} must be an integer, got {value!r}")
    if (lo is not None and value < lo) or (hi is not None and value > hi):
        bound = f">= {lo}" if hi is None else f"in [{lo}, {hi}]"
        raise InvalidArgumentError(f"{name} must be {bound}, got {value}")
    return value


def seed(value) -> int | None:
    """A seed: None (random) or an integer that fits a signed 64-bit integer."""
    if value is None:
        return None
    return integer("seed", value, INT64_MIN, INT64_MAX)


def max_tokens(value) -> int:
    """A token budget: an integer of at least 1."""
    if integer("max_tokens", value) < 1:
        raise InvalidArgumentError(f"max_tokens must be at least 1, got {value}")
    return value


LOGIT_BIAS = 100  # OpenAI's range: a bias is in [-100, 100]


def logit_bias(value) -> tuple[tuple[int, float], ...]:
    """A logit bias (OpenAI's ``{token id: bias}``, ids as integers or as the strings JSON gives them; or pairs),
    as sorted ``(id, bias)`` pairs: ids non-negative integers, biases finite and in [-100, 100]."""
    try:
        pairs = [(key, bias) for key, bias in (value.items() if isinstance(value, dict) else value)]
    except (TypeError, ValueError):
        raise InvalidArgumentError(f"logit_bias must map token ids to numbers, got {value!r}") from None
    out = {}
    for key, bias in pairs:
        token = int(key) if isinstance(key, str) and key.strip().isdigit() else key
        out[integer("a logit_bias token id", token, 0)] = float(number(f"logit_bias[{key}]", bias, -LOGIT_BIAS,
                                                                      LOGIT_BIAS))
    return tuple(sorted(out.items()))


def sampling_field(name: str, value):
    """One sampling setting checked by name (the fields of `SamplingParams`): int or float, finite, in range;
    a logit bias as `logit_bias` takes it."""
    if name == "logit_bias":
        return logit_bias(value)
    if name not in SAMPLING_RANGES:
        raise InvalidArgumentError(f"unknown sampling setting {name!r}; known: {', '.join(SAMPLING_RANGES)}")
    ints, lo, hi, lo_open, hi_open = SAMPLING_RANGES[name]
    if ints:
        return integer(name, value, lo)
    return number(name, value, lo, hi, lo_open, hi_open)


def parse_setting(name: str, text: str):
    """A sampling setting typed as text (chat ``/set temperature 0.3``), parsed and checked."""
    ints = SAMPLING_RANGES.get(name, (False,))[0]
    try:
        value = int(text) if ints else float(text)
    except ValueError:
        raise InvalidArgumentError(f"{name} must be {'an integer' if ints else 'a number'}, got {text!r}") from None
    return sampling_field(name, value)


def decode_utf8(data: bytes, source: str) -> str:
    """``data`` decoded as UTF-8; invalid bytes are an error naming ``source`` and the offset of the first one."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise InvalidArgumentError(
            f"{source} is not UTF-8 text: byte 0x{data[e.start]:02x} at offset {e.start} ({e.reason}); "
            "convert it to UTF-8 first"
        ) from None


def text(value, name: str) -> str:
    """A string that encodes as UTF-8: argv and piped text decoded with surrogate escapes are refused here."""
    if not isinstance(value, str):
        raise InvalidArgumentError(f"{name} must be a string, got {type(value).__name__}")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raw = value.encode("utf-8", "surrogateescape") if _escapes_only(value) else None
        if raw is None:
            raise InvalidArgumentError(f"{name} holds an unpaired surrogate at character {_first_bad(value)}") from None
        return decode_utf8(raw, name)
    return value


def _escapes_only(value: str) -> bool:
    return all(ord(c) < 0xD800 or 0xDC80 <= ord(c) <= 0xDCFF or ord(c) > 0xDFFF for c in value)


def _first_bad(value: str) -> int:
    return next(i for i, c in enumerate(value) if 0xD800 <= ord(c) <= 0xDFFF)


def read_text(path: str | os.PathLike, what: str = "file") -> str:
    """A user's text file, read whole: missing, unreadable or non-UTF-8 files are one clear error."""
    path = Path(path)
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise InvalidArgumentError(f"no such {what}: {path}") from None
    except IsADirectoryError:
        raise InvalidArgumentError(f"{path} is a directory, not a {what}") from None
    except OSError as e:
        raise InvalidArgumentError(f"cannot read {path}: {e.strerror or e}") from None
    return decode_utf8(data, str(path))


def messages(value, name: str = "messages") -> list:
    """A chat's message list, with every string content valid UTF-8 (its structure is the tokenizer's to check)."""
    if not isinstance(value, list):
        raise InvalidArgumentError(f"{name} must be a list of {{role, content}} objects, got {value!r}"[:200])
    for i, m in enumerate(value):
        if isinstance(m, dict) and isinstance(m.get("content"), str):
            text(m["content"], f"{name}[{i}].content")
    return value


_check_messages, _check_max_tokens = messages, max_tokens  # the names `request` takes as keywords


def request(prompt=None, messages=None, system=None, max_tokens=1, stop=()) -> tuple[str, ...]:
    """Check one generation request's text and limits (what `Model.stream` and each batch item take).

    Returns ``stop`` as a tuple of strings (a single string becomes one stop).
    """
    if prompt is not None:
        text(prompt, "prompt")
    if messages is not None:
        _check_messages(messages)
    if system is not None:
        text(system, "system")
    _check_max_tokens(max_tokens)
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, (list, tuple)) or not all(isinstance(s, str) for s in stops):
        raise InvalidArgumentError(f"stop must be a string or a list of strings, got {stop!r}")
    return tuple(text(s, "stop") for s in stops)
