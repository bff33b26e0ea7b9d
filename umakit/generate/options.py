"""The options of a generation call, declared once: their names, defaults, types and meanings.

`umakit.Model`'s `stream`, `generate`, `generate_batch`, `stream_batch` and
`speculator`, and `umakit.generate.batch`'s functions, each take a subset of
these as keyword-only arguments, named with `takes`:

    @takes(*PROMPT, *LIMITS, *SAMPLING)
    def generate(self, prompt=None, *, options: GenerationOptions) -> GenerationResult: ...

The function's signature (what `help()` and `inspect` show) then lists each
option with its default and type, and its docstring their meanings; an
unknown keyword is a `TypeError`, as in any Python function; and the body
receives them as one `GenerationOptions`.
"""

from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any, Callable, Sequence

from umakit.generate.sampling import DEFAULT_MAX_TOKENS, SamplingParams, sampling_params

if TYPE_CHECKING:
    import os

    from umakit.checkpoint.tokenizer import Message
    from umakit.generate.constrain import Constraint
    from umakit.errors import UmakitError

DEFAULT_BATCH_SIZE = 8


def _option(default: Any, doc: str):
    return field(default=default, metadata={"doc": doc})


@dataclass(frozen=True)
class GenerationOptions:
    """Every option a generation call may take, with its default."""

    messages: Sequence[Message] | None = _option(
        None, "the conversation so far, ``[{'role', 'content'}, ...]``, instead of a prompt")
    system: str | None = _option(None, "a system prompt, put before the messages")
    raw: bool = _option(False, "send a plain prompt as text, without the model's chat template")
    max_tokens: int = _option(DEFAULT_MAX_TOKENS, "the most tokens to generate (the model's context caps it)")
    stop: Sequence[str] | str = _option((), "strings that end the reply; they are not emitted")
    seed: int | None = _option(None, "makes sampling reproducible (a signed 64-bit integer)")
    kv_bits: int | None = _option(None, "4 or 8: quantize the KV cache, where the engine offers it")
    sampling: SamplingParams | None = _option(
        None, "the sampling settings (default `SamplingParams()`); each one named below overrides it")
    temperature: float | None = _option(None, "0 is greedy")
    top_p: float | None = _option(None, "nucleus sampling: keep the most likely tokens holding this mass")
    top_k: int | None = _option(None, "keep the k most likely tokens (0: all)")
    min_p: float | None = _option(None, "drop tokens less likely than this share of the most likely one")
    repetition_penalty: float | None = _option(None, "divide the recent tokens' positive logits by this (1: off)")
    repetition_context: int | None = _option(None, "how many recent tokens the penalty looks at")
    presence_penalty: float | None = _option(
        None, "OpenAI's: subtract this from the logit of every token generated so far (-2 to 2; 0: off)")
    frequency_penalty: float | None = _option(
        None, "OpenAI's: subtract this times a token's count so far from its logit (-2 to 2; 0: off)")
    logit_bias: dict[int, float] | None = _option(
        None, "OpenAI's: ``{token id: bias}``, each bias (-100 to 100) added to that token's logit")
    schema: dict | str | Constraint | None = _option(
        None, "the reply must be JSON valid against this JSON schema (a dict, JSON text, or a `Constraint`)")
    regex: str | None = _option(None, "the reply must match this regular expression in full")
    choices: Sequence[str] | None = _option(None, "the reply must be exactly one of these strings")
    grammar: str | None = _option(None, "the reply must match this Lark grammar (llguidance's dialect)")
    # Model is umakit.Model, only named here: this module is below it (annotations are never evaluated)
    draft: Model | str | os.PathLike | None = _option(
        None, "speculate with this smaller model (a `Model`, or its path), same tokenizer")
    draft_tokens: int | None = _option(None, "the most tokens proposed per speculative step")
    prompt_lookup: bool = _option(False, "speculate with candidates copied from the text so far")
    ngram: int | None = _option(None, "with prompt_lookup: the n-gram it matches")
    batch_size: int = _option(DEFAULT_BATCH_SIZE, "the most prompts decoded at once (the KV budget may lower it)")
    on_error: Callable[[int, UmakitError], None] | None = _option(
        None, "``on_error(index, error)`` hears each prompt that cannot run, and the others still run; "
              "without it the first such prompt raises before anything runs")

    def sampling_params(self) -> SamplingParams:
        """``sampling`` (default `SamplingParams()`) with each sampling option given here applied."""
        return sampling_params(self.sampling, **{k: getattr(self, k) for k in SAMPLING[1:]})

    def pick(self, names: Sequence[str]) -> dict:
        """The options ``names``, as keywords to pass on to a function that `takes` them."""
        return {k: getattr(self, k) for k in names}


PROMPT = ("messages", "system", "raw")
LIMITS = ("max_tokens", "stop", "seed")
SAMPLING = ("sampling", "temperature", "top_p", "top_k", "min_p", "repetition_penalty", "repetition_context",
            "presence_penalty", "frequency_penalty", "logit_bias")
SPECULATION = ("draft", "draft_tokens", "prompt_lookup", "ngram")
CONSTRAINTS = ("schema", "regex", "choices", "grammar")  # at most one: umakit.generate.constrain.from_options
ONE = (*PROMPT, *LIMITS, "kv_bits", *SAMPLING, *CONSTRAINTS, *SPECULATION)  # a reply: `Model.stream`, `Model.generate`
# a batch: `Model.generate_batch`, umakit.generate.batch
MANY = ("batch_size", "kv_bits", *LIMITS, "system", "raw", *SAMPLING, *CONSTRAINTS, *SPECULATION)
_FIELDS = {f.name: f for f in fields(GenerationOptions)}


def takes(*names: str):
    """Declare the options a function takes (see the module's docstring); it receives them as ``options``."""
    unknown = [n for n in names if n not in _FIELDS]
    assert not unknown, unknown  # a programming error in umakit, not a user's
    added = [inspect.Parameter(n, inspect.Parameter.KEYWORD_ONLY, default=_FIELDS[n].default,
                               annotation=_FIELDS[n].type) for n in names]

    def decorate(fn):
        own = [p for p in inspect.signature(fn).parameters.values() if p.name != "options"]
        signature = inspect.Signature(own + added, return_annotation=inspect.signature(fn).return_annotation)

        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            try:
                bound = signature.bind(*args, **kwargs)
            except TypeError as e:
                raise TypeError(f"{fn.__qualname__}() {e}") from None
            chosen = {k: v for k, v in bound.arguments.items() if k in _FIELDS}
            rest = {k: v for k, v in bound.arguments.items() if k not in _FIELDS}
            return fn(**rest, options=GenerationOptions(**chosen))

        wrapper.__signature__ = signature
        wrapper.__doc__ = (inspect.getdoc(fn) or "") + "\n\nOptions (keyword only):\n" + "".join(
            f"    {n}: {_FIELDS[n].metadata['doc']}\n" for n in names)
        return wrapper

    return decorate
