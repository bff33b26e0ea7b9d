"""Fill in the middle: a code model's prompt for the text between a prefix and a suffix, as editors' completion
asks for it (OpenAI's ``suffix`` on completions).

A model trained for it has marker tokens in its vocabulary and one layout of them; the layout is judged from the
tokens the tokenizer holds, never from the model's name.
"""

from __future__ import annotations

from typing import Sequence

from umakit.errors import InvalidArgumentError

# (prefix marker, suffix marker, middle marker or None, whether the suffix comes first)
LAYOUTS = (
    ("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>", False),  # Qwen2.5-Coder, Qwen3-Coder, CodeGemma
    ("<fim_prefix>", "<fim_suffix>", "<fim_middle>", False),  # StarCoder, StarCoder2, Granite Code
    ("<｜fim▁begin｜>", "<｜fim▁hole｜>", "<｜fim▁end｜>", False),  # DeepSeek-Coder
    ("[PREFIX]", "[SUFFIX]", None, True),  # Codestral: [SUFFIX]suffix[PREFIX]prefix, the reply after the prefix
)


def infill_ids(tokenizer, prefix: Sequence[int], suffix: Sequence[int]) -> list[int]:
    """The prompt whose reply is the text between ``prefix`` and ``suffix`` (token ids, without markers), in the
    first layout whose markers are all tokens of ``tokenizer``; `InvalidArgumentError` for a model with none."""
    for pre, suf, mid, suffix_first in LAYOUTS:
        ids = [tokenizer.token_to_id(m) for m in (pre, suf, mid) if m is not None]
        if None in ids:
            continue
        if suffix_first:
            return [ids[1], *suffix, ids[0], *prefix]
        return [ids[0], *prefix, ids[1], *suffix, ids[2]]
    raise InvalidArgumentError("this model has no fill-in-the-middle tokens (such as <|fim_prefix|>, <fim_prefix> "
                               "or [SUFFIX]) in its vocabulary, so it cannot complete between a prefix and a suffix")
