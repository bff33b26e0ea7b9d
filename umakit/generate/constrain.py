"""Constrained decoding: what a reply must match, as a token mask applied to each row's logits before sampling.

A `Constraint` says what the text must be: a JSON schema, any JSON object,
a regular expression, one of a list of strings, or a Lark grammar. It is
checked (and its grammar built) without a model, so a bad schema is refused
before any work. `Constraint.matcher(tokenizer)` compiles it against a model's
vocabulary into a `Matcher`: the `umakit.backends.base.TokenConstraint` a
batch row carries (`BatchRow.constraint`). Each step the decoder asks every
constrained row for the tokens it may take next (`allowed`), puts -inf on the
others (`umakit.backends.common.sample_rows`), samples as usual, and tells
the matcher which token came out (`accept`). Rows with different constraints,
or none, share the forward pass; only the masks differ.

The grammar engine is llguidance: it compiles a JSON schema in about a
millisecond, computes a mask in tens of microseconds, treats anything it
cannot enforce as a compile error rather than a silent relaxation, and needs
no torch, so the MLX install stays light. Its JSON is compact (``", "`` and
``": "`` separators, no free whitespace), so a constrained reply cannot run
on in blank space, and once the grammar is complete only an end-of-sequence
token is allowed.

A reasoning model thinks first: with ``after`` (the template's end-of-thinking
text) the mask is off until that text has been generated, then on.
"""

from __future__ import annotations

import json
import re
import weakref
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Sequence

import numpy as np

from umakit.errors import InvalidArgumentError

if TYPE_CHECKING:
    from umakit.checkpoint.tokenizer import Tokenizer

_JSON_OBJECT = {"type": "object"}
# JSON as json.dumps writes it, ``{"a": 1, "b": [2, 3]}``, and no other whitespace, so a reply cannot run on in
# blank space (a schema's own "x-guidance" options may still ask for more).
_COMPACT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def _guidance():
    try:
        import llguidance
    except ImportError as e:  # pragma: no cover - a declared dependency
        raise InvalidArgumentError("constrained decoding needs the 'llguidance' package: pip install llguidance") from e
    return llguidance


@dataclass(frozen=True)
class Constraint:
    """What a reply must match. Build one with `json_schema`, `json_object`, `regex`, `choice` or `grammar`
    (each checks its input); ``after``: text after which the constraint starts (a reasoning model's
    end-of-thinking marker), None for from the first token."""

    kind: str
    value: Any = None
    after: str | None = None

    @classmethod
    def json_schema(cls, schema: dict | str | bool) -> Constraint:
        """Any JSON schema llguidance enforces (OpenAI's strict subset and more); a str is parsed as JSON."""
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except ValueError as e:
                raise InvalidArgumentError(f"the JSON schema is not valid JSON ({e})") from e
        if schema is True:
            schema = {}
        if not isinstance(schema, dict):
            raise InvalidArgumentError(f"a JSON schema must be an object, got {type(schema).__name__}")
        return cls("json_schema", schema).checked()

    @classmethod
    def json_object(cls) -> Constraint:
        """Any JSON object (OpenAI's ``response_format: {"type": "json_object"}``)."""
        return cls("json_object")

    @classmethod
    def regex(cls, pattern: str) -> Constraint:
        """Text matching ``pattern`` in full (Rust regex syntax: no look-around or back-references)."""
        if not isinstance(pattern, str) or not pattern:
            raise InvalidArgumentError("a regex must be a non-empty string")
        return cls("regex", pattern).checked()

    @classmethod
    def choice(cls, options: Sequence[str]) -> Constraint:
        """Exactly one of ``options``."""
        if isinstance(options, str) or not options or not all(isinstance(o, str) and o for o in options):
            raise InvalidArgumentError("choices must be a non-empty list of non-empty strings")
        return cls("choice", tuple(options))

    @classmethod
    def grammar(cls, lark: str) -> Constraint:
        """A Lark grammar in llguidance's dialect (``start:`` rule; ``%json {...}`` embeds a JSON schema)."""
        if not isinstance(lark, str) or not lark.strip():
            raise InvalidArgumentError("a grammar must be a non-empty string")
        return cls("grammar", lark).checked()

    def starting_after(self, marker: str | None) -> Constraint:
        """This constraint, off until ``marker`` has been generated (None: from the first token)."""
        return replace(self, after=marker)

    def describe(self) -> str:
        """For messages and logs: "a JSON schema", "a regex", ..."""
        return {"json_schema": "a JSON schema", "json_object": "a JSON object", "regex": "a regex",
                "choice": "a choice", "grammar": "a grammar"}[self.kind]

    def source(self) -> str:
        """The grammar llguidance compiles."""
        lg = _guidance().LLMatcher
        if self.kind in ("json_schema", "json_object"):
            return lg.grammar_from_json_schema(self.value if self.kind == "json_schema" else _JSON_OBJECT,
                                               defaults=_COMPACT)
        if self.kind == "regex":
            return lg.grammar_from_regex(self.value)
        if self.kind == "choice":
            return lg.grammar_from_lark("start: " + " | ".join(json.dumps(o) for o in self.value))
        return lg.grammar_from_lark(self.value)

    def checked(self) -> Constraint:
        """Self, once llguidance has compiled it without a vocabulary; else an error naming the problem."""
        lg = _guidance()
        try:
            error = lg.LLMatcher.validate_grammar(self.source())
        except (ValueError, TypeError) as e:
            error = str(e)
        if error:
            raise InvalidArgumentError(f"{self.describe()} umakit cannot enforce: {_tidy(error)}")
        return self

    def matcher(self, tokenizer: Tokenizer) -> Matcher:
        """A fresh `Matcher` of this constraint over ``tokenizer``'s vocabulary (one per row)."""
        lg = _guidance()
        vocab = vocabulary(tokenizer)
        matcher = lg.LLMatcher(vocab, self.source(), log_level=0)
        if matcher.is_error():
            raise InvalidArgumentError(f"{self.describe()} umakit cannot enforce: {_tidy(matcher.get_error())}")
        after = None if self.after is None else tokenizer.encode(self.after, add_special_tokens=False)
        return Matcher(matcher, vocab.vocab_size, vocab.eos_tokens, after)


def from_options(schema=None, regex: str | None = None, choices: Sequence[str] | None = None,
                 grammar: str | None = None) -> Constraint | None:
    """The one constraint the options ask for (None: none); ``schema`` is a JSON schema (a dict, or JSON text)
    or a `Constraint`. Giving two is an error."""
    given = [name for name, value in (("schema", schema), ("regex", regex), ("choices", choices),
                                      ("grammar", grammar)) if value is not None]
    if len(given) > 1:
        raise InvalidArgumentError(f"give at most one of schema, regex, choices and grammar (got {' and '.join(given)})")
    if isinstance(schema, Constraint):
        return schema
    if schema is not None:
        return Constraint.json_schema(schema)
    if regex is not None:
        return Constraint.regex(regex)
    if choices is not None:
        return Constraint.choice(choices)
    if grammar is not None:
        return Constraint.grammar(grammar)
    return None


def _tidy(error: str) -> str:
    return re.sub(r"\s+", " ", error).strip()


_vocabularies: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def vocabulary(tokenizer: Tokenizer):
    """llguidance's view of ``tokenizer`` (built once per tokenizer, about 0.4 s for 50k tokens): every token's
    bytes, and its end-of-sequence ids."""
    held = _vocabularies.get(tokenizer)
    if held is None:
        lg = _guidance()
        held = lg.LLTokenizer(tokenizer.backend_json(), eos_token=sorted(tokenizer.eos_ids) or None)
        _vocabularies[tokenizer] = held
    return held


def special_tokens(tokenizer: Tokenizer) -> dict[str, int]:
    """The added tokens llguidance treats as special (a grammar names them as ``<[id]>``; a string literal
    never matches one): text -> id."""
    vocab = vocabulary(tokenizer)
    return {text: i for text, i in tokenizer.added_tokens().items() if vocab.is_special_token(i)}


class Matcher:
    """One row's constraint as it decodes (`umakit.backends.base.TokenConstraint`)."""

    def __init__(self, matcher, vocab_size: int, eos: list[int], after: list[int] | None = None):
        self._m = matcher
        self._end = np.zeros(vocab_size, dtype=bool)  # once the text is complete: an end-of-sequence token only
        self._end[list(eos)] = True
        self._after = after or None  # token ids that switch the mask on; None: on from the start
        self._recent: list[int] = []
        self._words = np.empty((vocab_size + 31) // 32, dtype=np.int32)  # llguidance's bitmask, 32 tokens a word

    def allowed(self) -> np.ndarray | None:
        """A boolean mask over token ids (True: may come next), or None: any token (the constraint has not started)."""
        if self._after is not None:
            return None
        if self._m.is_stopped():
            return self._end
        self._m.unsafe_compute_mask_ptr(self._words.ctypes.data, self._words.nbytes)
        if self._m.is_error():
            raise InvalidArgumentError(f"the constraint failed: {_tidy(self._m.get_error())}")
        return np.unpackbits(self._words.view(np.uint8), bitorder="little").view(bool)

    def accept(self, token: int) -> None:
        """The token sampled for this row (from the mask `allowed` gave)."""
        if self._after is not None:
            self._recent = (self._recent + [token])[-len(self._after):]
            if self._recent == self._after:
                self._after = None
            return
        if not self._m.is_stopped() and not self._m.consume_token(token):
            raise InvalidArgumentError(f"token {token} broke the constraint: {_tidy(self._m.get_error())}")
