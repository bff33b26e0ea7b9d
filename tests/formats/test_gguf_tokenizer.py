"""tokenizer.json rebuilt from a GGUF encodes like the tokenizer the GGUF was made from,
and like transformers' own GGUF tokenizer.

The vocabularies are trained here (sentencepiece for the "llama" kind, the
tokenizers library for byte-level BPE) and written into metadata-only GGUF files.
"""

import io

import gguf
import pytest
from tokenizers import Tokenizer

from umakit.checkpoint.gguf.reader import open_gguf
from umakit.checkpoint.gguf.vocab import build_tokenizer

CORPUS = (
    "The quick brown fox jumps over the lazy dog. Paris is the capital of France. "
    "def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n"
    "Numbers 12345 and 3.14159, naïve café, 東京タワー 🚀. "
) * 40
TEXTS = [
    "Hello world",
    "The capital of France is Paris.",
    "  two leading spaces and   inner runs   ",
    "digits 1234567890 and 3.14159 and 42nd",
    "unicode: naïve café Ünïcödé 東京 🚀 ✓ ñ",
    "def f(x):\n\treturn x ** 2  # comment\n\n\nclass A: pass",
    "tabs\tand\r\nwindows newlines\n",
    "<|im_start|>user\nhi there<|im_end|>\n<|im_start|>assistant\n",
    "ZZZ qqq never-seen-words xylophone",
    "",
]


def write_tokenizer_gguf(path, arch, model, tokens, types, scores=None, merges=None, pre=None, **flags):
    w = gguf.GGUFWriter(str(path), arch)
    w.add_uint32(f"{arch}.context_length", 512)
    w.add_tokenizer_model(model)
    if pre:
        w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types(types)
    if scores is not None:
        w.add_token_scores(scores)
    if merges is not None:
        w.add_token_merges(merges)
    w.add_bos_token_id(flags.pop("bos", 1))
    w.add_eos_token_id(flags.pop("eos", 2))
    w.add_unk_token_id(0)
    for key, value in flags.items():
        w.add_bool(f"tokenizer.ggml.{key}", value)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def ours(path, tmp_path):
    files = build_tokenizer(open_gguf(path))
    (tmp_path / "tokenizer.json").write_text(files.tokenizer_json)
    return Tokenizer.from_file(str(tmp_path / "tokenizer.json")), files


def transformers_tokenizer(path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


def sentencepiece_vocab(add_dummy_prefix):
    spm = pytest.importorskip("sentencepiece", reason="trains the reference vocabulary")

    buf = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(CORPUS.split(". ")), model_writer=buf, vocab_size=420, model_type="bpe",
        byte_fallback=True, normalization_rule_name="identity", remove_extra_whitespaces=False,
        add_dummy_prefix=add_dummy_prefix, split_digits=True, allow_whitespace_only_pieces=True,
        user_defined_symbols=["<|im_start|>", "<|im_end|>"], unk_id=0, bos_id=1, eos_id=2, pad_id=-1,
        minloglevel=2,
    )
    sp = spm.SentencePieceProcessor(model_proto=buf.getvalue())
    n = sp.get_piece_size()
    tokens = [sp.id_to_piece(i) for i in range(n)]

    def kind(i):  # llama.cpp's token types, as its converter assigns them
        if sp.is_unknown(i):
            return 2
        if sp.is_control(i):
            return 3
        if sp.is_byte(i):
            return 6
        return 4 if tokens[i].startswith("<|") else 1

    return sp, tokens, [kind(i) for i in range(n)], [sp.get_score(i) for i in range(n)]


@pytest.mark.parametrize("arch, dummy_prefix", [("llama", True), ("gemma3", False)])
def test_sentencepiece_vocab(tmp_path, arch, dummy_prefix):
    sp, tokens, types, scores = sentencepiece_vocab(dummy_prefix)
    path = write_tokenizer_gguf(tmp_path / "t.gguf", arch, "llama", tokens, types, scores=scores,
                                add_space_prefix=dummy_prefix, add_bos_token=True)
    tok, files = ours(path, tmp_path)
    ref = transformers_tokenizer(path)
    assert files.tokenizer_config["add_bos_token"] is True and files.tokenizer_config["bos_token"] == "<s>"
    for text in TEXTS:
        ids = tok.encode(text, add_special_tokens=False).ids
        assert ids == ref(text, add_special_tokens=False).input_ids, text
        # Where transformers and sentencepiece part ways we follow transformers: its Metaspace adds no
        # "▁" in front of text that starts with a space or with an added token; sentencepiece does.
        if not text.startswith((" ", "<|")):
            assert ids == sp.encode(text), text
            assert tok.decode(ids, skip_special_tokens=False) == text, text
        assert tok.decode(ids, skip_special_tokens=False) == ref.decode(ids), text
        assert tok.encode(text).ids == [1] + ids  # the post-processor adds BOS as the file asks


def byte_level_vocab(pre_split):
    from tokenizers import Regex, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(pre_split), behavior="isolated"),
         pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
    )
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    trainer = trainers.BpeTrainer(vocab_size=600, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([CORPUS], trainer)
    model = tok.to_str()
    import json

    spec = json.loads(model)["model"]
    vocab = sorted(spec["vocab"].items(), key=lambda kv: kv[1])
    merges = [" ".join(m) if isinstance(m, list) else m for m in spec["merges"]]
    tok.add_special_tokens(specials)
    return tok, [t for t, _ in vocab], [3 if t in specials else 1 for t, _ in vocab], merges


@pytest.mark.parametrize("pre", ["qwen2", "llama-bpe"])
def test_byte_level_regex_pre_tokenizers(tmp_path, pre):
    from umakit.checkpoint.gguf.vocab import _REGEX_PRE

    trained, tokens, types, merges = byte_level_vocab(_REGEX_PRE[pre])
    path = write_tokenizer_gguf(tmp_path / "t.gguf", "qwen2", "gpt2", tokens, types, merges=merges, pre=pre,
                                bos=0, eos=2, add_bos_token=False)
    tok, files = ours(path, tmp_path)
    ref = transformers_tokenizer(path)
    assert files.warnings == []
    for text in TEXTS:
        ids = tok.encode(text).ids
        assert ids == ref(text, add_special_tokens=False).input_ids, text
        assert ids == trained.encode(text).ids, text
        assert tok.decode(ids, skip_special_tokens=False) == text == ref.decode(ids)


def test_unknown_pre_tokenizer_warns(tmp_path):
    trained, tokens, types, merges = byte_level_vocab(r"\s+|\S+")
    path = write_tokenizer_gguf(tmp_path / "t.gguf", "qwen2", "gpt2", tokens, types, merges=merges,
                                pre="some-new-model")
    _, files = ours(path, tmp_path)
    assert files.warnings == ["pre-tokenizer 'some-new-model' is not known; splitting text as GPT-2 does"]


def test_added_tokens_spelled_as_raw_utf8_or_in_the_byte_alphabet(tmp_path):
    """A byte-level vocabulary's added token stored as raw UTF-8 is spelled in the byte alphabet, as BPE needs
    (its id decodes to the text); a USER_DEFINED token in the alphabet becomes an added token, one id."""
    from umakit.checkpoint.gguf.vocab import _byte_alphabet

    _, tokens, types, merges = byte_level_vocab(r"\s+|\S+")
    tokens, types = [*tokens, "€uro", "<|tool|>"], [*types, 4, 4]
    path = write_tokenizer_gguf(tmp_path / "t.gguf", "qwen2", "gpt2", tokens, types, merges=merges, pre="qwen2")
    tok, _ = ours(path, tmp_path)
    spelled = "".join(_byte_alphabet()[b] for b in "€uro".encode())
    assert tok.token_to_id(spelled) == len(tokens) - 2 and tok.token_to_id("€uro") is None
    assert tok.decode([len(tokens) - 2]) == "€uro"
    assert tok.encode("a <|tool|> b").ids.count(len(tokens) - 1) == 1
