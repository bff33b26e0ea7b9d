"""Speculative decoding is lossless: greedy text equals plain decoding's, sampled text keeps the target's law."""

from __future__ import annotations

import json
import math
import shutil

import numpy as np
import pytest
from click.testing import CliRunner

import umakit
from support.markers import requires_default_model
from support.tiny import make_tiny_model
from umakit.errors import InvalidArgumentError
from umakit.generate.sampling import SamplingParams
from umakit.generate.speculative import distribution

# Repetitive text, so prompt lookup finds n-grams to copy; the tiny models continue it in their own way.
PROMPT = "The quick brown fox jumps over the lazy dog. The quick brown fox jumps over"
FAMILIES = {"torch": ["llama", "mistral", "qwen2", "qwen3"], "mlx": ["llama", "qwen3"]}
CASES = [(b, f) for b, fams in FAMILIES.items() for f in fams]


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """``pair(backend, family)`` -> (target, draft): two tiny models of one family, same tokenizer, other weights."""
    made = {}

    def get(backend: str, family: str):
        if (backend, family) not in made:
            root = tmp_path_factory.mktemp(f"spec-{family}")
            target = make_tiny_model(family, root / "target", seed=3)
            draft = _perturbed_copy(target, root / "draft", NOISE)
            # MLX pinned to its CPU kernels: a k-token verify equals k single steps exactly there, not on Metal.
            device = "cpu" if backend == "mlx" else None
            made[backend, family] = (umakit.load(target, backend=backend, dtype="float32", device=device),
                                     umakit.load(draft, backend=backend, dtype="float32", device=device))
        return made[backend, family]

    return get


NOISE = 0.6  # relative noise on the draft's MLPs: it then agrees with the target often, not always


def _perturbed_copy(src, dst, noise: float):
    """The target's checkpoint with noise on every MLP weight: a draft that is right often, but not always."""
    from safetensors.numpy import load_file, save_file

    shutil.copytree(src, dst)
    weights = load_file(dst / "model.safetensors")
    rng = np.random.default_rng(0)
    for name, w in weights.items():
        if ".mlp." in name:
            weights[name] = (w + noise * w.std() * rng.standard_normal(w.shape)).astype(w.dtype)
    save_file(weights, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


def _same(a, b):
    assert (a.text, a.tokens, a.finish_reason) == (b.text, b.tokens, b.finish_reason)


@pytest.mark.parametrize("backend,family", CASES)
def test_greedy_speculation_gives_plain_decoding_token_for_token(pair, backend, family):
    target, draft = pair(backend, family)
    for penalty in (1.0, 1.3):
        plain = target.generate(PROMPT, raw=True, max_tokens=48, temperature=0, repetition_penalty=penalty)
        for how in (dict(prompt_lookup=True), dict(prompt_lookup=True, ngram=1, draft_tokens=3), dict(draft=draft)):
            spec = target.generate(PROMPT, raw=True, max_tokens=48, temperature=0, repetition_penalty=penalty, **how)
            _same(spec, plain)
            s = spec.stats.speculative
            assert s.target_steps >= 1 and s.emitted >= len(spec.tokens)
            assert s.target_steps + s.accepted >= s.emitted  # each step adds one token of its own at most


def test_the_draft_exercises_both_accepting_and_rejecting(pair):
    target, draft = pair("torch", "llama")
    s = target.generate(PROMPT, raw=True, max_tokens=64, temperature=0, draft=draft).stats.speculative
    assert 0 < s.accepted < s.proposed  # otherwise the equality test above would prove little
    same = target.generate(PROMPT, raw=True, max_tokens=64, temperature=0, draft=target).stats.speculative
    assert same.accepted == same.proposed and same.tokens_per_step > 2  # a draft equal to the target: all kept


@pytest.mark.parametrize("backend", ["torch", "mlx"])
def test_stops_max_tokens_and_eos_inside_a_speculated_block(pair, backend, monkeypatch):
    target, draft = pair(backend, "llama")
    plain = target.generate(PROMPT, raw=True, max_tokens=40, temperature=0)
    for how in (dict(prompt_lookup=True), dict(draft=draft)):
        for n in (1, 2, 5, 13):
            _same(target.generate(PROMPT, raw=True, max_tokens=n, temperature=0, **how),
                  target.generate(PROMPT, raw=True, max_tokens=n, temperature=0))
        stop = plain.text[len(plain.text) // 2:][:3]
        _same(target.generate(PROMPT, raw=True, max_tokens=40, temperature=0, stop=[stop], **how),
              target.generate(PROMPT, raw=True, max_tokens=40, temperature=0, stop=[stop]))
    # A token from the middle of the reply becomes end-of-sequence: both runs end there, without it.
    eos = plain.tokens[len(plain.tokens) // 2]
    for m in (target, draft):
        monkeypatch.setattr(m.tokenizer, "eos_ids", m.tokenizer.eos_ids | {eos})
    want = target.generate(PROMPT, raw=True, max_tokens=40, temperature=0)
    assert want.finish_reason == "stop" and eos not in want.tokens
    for how in (dict(prompt_lookup=True), dict(draft=draft)):
        _same(target.generate(PROMPT, raw=True, max_tokens=40, temperature=0, **how), want)


@pytest.mark.parametrize("backend", ["torch", "mlx"])
def test_cache_after_rejections_holds_exactly_the_committed_text(pair, backend):
    target, draft = pair(backend, "llama")
    ids = target.encode(PROMPT, raw=True)
    decoder = target.speculator(draft=draft)
    cache = target.make_cache()
    tokens = decoder.generate_tokens(ids, cache, SamplingParams(temperature=0))
    got = [next(tokens) for _ in range(30)]
    tokens.close()
    assert decoder.stats.accepted < decoder.stats.proposed  # some drafts were rejected and trimmed
    committed = (ids + got)[:cache.offset]
    assert len(ids) + len(got) - 1 <= cache.offset  # nothing committed is missing
    fresh = target.make_cache()
    target.engine.prefill(committed, fresh)
    probe = [got[-1], 7, 11]
    np.testing.assert_allclose(target.engine.logits(probe, cache), target.engine.logits(probe, fresh),
                               atol=1e-4, rtol=1e-4)


def test_numpy_distribution_matches_the_engine_samplers(pair):
    import torch

    from umakit.backends.torch.sampler import make_sampler

    target, _ = pair("torch", "llama")
    logits = target.logits(target.encode(PROMPT, raw=True))[-1]
    recent = [5, 9, 9, 40]
    for p in (SamplingParams(temperature=0.7, top_k=20, repetition_penalty=1.2),
              SamplingParams(temperature=1.0, top_p=0.8, min_p=0.05), SamplingParams(temperature=0)):
        probs = distribution.probabilities(logits, recent, p)
        assert probs.sum() == pytest.approx(1.0)
        sampler = make_sampler(p)
        g = torch.Generator().manual_seed(0)
        drawn = [int(sampler(torch.tensor(logits)[None], torch.tensor(recent)[None], g)) for _ in range(300)]
        assert all(probs[t] > 0 for t in drawn)  # never outside the support
        if p.greedy:
            assert set(drawn) == {int(np.argmax(probs))}


# -- sampling: the output law is the target's ----------------------------------------------------------
def _chi2_pvalue(observed: np.ndarray, expected: np.ndarray) -> float:
    """Pearson's test, cells with small expectation merged; Wilson-Hilferty's approximation of the tail."""
    order = np.argsort(expected)
    obs, exp, bins = [], [], [0.0, 0.0]
    for i in order:  # merge from the smallest until each cell expects at least 5
        bins[0] += observed[i]
        bins[1] += expected[i]
        if bins[1] >= 5:
            obs.append(bins[0])
            exp.append(bins[1])
            bins = [0.0, 0.0]
    if bins[1]:
        obs[-1] += bins[0]
        exp[-1] += bins[1]
    obs, exp = np.array(obs), np.array(exp)
    x, k = float(((obs - exp) ** 2 / exp).sum()), len(exp) - 1
    z = ((x / k) ** (1 / 3) - (1 - 2 / (9 * k))) / math.sqrt(2 / (9 * k))
    return 0.5 * math.erfc(z / math.sqrt(2))


SAMPLING = SamplingParams(temperature=1.0, top_k=6)
SAMPLES = 1500


def _pairs(target, decoder, ids, n, seed0=0):
    counts: dict[tuple[int, int], int] = {}
    for i in range(n):
        stream = decoder.generate_tokens(ids, target.make_cache(), SAMPLING, seed=seed0 + i)
        key = (next(stream), next(stream))
        stream.close()
        counts[key] = counts.get(key, 0) + 1
    return counts


def _law(target, ids):
    """The exact law of the first two sampled tokens: p(a) p(b | a)."""
    first = distribution.probabilities(target.logits(ids)[-1], ids[-64:], SAMPLING)
    law = {}
    for a in np.flatnonzero(first):
        second = distribution.probabilities(target.logits(ids + [int(a)])[-1], (ids + [int(a)])[-64:], SAMPLING)
        for b in np.flatnonzero(second):
            law[int(a), int(b)] = first[a] * second[b]
    return law


def _pvalue(counts, law, n):
    keys = sorted(set(law) | set(counts))
    observed = np.array([counts.get(k, 0) for k in keys], dtype=float)
    expected = np.array([law.get(k, 1e-12) * n for k in keys])
    return _chi2_pvalue(observed, expected)


@pytest.mark.parametrize("method", ["prompt_lookup", "draft"])
def test_sampled_pairs_follow_the_target_distribution(pair, method):
    target, draft = pair("torch", "llama")
    ids = target.encode("fox fox fox fox", raw=True)
    how = dict(prompt_lookup=True, ngram=1) if method == "prompt_lookup" else dict(draft=draft)
    decoder = target.speculator(**how)
    law = _law(target, ids)
    counts = _pairs(target, decoder, ids, SAMPLES)
    assert decoder.stats.proposed > 0
    assert _pvalue(counts, law, SAMPLES) > 1e-3
    # The control: drawing straight from the draft (no verification) must be caught by the same test.
    if method == "draft":
        wrong = {}
        for i in range(SAMPLES):
            stream = draft.engine.generate_tokens(ids, draft.make_cache(), SAMPLING, seed=i)
            key = (next(stream), next(stream))
            stream.close()
            wrong[key] = wrong.get(key, 0) + 1
        assert _pvalue(wrong, law, SAMPLES) < 1e-6


# -- errors ---------------------------------------------------------------------------------------------
def test_bad_settings_are_refused_before_any_work(pair, tmp_path):
    target, draft = pair("torch", "llama")
    for how, match in ((dict(draft_tokens=0, prompt_lookup=True), "draft_tokens must be an integer from 1 to 16"),
                       (dict(draft_tokens=17, draft=draft), "from 1 to 16"),
                       (dict(ngram=0, prompt_lookup=True), "ngram must be"),
                       (dict(draft=draft, prompt_lookup=True), "not both"),
                       (dict(draft_tokens=4), "need --draft MODEL or --prompt-lookup"),
                       (dict(draft=draft, ngram=2), "--ngram applies to --prompt-lookup")):
        with pytest.raises(InvalidArgumentError, match=match):
            target.generate(PROMPT, raw=True, max_tokens=4, **how)


def test_a_draft_with_another_tokenizer_or_larger_is_refused(pair, tmp_path):
    target, draft = pair("torch", "llama")
    other = tmp_path / "other"
    shutil.copytree(draft.info.path, other)
    tok = json.loads((other / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    a, b = sorted(vocab, key=vocab.get)[100:102]
    vocab[a], vocab[b] = vocab[b], vocab[a]
    (other / "tokenizer.json").write_text(json.dumps(tok))
    with pytest.raises(InvalidArgumentError, match="tokenizer differs from the target's: token"):
        target.generate(PROMPT, raw=True, max_tokens=4, draft=umakit.load(other, backend="torch"))
    big = umakit.load(make_tiny_model("llama", tmp_path / "big", num_hidden_layers=4), backend="torch")
    with pytest.raises(InvalidArgumentError, match="larger than the target"):
        target.generate(PROMPT, raw=True, max_tokens=4, draft=big)


def test_a_sliding_window_cache_is_refused_clearly(tmp_path):
    gemma = umakit.load(make_tiny_model("gemma3", tmp_path / "g"), backend="mlx")
    with pytest.raises(InvalidArgumentError, match="cache that can be rewound"):
        gemma.generate(PROMPT, raw=True, max_tokens=4, prompt_lookup=True)


def test_cli_prompt_lookup_prints_the_same_text_and_its_figures(tiny_dir):
    from umakit.cli.main import main

    args = ["generate", "-m", str(tiny_dir("llama")), "-p", PROMPT, "--raw", "--temp", "0", "--max-tokens", "24",
            "--json"]
    plain = json.loads(CliRunner().invoke(main, args).output)
    r = CliRunner().invoke(main, [*args, "--prompt-lookup", "--draft-tokens", "6"])
    spec = json.loads(r.output)
    assert spec["text"] == plain["text"] and spec["tokens"] == plain["tokens"]
    s = spec["stats"]["speculative"]
    assert s["method"] == "prompt_lookup" and s["max_draft_tokens"] == 6 and s["target_steps"] >= 1
    assert "speculative" not in plain["stats"]
    bad = CliRunner().invoke(main, [*args, "--draft-tokens", "0", "--prompt-lookup"])
    assert bad.exit_code == 2 and "Traceback" not in bad.output


def test_bench_speculative_reports_plain_and_speculative_in_one_record(tiny_dir, tmp_path):
    from umakit.bench import load_record
    from umakit.cli.main import main

    out = tmp_path / "spec.json"
    r = CliRunner().invoke(main, ["bench", str(tiny_dir("llama")), "--speculative", "--gen-tokens", "12", "--repeat",
                                  "2", "--warmup", "0", "--json", str(out), "--peak-bandwidth", "50"])
    assert r.exit_code == 0, r.output
    assert "speculative decoding (prompt lookup" in r.output and "| speculative |" in r.output
    record = load_record(out)
    s = record["speculative"]
    assert len(record["runs"]) == len(s["runs"]) == 2 and s["same_tokens"] is True
    assert s["speedup"] == pytest.approx(s["summary"]["decode_tps"]["median"] /
                                         record["summary"]["decode_tps"]["median"])
    assert s["target_steps"] >= 1 and 0 <= s["acceptance_rate"] <= 1
    bad = CliRunner().invoke(main, ["bench", "--synthetic", "smollm2-135m", "--speculative"])
    assert bad.exit_code == 2 and "tokenizer" in bad.output
    bad = CliRunner().invoke(main, ["bench", "/nonexistent", "--speculative", "--batch", "2"])
    assert bad.exit_code == 1 and "one sequence" in bad.output  # refused before the (missing) model is looked up


@requires_default_model
@pytest.mark.slow
def test_default_model_speculates_losslessly():
    model = umakit.load(backend="torch", dtype="float32")
    prompt = ("Copy this sentence exactly: It is a truth universally acknowledged, that a single man in "
              "possession of a good fortune, must be in want of a wife.")
    plain = model.generate(prompt, max_tokens=40, temperature=0)
    for how in (dict(prompt_lookup=True), dict(draft=model, draft_tokens=3)):
        spec = model.generate(prompt, max_tokens=40, temperature=0, **how)
        _same(spec, plain)
        assert spec.stats.speculative.accepted > 0
