"""Rebuild tokenizer.json and tokenizer_config.json from a GGUF's tokenizer.

A GGUF stores the vocabulary, merges, token types and special ids as metadata
under llama.cpp's names. Two kinds are rebuilt here:

- ``gpt2``: byte-level BPE. The vocabulary is already spelled in the byte
  alphabet; the split regex before BPE depends on ``tokenizer.ggml.pre`` and is
  taken from llama.cpp's table for that name.
- ``llama``: SentencePiece-style BPE with byte fallback. Merges are read from
  the file, or derived from the token scores (best score merges first), as
  transformers does. Gemma files get Gemma's normalizer and space handling.
- ``gemma4``: the same, its merges always stored, BPE run over whole lines
  (llama.cpp's gemma4 pre-tokenizer: text and runs of newlines apart).

Tokens typed CONTROL or UNKNOWN become special added tokens, USER_DEFINED ones
plain added tokens, so both are matched whole in text as llama.cpp does.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

from umakit.errors import TokenizerError, UnsupportedModelError
from umakit.checkpoint.gguf.reader import GGUFFile

NORMAL, UNKNOWN, CONTROL, USER_DEFINED = 1, 2, 3, 4

_GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# o200k (gpt-4o, gpt-oss): the regex of its tokenizer.json, as llama.cpp quotes it (LLAMA_VOCAB_PRE_TYPE_GPT4O)
_GPT4O_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# tokenizer.ggml.pre -> how text is split before byte-level BPE (llama.cpp's llama-vocab.cpp)
_GPT2_PRE = {"default", "gpt2", "mpt", "olmo", "jais"}
_DIGITS_THEN_GPT2_PRE = {"smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva"}
_REGEX_PRE = {
    **dict.fromkeys(["llama3", "llama-v3", "llama-bpe", "falcon3", "pixtral", "dbrx", "smaug-bpe"], _LLAMA3_SPLIT),
    **dict.fromkeys(["qwen2", "deepseek-r1-qwen", "megrez"], _QWEN2_SPLIT),
    "gpt-4o": _GPT4O_SPLIT,
}
# Token texts llama.cpp also treats as end of generation when typed CONTROL.
_EOG_TEXTS = {
    "<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "<|eom_id|>", "<EOT>",
}


@dataclass
class TokenizerFiles:
    """Contents of the tokenizer-related files of an imported directory."""

    tokenizer_json: str
    tokenizer_config: dict
    generation_config: dict
    special_ids: dict  # bos_token_id, eos_token_id, pad_token_id, unk_token_id (absent if unset)
    warnings: list[str] = field(default_factory=list)


def _byte_level(tokens: list[str], merges: list[str], pre: str | None, warnings: list[str]):
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    alphabet = set(pre_tokenizers.ByteLevel.alphabet())
    spell = dict(zip(range(256), _byte_alphabet()))
    # A few files store added tokens as raw UTF-8; BPE needs them in the byte alphabet. One search over all the
    # tokens finds whether any is (testing each token took 0.2 s for 151,936).
    outside = re.compile(f"[^{re.escape(''.join(sorted(alphabet)))}]")
    if outside.search("".join(tokens)) is None:
        vocab = dict(zip(tokens, range(len(tokens))))
    else:
        vocab = {t if outside.search(t) is None else "".join(spell[b] for b in t.encode("utf-8")): i
                 for i, t in enumerate(tokens)}
    pairs = [tuple(m.split(" ", 1)) for m in merges]
    tok = Tokenizer(models.BPE(vocab, pairs, continuing_subword_prefix="", end_of_word_suffix="", fuse_unk=False))
    if pre in _REGEX_PRE:
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(_REGEX_PRE[pre]), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    elif pre in _DIGITS_THEN_GPT2_PRE:
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
        )
    else:
        if pre is not None and pre not in _GPT2_PRE:
            warnings.append(f"pre-tokenizer {pre!r} is not known; splitting text as GPT-2 does")
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return tok, alphabet


def _byte_alphabet() -> list[str]:
    """GPT-2's printable stand-in for each byte value 0..255, in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    extra = iter(range(256, 512))
    return [chr(b) if b in printable else chr(next(extra)) for b in range(256)]


def derive_merges(tokens: list[str], scores: list[float]) -> list[tuple[str, str]]:
    """Merges a SentencePiece BPE vocabulary implies: each split of a token into
    two known tokens, the ones making higher-scored tokens first."""
    ids = {t: i for i, t in enumerate(tokens)}
    found = []
    for token, score in zip(tokens, scores):
        splits = [(token[:k], token[k:]) for k in range(1, len(token)) if token[:k] in ids and token[k:] in ids]
        splits.sort(key=lambda lr: (ids[lr[0]], ids[lr[1]]))
        found.extend((left, right, score) for left, right in splits)
    found.sort(key=lambda m: (m[2], len(m[0]), len(m[1])), reverse=True)  # stable: ties keep vocab order
    return [(left, right) for left, right, _ in found]


def _sentencepiece(gf: GGUFFile, tokens: list[str], unk: str | None, add_space_prefix: bool):
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers

    gemma = gf.arch.startswith("gemma")
    if gemma:
        # Gemma files spell runs of spaces as real spaces, its merges expect "▁";
        # its scores do not follow merge order, the file order does.
        tokens = ["▁" * len(t) if " " in t and not t.strip() else t for t in tokens]
        scores = [-float(i) for i in range(len(tokens))]
    else:
        scores = gf.get("tokenizer.ggml.scores") or [0.0] * len(tokens)
    merges = gf.get("tokenizer.ggml.merges")
    pairs = [tuple(m.split(" ", 1)) for m in merges] if merges else derive_merges(tokens, scores)
    vocab = {t: i for i, t in enumerate(tokens)}
    tok = Tokenizer(models.BPE(vocab, pairs, unk_token=unk, fuse_unk=True, byte_fallback=True))
    steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    if gemma:
        tok.normalizer = normalizers.Replace(" ", "▁")
        tok.pre_tokenizer = pre_tokenizers.Split(" ", behavior="merged_with_previous")
        if gf.get("tokenizer.ggml.model") == "gemma4":  # BPE over whole lines; runs of newlines apart
            tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[^\n]+|\n+"), behavior="isolated")
    else:
        scheme = "first" if add_space_prefix else "never"
        tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme=scheme, split=False)
        if add_space_prefix:
            steps.append(decoders.Strip(" ", 1, 0))
    tok.decoder = decoders.Sequence(steps)
    return tok


def build_tokenizer(gf: GGUFFile) -> TokenizerFiles:
    """tokenizer.json, tokenizer_config.json and generation_config.json contents for ``gf``."""
    tokens = gf.get("tokenizer.ggml.tokens")
    if not tokens:
        raise TokenizerError(f"{gf.path.name} has no embedded tokenizer (tokenizer.ggml.tokens)")
    kind = gf.get("tokenizer.ggml.model")
    types = gf.get("tokenizer.ggml.token_type") or [NORMAL] * len(tokens)
    ids = _special_ids(gf, len(tokens))
    text = {name: tokens[i] for name, i in ids.items()}  # "bos_token_id" -> "<s>"
    warnings: list[str] = []
    if kind == "gpt2":
        merges, pre = gf.get("tokenizer.ggml.merges") or [], gf.get("tokenizer.ggml.pre")
        tok, alphabet = _byte_level(tokens, merges, pre, warnings)
        add_bos_default = False
    elif kind in ("llama", "gemma4"):  # gemma4: SentencePiece-style BPE with its merges stored
        add_space_prefix = bool(gf.get("tokenizer.ggml.add_space_prefix", True))
        tok, alphabet = _sentencepiece(gf, tokens, text.get("unk_token_id"), add_space_prefix), None
        add_bos_default = True  # llama.cpp's default for SentencePiece vocabularies, as in transformers
    else:
        raise UnsupportedModelError(
            f"{gf.path.name}: tokenizer {kind!r} is not supported (supported: gpt2, llama, gemma4)")
    _add_special_tokens(tok, tokens, types, alphabet)

    add_bos = bool(gf.get("tokenizer.ggml.add_bos_token", add_bos_default))
    add_eos = bool(gf.get("tokenizer.ggml.add_eos_token", False))
    _set_post_processor(tok, kind, text, ids, add_bos, add_eos)
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        **{f"{name}_token": text.get(f"{name}_token_id") for name in ("bos", "eos", "unk", "pad")},
        "add_bos_token": add_bos,
        "add_eos_token": add_eos,
        "clean_up_tokenization_spaces": False,
        "model_max_length": int(gf.get("{arch}.context_length", 4096)),
    }
    if (chat_template := gf.get("tokenizer.chat_template")) is not None:
        tokenizer_config["chat_template"] = chat_template
    generation_config = {k: ids[k] for k in ("bos_token_id", "pad_token_id") if k in ids}
    if eog := _end_of_generation_ids(gf, tokens, types, ids):
        generation_config["eos_token_id"] = eog[0] if len(eog) == 1 else eog
    return TokenizerFiles(tok.to_str(), tokenizer_config, generation_config, ids, warnings)


def _special_ids(gf: GGUFFile, n_tokens: int) -> dict[str, int]:
    keys = {"bos": "bos_token_id", "eos": "eos_token_id", "pad": "padding_token_id", "unk": "unknown_token_id"}
    ids = {}
    for name, key in keys.items():
        value = gf.get(f"tokenizer.ggml.{key}")
        if value is not None and 0 <= int(value) < n_tokens:
            ids[f"{name}_token_id"] = int(value)
    return ids


def _add_special_tokens(tok, tokens: list[str], types: list[int], alphabet: set[str] | None) -> None:
    """CONTROL and UNKNOWN tokens become special, USER_DEFINED ones plain added tokens.

    In a byte-level vocabulary a CONTROL token spelled outside the byte alphabet
    is a converter's mislabel; adding it would grow the vocabulary, so it is left out.
    """
    from tokenizers import AddedToken

    known = {t for t, ty in zip(tokens, types) if ty == USER_DEFINED and tok.token_to_id(t) is not None}
    tok.add_special_tokens([
        AddedToken(t, special=True, normalized=False)
        for t, ty in zip(tokens, types)
        if ty in (CONTROL, UNKNOWN) and (alphabet is None or set(t) <= alphabet)
    ])
    tok.add_tokens([
        AddedToken(t, special=False, normalized=False)
        for t, ty in zip(tokens, types)
        if ty == USER_DEFINED and t in known
    ])


def _set_post_processor(tok, kind: str, text: dict, ids: dict, add_bos: bool, add_eos: bool) -> None:
    """BOS/EOS around each encoding when the file asks for them, as Hugging Face repos do."""
    from tokenizers import processors

    bos = ["bos_token_id"] if add_bos and "bos_token_id" in ids else []
    eos = ["eos_token_id"] if add_eos and "eos_token_id" in ids else []
    if bos or eos:
        pieces = [text[k] for k in bos] + ["$A"] + [text[k] for k in eos]
        used = [(text[k], ids[k]) for k in bos + eos]
        tok.post_processor = processors.TemplateProcessing(single=pieces, special_tokens=used)
    elif kind == "gpt2":
        tok.post_processor = processors.ByteLevel(trim_offsets=False)


def _end_of_generation_ids(gf: GGUFFile, tokens: list[str], types: list[int], ids: dict) -> list[int]:
    """EOS first, then EOT/EOM and the CONTROL tokens llama.cpp also stops at."""
    eog = [ids["eos_token_id"]] if "eos_token_id" in ids else []
    for key in ("eot_token_id", "eom_token_id"):
        if (i := gf.get(f"tokenizer.ggml.{key}")) is not None:
            eog.append(int(i))
    eog += [i for i, (t, ty) in enumerate(zip(tokens, types)) if ty == CONTROL and t in _EOG_TEXTS]
    return list(dict.fromkeys(eog))


def dumps(obj: dict) -> str:
    """JSON as written to the output directory: indented, UTF-8 kept readable."""
    return json.dumps(obj, indent=2, ensure_ascii=False) + "\n"
