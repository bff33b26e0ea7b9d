"""Speculative decoding, past the one-token roofline: `decoder.py` verifies, `proposers.py` proposes.

    model.generate("Fix the typos: ...", prompt_lookup=True)      # candidates copied from the prompt
    model.generate("Tell me a story", draft=small_model)          # candidates from a smaller model

A feature module above the engines: it uses only the declared protocol
(`Engine.logits` on a cache, `KVCache.trim`), so it runs on every engine.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from umakit.errors import InvalidArgumentError

if TYPE_CHECKING:
    from umakit.generate.speculative.decoder import SpeculativeDecoder

DEFAULT_DRAFT_TOKENS = 4  # with a draft model: each proposed token costs a draft step
DEFAULT_LOOKUP_TOKENS = 8  # with prompt lookup: proposals are free, only verification costs
MAX_DRAFT_TOKENS = 16
DEFAULT_NGRAM = 3
MAX_NGRAM = 8

__all__ = ["DEFAULT_DRAFT_TOKENS", "DEFAULT_LOOKUP_TOKENS", "DEFAULT_NGRAM", "DraftModel", "MAX_DRAFT_TOKENS",
           "MAX_NGRAM", "PromptLookup", "SpeculativeDecoder", "SpeculativeStats", "batch_lookup", "check_draft",
           "speculator"]


def __getattr__(name):
    """The decoder and proposers, imported on use (numpy): the CLI reads this module's limits on every start."""
    if name in ("SpeculativeDecoder", "SpeculativeStats"):
        from umakit.generate.speculative import decoder

        return getattr(decoder, name)
    if name == "DraftModel":
        from umakit.generate.speculative import proposers

        return proposers.DraftModel
    if name == "PromptLookup":
        from umakit.generate.lookup import PromptLookup

        return PromptLookup
    raise AttributeError(name)


def speculator(target, *, draft=None, prompt_lookup: bool = False, draft_tokens: int | None = None,
               ngram: int | None = None) -> SpeculativeDecoder | None:
    """The speculative decoder for ``target`` (a `umakit.Model`), or None when neither method is asked for.

    ``draft`` is a loaded `umakit.Model` sharing the target's tokenizer;
    ``draft_tokens`` caps the tokens proposed per step, ``ngram`` the n-gram
    prompt lookup matches. Every value is checked here, before any model work.
    """
    chosen = _chosen(draft is not None, prompt_lookup, draft_tokens, ngram)
    if chosen is None:
        return None
    from umakit.generate.speculative.decoder import SpeculativeDecoder
    from umakit.generate.lookup import PromptLookup
    from umakit.generate.speculative.proposers import DraftModel

    k, n = chosen
    vocab = int(target.engine.config.get("vocab_size") or target.tokenizer.vocab_size)
    if draft is not None:
        check_draft(target, draft)
        proposer = DraftModel(draft.engine, vocab)
    else:
        proposer = PromptLookup(n)
    return SpeculativeDecoder(target.engine, proposer, k, target.info.context_length,
                              draft.info.weights.bytes_per_token if draft is not None else 0.0)


def batch_lookup(prompt_lookup: bool = False, draft_tokens: int | None = None, ngram: int | None = None,
                 draft=None, target=None):
    """The `umakit.backends.base.Lookup` a batch's (or a server's) greedy rows speculate with, or None; every value
    checked here. ``draft``: a loaded `umakit.Model` sharing ``target``'s tokenizer, each row drafting on a cache of
    its own; given before the models load (a path, no ``target``), the values are checked and None returned."""
    chosen = _chosen(draft is not None, prompt_lookup, draft_tokens, ngram)
    if chosen is None or (draft is not None and target is None):
        return None
    from umakit.backends.base import Lookup

    k, n = chosen
    if draft is None:
        return Lookup(n, k)
    if not hasattr(draft, "engine"):
        raise InvalidArgumentError("a batch's draft must be a loaded umakit.Model (Model.generate_batch loads a path)")
    check_draft(target, draft)
    from umakit.generate.speculative.proposers import DraftModel

    engine, vocab = draft.engine, int(target.engine.config.get("vocab_size") or target.tokenizer.vocab_size)
    return Lookup(tokens=k, draft=lambda: DraftModel(engine, vocab))


def _chosen(drafts: bool, prompt_lookup: bool, draft_tokens: int | None, ngram: int | None):
    """(tokens proposed a step, n-gram or None) for a draft model or prompt lookup, every value checked; None
    when neither is asked for."""
    if drafts and prompt_lookup:
        raise InvalidArgumentError("choose one way to speculate: a draft model or prompt lookup, not both")
    if not drafts and not prompt_lookup:
        if draft_tokens is not None or ngram is not None:
            raise InvalidArgumentError("--draft-tokens and --ngram need --draft MODEL or --prompt-lookup")
        return None
    if drafts and ngram is not None:
        raise InvalidArgumentError("--ngram applies to --prompt-lookup, not to a draft model")
    default = DEFAULT_DRAFT_TOKENS if drafts else DEFAULT_LOOKUP_TOKENS
    k = _in_range("draft_tokens", default if draft_tokens is None else draft_tokens, 1, MAX_DRAFT_TOKENS)
    return k, None if drafts else _in_range("ngram", DEFAULT_NGRAM if ngram is None else ngram, 1, MAX_NGRAM)


def check_draft(target, draft) -> None:
    """Refuse a draft whose tokenizer differs from the target's, or that is larger than the target."""
    a, b = target.tokenizer, draft.tokenizer
    if a is None or b is None:
        raise InvalidArgumentError("speculative decoding needs models with tokenizers (not synthetic ones)")
    if a.vocab_size != b.vocab_size:
        raise InvalidArgumentError(f"the draft's tokenizer differs from the target's: {b.vocab_size} tokens "
                                   f"against {a.vocab_size}; use a draft of the same family")
    va, vb = a.vocab(), b.vocab()
    differ = next((t for t, i in va.items() if vb.get(t) != i), None)
    if differ is not None:
        raise InvalidArgumentError(f"the draft's tokenizer differs from the target's: token {differ!r} is id "
                                   f"{vb.get(differ)} in the draft and {va[differ]} in the target")
    if a.eos_ids != b.eos_ids:
        raise InvalidArgumentError(f"the draft ends text with token(s) {sorted(b.eos_ids)}, the target with "
                                   f"{sorted(a.eos_ids)}; use a draft of the same family")
    tp, dp = target.info.weights.params, draft.info.weights.params
    if dp > tp:
        raise InvalidArgumentError(f"the draft ({dp / 1e6:.0f}M parameters) is larger than the target "
                                   f"({tp / 1e6:.0f}M): swap them, or use a smaller draft")


def _in_range(name: str, value, lo: int, hi: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise InvalidArgumentError(f"{name} must be an integer from {lo} to {hi}, got {value!r}")
    return value
