"""Perplexity: sliding windows against a direct numpy computation, and through the KV cache."""

import math

import numpy as np
import pytest
from click.testing import CliRunner

import umakit
from umakit.errors import InvalidArgumentError
from umakit.evaluate.perplexity import kv_perplexity, nll_sum, perplexity, windows

TOKENS = [int(t) for t in np.random.RandomState(0).randint(5, 512, 300)]


def log_softmax(x):
    x = x.astype(np.float64)
    return x - x.max(-1, keepdims=True) - np.log(np.exp(x - x.max(-1, keepdims=True)).sum(-1, keepdims=True))


@pytest.fixture(scope="module")
def wide_model(tmp_path_factory):
    """A tiny llama with head_dim 64, so that mlx-lm's 64-wide KV groups fit."""
    import torch
    import transformers
    from support.tiny import COMMON, write_tokenizer

    path = tmp_path_factory.mktemp("wide")
    config = transformers.LlamaConfig(**{**COMMON, "hidden_size": 128, "num_attention_heads": 2,
                                         "num_key_value_heads": 1, "tie_word_embeddings": False})
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(path)
    write_tokenizer(path)
    return umakit.load(path, backend="mlx")


def test_windows_non_overlapping():
    assert windows(10, 4, 4) == [(0, 4, 1), (4, 8, 5), (8, 10, 9)]
    assert windows(3, 8, 8) == [(0, 3, 1)]


def test_windows_sliding_score_every_token_once():
    assert windows(10, 4, 2) == [(0, 4, 1), (2, 6, 4), (4, 8, 6), (6, 10, 8)]
    for n, window, stride in [(300, 64, 16), (257, 100, 37), (50, 50, 1)]:
        scored = [i for _, end, first in windows(n, window, stride) for i in range(first, end)]
        assert scored == list(range(1, n))
        for begin, end, first in windows(n, window, stride):
            assert end - begin <= window and (begin == 0 or first - begin >= window - stride)


def test_window_errors():
    with pytest.raises(InvalidArgumentError, match="stride must be between 1 and the window"):
        windows(10, 4, 5)
    with pytest.raises(InvalidArgumentError, match="window must be at least 2"):
        windows(10, 1, 1)


def test_nll_sum_is_cross_entropy():
    logits = np.random.RandomState(1).randn(7, 50).astype(np.float32) * 5
    targets = [3, 0, 49, 7, 7, 20, 1]
    assert nll_sum(logits, targets) == pytest.approx(-log_softmax(logits)[np.arange(7), targets].sum(), rel=1e-6)


def test_one_window_equals_numpy(tiny_model):
    r = perplexity(tiny_model, TOKENS, window=512)
    lp = log_softmax(tiny_model.logits(TOKENS))  # (T, V)
    nll = -lp[np.arange(len(TOKENS) - 1), TOKENS[1:]].mean()
    assert r.tokens == len(TOKENS) - 1
    assert r.nll == pytest.approx(nll, rel=1e-5)
    assert r.ppl == pytest.approx(math.exp(nll), rel=1e-5)


@pytest.mark.parametrize("window, stride", [(64, 64), (64, 16), (100, 37)])
def test_sliding_windows_equal_numpy(tiny_model, window, stride):
    total, count = 0.0, 0
    prev_end = 0
    for begin in range(0, len(TOKENS), stride):  # Hugging Face's perplexity guide, written out
        end = min(begin + window, len(TOKENS))
        lp = log_softmax(tiny_model.logits(TOKENS[begin:end]))
        for i in range(max(prev_end, begin + 1), end):
            total -= lp[i - begin - 1, TOKENS[i]]
            count += 1
        prev_end = end
        if end == len(TOKENS):
            break
    r = perplexity(tiny_model, TOKENS, window=window, stride=stride)
    assert (r.tokens, r.window, r.stride) == (count, window, stride)
    assert r.nll == pytest.approx(total / count, rel=1e-5)


def test_shorter_context_costs_perplexity_on_real_text(tiny_model):
    # The tiny model is random, but context still matters: windows of 2 tokens see less.
    full = perplexity(tiny_model, TOKENS, window=300)
    short = perplexity(tiny_model, TOKENS, window=2, stride=1)
    assert full.tokens == short.tokens and full.nll != pytest.approx(short.nll, rel=1e-4)


def test_text_is_tokenized_and_truncated(tiny_model):
    text = "The quick brown fox jumps over the lazy dog. " * 20
    ids = tiny_model.tokenizer.encode(text)
    r = perplexity(tiny_model, text, max_tokens=50)
    assert r.tokens == 49 and r.nll == pytest.approx(perplexity(tiny_model, ids[:50]).nll, rel=1e-6)


def test_errors(tiny_model):
    with pytest.raises(InvalidArgumentError, match="perplexity needs at least 2"):
        perplexity(tiny_model, [5])
    with pytest.raises(InvalidArgumentError, match="exceeds the model's context of 512"):
        perplexity(tiny_model, TOKENS, window=1024, stride=512)
    with pytest.raises(InvalidArgumentError, match="exceed the model's context of 512"):
        kv_perplexity(tiny_model, TOKENS * 2)


def test_float_cache_equals_one_window(tiny_model):
    one = perplexity(tiny_model, TOKENS, window=512)
    for chunk in (1 + 63, 256, 7):
        r = kv_perplexity(tiny_model, TOKENS, chunk=chunk)
        assert r.tokens == one.tokens and r.nll == pytest.approx(one.nll, rel=1e-5), chunk
        assert r.cache_tokens == len(TOKENS)


def test_quantized_cache_changes_scores_and_bytes(wide_model):
    tokens = TOKENS[:256]  # a whole number of mlx-lm's 256-token cache steps: bytes per token are exact
    results = {bits: kv_perplexity(wide_model, tokens, kv_bits=bits, chunk=64) for bits in (None, 8, 4)}
    # 2 layers x K and V x 1 head x 64 dims per token: float32 4 bytes; n bits plus a float32
    # scale and bias per 64 values.
    elems = 2 * 2 * 1 * 64
    assert results[None].cache_bytes_per_token == elems * 4
    assert results[8].cache_bytes_per_token == elems * (1 + 8 / 64)
    assert results[4].cache_bytes_per_token == elems * (0.5 + 8 / 64)
    for bits, r in results.items():  # the measured cache agrees with the engine's prediction
        assert r.cache_bytes_per_token == wide_model.engine.kv_bytes_per_token(bits)
    d8 = abs(results[8].nll - results[None].nll)
    d4 = abs(results[4].nll - results[None].nll)
    assert 0 < d8 < d4 < 0.05  # 4-bit keys and values move the scores more than 8-bit ones
    # the cache quantizes each token's vectors on their own: chunking does not change the result
    assert kv_perplexity(wide_model, tokens, kv_bits=4, chunk=17).nll == pytest.approx(results[4].nll, rel=1e-4)


def test_cli_eval(tiny_dir, tmp_path):
    import json

    from umakit.cli.eval_cmd import eval_cmd

    text = tmp_path / "t.txt"
    text.write_text("The quick brown fox jumps over the lazy dog. Paris is the capital of France. " * 10)
    args = [str(tiny_dir("llama")), "--text", str(text), "--window", "32", "--stride", "16", "--backend", "mlx"]
    result = CliRunner().invoke(eval_cmd, args + ["--json"])
    assert result.exit_code == 0, result.output
    out = json.loads(result.output)
    model = umakit.load(tiny_dir("llama"), backend="mlx")
    expected = perplexity(model, text.read_text(), window=32, stride=16)
    assert out["tokens"] == expected.tokens and out["ppl"] == pytest.approx(expected.ppl, rel=1e-6)
    result = CliRunner().invoke(eval_cmd, args + ["--kv-bits", "float", "--max-tokens", "64"])
    assert result.exit_code == 0 and "perplexity " in result.output and "on 63 tokens" in result.output
    from umakit.evaluate.corpora import corpus_path

    corpus_path("austen").parent.mkdir(parents=True, exist_ok=True)
    corpus_path("austen").write_text(text.read_text())
    result = CliRunner().invoke(eval_cmd, [str(tiny_dir("llama")), "--corpus", "austen", "--max-tokens", "40"])
    assert result.exit_code == 0 and "on 39 tokens of austen; windows of 512, stride 512" in result.output
    result = CliRunner().invoke(eval_cmd, [str(tiny_dir("llama"))])
    assert result.exit_code == 2 and "give exactly one of --text FILE or --corpus NAME" in result.output


def test_cli_eval_kv_bits_with_auto_picks_an_engine_that_has_a_quantized_cache(wide_model, tmp_path):
    import json

    from umakit.cli.eval_cmd import eval_cmd

    text = tmp_path / "t.txt"
    text.write_text("The quick brown fox jumps over the lazy dog. Paris is the capital of France. " * 10)
    result = CliRunner().invoke(eval_cmd, [str(wide_model.info.path), "--text", str(text), "--kv-bits", "8",
                                           "--max-tokens", "64", "--json"])  # --backend auto, the default
    assert result.exit_code == 0, result.output
    out = json.loads(result.stdout)  # stderr may carry the banner naming the engine auto picked
    picked = umakit.load(wide_model.info.path, needs=frozenset({"kv_bits"}))  # as the command loads it
    expected = kv_perplexity(picked, text.read_text(), kv_bits=8, max_tokens=64)
    assert out["kv_bits"] == "8" and out["tokens"] == expected.tokens == 63
    assert out["nll"] == pytest.approx(expected.nll, rel=1e-6)
    assert out["cache_bytes_per_token"] == pytest.approx(expected.cache_bytes_per_token)


@pytest.fixture(scope="module")
def bos_model(tiny_dir, tmp_path_factory):
    """The tiny llama with a tokenizer that adds a BOS, as Gemma's and Llama's do."""
    import json
    import shutil

    path = tmp_path_factory.mktemp("bos") / "m"
    shutil.copytree(tiny_dir("llama"), path)
    config = json.loads((path / "tokenizer_config.json").read_text())
    (path / "tokenizer_config.json").write_text(json.dumps({**config, "add_bos_token": True}))
    return umakit.load(path, backend="mlx")


def _windowed_nll(model, ids, window, stride, prefix):
    """Mean NLL of ``ids`` scored window by window, each window fed as prefix + its tokens."""
    total, count, scored = 0.0, 0, set()
    for begin in range(0, len(ids), stride):
        chunk = ids[begin:begin + window - len(prefix)]
        logp = log_softmax(np.asarray(model.engine.logits(prefix + chunk)))  # (len(prefix) + len(chunk), V)
        for j, t in enumerate(chunk):
            pos = begin + j
            if pos in scored or (not prefix and j == 0):
                continue
            total -= logp[len(prefix) + j - 1, t]
            count += 1
            scored.add(pos)
        if begin + len(chunk) >= len(ids):
            break
    return total / count, count


@pytest.mark.parametrize("window, stride", [(32, 31), (32, 16)])
def test_bos_starts_every_window_when_the_tokenizer_adds_one(bos_model, window, stride):
    text = "The quick brown fox jumps over the lazy dog. Paris is the capital of France. " * 6
    tok = bos_model.tokenizer
    bos = tok.bos_id
    content = tok.encode(text, add_special_tokens=False)
    assert tok.encode(text)[0] == bos and content[0] != bos
    r = perplexity(bos_model, text, window=window, stride=stride)
    nll, count = _windowed_nll(bos_model, content, window, stride, [bos])
    assert r.bos_per_window and r.tokens == count == len(content)  # the BOS lets each window score its first token
    assert r.nll == pytest.approx(nll, rel=1e-5)
    # token ids with their BOS give the same score
    assert perplexity(bos_model, tok.encode(text), window=window, stride=stride).nll == pytest.approx(r.nll, rel=1e-6)
    # turned off: the BOS only where encoding put it, before the first window
    off = perplexity(bos_model, text, window=window, stride=stride, bos_per_window=False)
    old_nll, old_count = _windowed_nll(bos_model, tok.encode(text), window, stride, [])
    assert not off.bos_per_window and off.tokens == old_count and off.nll == pytest.approx(old_nll, rel=1e-5)
    assert abs(off.nll - r.nll) > 1e-4  # a random model barely cares, but the scores differ


def test_no_bos_per_window_without_a_bos_tokenizer(tiny_model):
    assert tiny_model.tokenizer.add_bos is False
    r = perplexity(tiny_model, TOKENS, window=64)
    assert not r.bos_per_window and r.nll == perplexity(tiny_model, TOKENS, window=64, bos_per_window=False).nll


def test_cli_eval_says_whether_each_window_had_a_bos(bos_model, tmp_path):
    import json

    from umakit.cli.eval_cmd import eval_cmd

    text = tmp_path / "t.txt"
    text.write_text("The quick brown fox jumps over the lazy dog. Paris is the capital of France. " * 6)
    args = [str(bos_model.info.path), "--text", str(text), "--window", "32", "--backend", "mlx"]
    on = json.loads(CliRunner().invoke(eval_cmd, args + ["--json"]).output)
    off = json.loads(CliRunner().invoke(eval_cmd, args + ["--json", "--no-bos-per-window"]).output)
    assert on["bos_per_window"] is True and off["bos_per_window"] is False
    assert on["ppl"] == pytest.approx(perplexity(bos_model, text.read_text(), window=32).ppl, rel=1e-6)
    assert abs(on["ppl"] - off["ppl"]) > 1e-4
    result = CliRunner().invoke(eval_cmd, args)
    assert result.exit_code == 0 and "BOS per window" in result.output
