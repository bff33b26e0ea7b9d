"""Every registered engine, on every device available here, implements the whole declared protocol.

An engine is registered only if it passes this file: generation, prefill plus
cached decode against a full forward pass, trimming, the batch decoder,
weight accounting, synthetic construction and the declared features. Callers
(model, batch, bench, quantize, the server to come) rely on nothing else.
"""

from __future__ import annotations

import inspect
import typing

import numpy as np
import pytest

from umakit import backends
from umakit import checkpoint
from umakit.backends import base
from umakit.errors import InvalidArgumentError
from umakit.generate.sampling import SamplingParams
from support.tiny import make_tiny_model

GREEDY = SamplingParams(temperature=0)
PROMPT = [5, 17, 42, 99, 3, 250, 7, 64, 11]


def _available():
    out = []
    for name, spec in backends.ENGINES.items():
        for device in spec.devices:
            try:
                backends.engine_class(name)
                backends.resolve(name, device)
            except Exception:  # not installed here, or no such device on this machine
                continue
            if device in ("cuda", "metal") and not _device_present(name, device):
                continue
            out.append((name, device))
    return out


def _device_present(name: str, device: str) -> bool:
    if device == "cuda":
        import torch

        return torch.cuda.is_available()
    import mlx.core as mx

    return mx.metal.is_available()


CASES = _available()


@pytest.fixture(scope="module", params=CASES, ids=[f"{n}-{d}" for n, d in CASES])
def engine(request, tiny_dir):
    name, device = request.param
    ckpt = checkpoint.open_checkpoint(tiny_dir("llama"))
    return backends.engine_class(name).from_checkpoint(ckpt, device=device, dtype="float32")


def test_both_engines_are_tested_here():
    assert {n for n, _ in CASES} == set(backends.ENGINES)


def test_engine_declares_every_protocol_member(engine):
    assert isinstance(engine, base.Engine)
    members = set(typing.get_type_hints(base.Engine)) | {
        n for n, v in vars(base.Engine).items() if callable(v) or isinstance(v, classmethod)
    }
    for member in sorted(m for m in members if not m.startswith("_")):
        assert hasattr(engine, member), f"{engine.name} lacks {member}"
    assert engine.spec is backends.ENGINES[engine.name]
    assert engine.name == engine.spec.name and engine.features == engine.spec.features
    assert engine.features <= set(base.FEATURES)
    assert engine.device in engine.spec.devices
    assert isinstance(engine.config, dict) and isinstance(engine.load_notes, tuple)
    assert engine.offload is None and engine.quantization is None  # a float checkpoint, all resident


def test_constructors_take_the_declared_keywords(engine):
    declared = inspect.signature(base.Engine.from_checkpoint).parameters
    actual = inspect.signature(type(engine).from_checkpoint).parameters
    assert list(actual) == list(declared)
    declared = inspect.signature(base.Engine.synthetic).parameters
    assert list(inspect.signature(type(engine).synthetic).parameters) == list(declared)


def test_generate_is_deterministic_when_greedy(engine):
    def run():
        tokens = engine.generate_tokens(PROMPT, engine.make_cache(), GREEDY, seed=0)
        out = [next(tokens) for _ in range(6)]
        tokens.close()
        return out

    first = run()
    assert first == run()
    assert all(isinstance(t, int) and 0 <= t < engine.config["vocab_size"] for t in first)


def test_prefill_then_cached_logits_equal_a_full_forward(engine):
    full = engine.logits(PROMPT)  # (T, V)
    cache = engine.make_cache()
    assert isinstance(cache, base.KVCache) and cache.offset == 0 and cache.kv_bits is None
    engine.prefill(PROMPT[:-3], cache)
    assert cache.offset == len(PROMPT) - 3 and cache.nbytes > 0
    tail = engine.logits(PROMPT[-3:], cache)
    assert tail.shape == (3, full.shape[1]) and tail.dtype == np.float32
    np.testing.assert_allclose(tail, full[-3:], atol=1e-4 * np.abs(full).max(), rtol=0)


def test_greedy_token_is_the_argmax_of_the_logits(engine):
    tokens = engine.generate_tokens(PROMPT, engine.make_cache(), GREEDY)
    first = next(tokens)
    tokens.close()
    assert first == int(np.argmax(engine.logits(PROMPT)[-1]))


def test_trim_forgets_tokens_so_decoding_resumes_as_before(engine):
    cache = engine.make_cache()
    engine.prefill(PROMPT, cache)
    assert cache.trim(4) == 4 and cache.offset == len(PROMPT) - 4
    again = engine.logits(PROMPT[-4:], cache)
    np.testing.assert_allclose(again, engine.logits(PROMPT)[-4:], atol=1e-4, rtol=1e-4)


def test_a_mark_rewinds_the_cache_as_trimming_does(engine):
    """`KVCache.mark` and `rewind`: back to a length the cache had, whatever its layers keep (the chat's way back
    to its last prompt where trimming cannot go)."""
    cache = engine.make_cache()
    engine.prefill(PROMPT[:-4], cache)
    mark = cache.mark()
    engine.prefill(PROMPT[-4:], cache)
    assert cache.rewind(mark) == 4 and cache.offset == len(PROMPT) - 4
    for _ in range(2):  # a mark serves more than one rewind
        again = engine.logits(PROMPT[-4:], cache)
        np.testing.assert_allclose(again, engine.logits(PROMPT)[-4:], atol=1e-4, rtol=1e-4)
        cache.rewind(mark)


def test_a_copy_holds_the_prefix_and_both_go_on_alone(engine, kv_bits=None):
    """`copy(n)` (a shared prompt prefix handed to another request): the copy continues as a cache prefilled with
    those n tokens does, and the original, extended after it, is untouched by the copy's own tokens.
    (Quantized caches: tests/engines/test_torch_kv_bits.py, on a model wide enough for them.)"""
    cache = engine.make_cache(kv_bits)
    engine.prefill(PROMPT, cache)
    copied = cache.copy(4)
    assert copied.offset == 4 and cache.offset == len(PROMPT) and copied.kv_bits == kv_bits
    fresh = engine.make_cache(kv_bits)
    engine.prefill(PROMPT[:4], fresh)
    np.testing.assert_allclose(engine.logits([21, 22, 23], copied), engine.logits([21, 22, 23], fresh),
                               atol=1e-4, rtol=1e-4)
    again = engine.make_cache(kv_bits)
    engine.prefill(PROMPT, again)
    np.testing.assert_allclose(engine.logits([5, 6], cache), engine.logits([5, 6], again), atol=1e-4, rtol=1e-4)


def test_batch_decoder_rows_equal_single_runs(engine):
    if base.BATCH not in engine.features:
        with pytest.raises(Exception):
            engine.batch_decoder()
        return
    decoder = engine.batch_decoder()
    assert isinstance(decoder, base.BatchDecoder)
    prompts = [PROMPT, PROMPT[:4], [9, 8, 7, 6, 5, 4, 3]]
    decoder.add([base.BatchRow(i, p, GREEDY) for i, p in enumerate(prompts)])
    assert decoder.size == 3 and decoder.kv_budget_bytes() > 0
    got: dict[int, list[int]] = {i: [] for i in range(3)}
    for _ in range(12):
        for row, token in decoder.step():
            got[row].append(token)
    assert decoder.context_tokens() >= len(PROMPT)
    decoder.remove([0, 1, 2])
    assert decoder.size == 0
    for i, p in enumerate(prompts):
        tokens = engine.generate_tokens(p, engine.make_cache(), GREEDY)
        want = [next(tokens) for _ in range(5)]
        tokens.close()
        assert got[i][:5] == want


def test_weight_info_adds_up(engine):
    w = engine.weight_info()
    assert isinstance(w, base.WeightInfo)
    assert w.total_bytes == sum(w.by_category.values()) > 0
    assert {"embedding", "attention", "mlp", "norms"} <= set(w.by_category)
    assert 0 < w.bytes_per_token <= w.total_bytes
    assert w.kv_bytes_per_token == engine.kv_bytes_per_token()
    cfg = engine.config
    assert w.params == pytest.approx(_params(cfg), rel=0.001)
    assert w.quantization == "none" and w.streamed_bytes_per_token == 0


def _params(c: dict) -> int:
    h, i, layers, v = c["hidden_size"], c["intermediate_size"], c["num_hidden_layers"], c["vocab_size"]
    d = h // c["num_attention_heads"]
    attn = h * h * 2 + 2 * h * c["num_key_value_heads"] * d
    per_layer = attn + 3 * h * i + 2 * h
    return layers * per_layer + v * h * (1 if c.get("tie_word_embeddings") else 2) + h


def test_kv_bits_feature_is_declared_honestly(engine, tmp_path):
    if base.QUANTIZED_KV in engine.features:
        # A quantized cache needs heads of a multiple of 64 (the KV group size).
        wide = make_tiny_model("llama", tmp_path, hidden_size=128, num_attention_heads=2, num_key_value_heads=1)
        other = type(engine).from_checkpoint(checkpoint.open_checkpoint(wide), device=engine.device, dtype="float32")
        cache = other.make_cache(kv_bits=8)
        assert cache.kv_bits == 8
        other.prefill(PROMPT, cache)
        assert cache.offset == len(PROMPT)
        assert other.kv_bytes_per_token(8) < other.kv_bytes_per_token()
    else:
        with pytest.raises(InvalidArgumentError):
            engine.make_cache(kv_bits=8)


def test_export_feature_is_declared_honestly(engine):
    if base.EXPORT in engine.features:
        weights = engine.export_weights()
        assert set(weights) >= {"model.embed_tokens.weight", "model.norm.weight"}
        assert sum(int(np.prod(a.shape)) for a in weights.values()) == engine.weight_info().params
    else:
        with pytest.raises(InvalidArgumentError):
            engine.export_weights()


def test_options_of_missing_features_are_refused(engine, tiny_dir):
    ckpt = checkpoint.open_checkpoint(tiny_dir("llama"))
    cls = type(engine)
    if base.QUANTIZE not in engine.features:
        with pytest.raises(InvalidArgumentError, match="quantize"):
            cls.from_checkpoint(ckpt, device=engine.device, quantize=4)
    if base.OFFLOAD not in engine.features:
        with pytest.raises(InvalidArgumentError, match="gpu-layers"):
            cls.from_checkpoint(ckpt, device=engine.device, gpu_layers=1)


def test_lookup_feature_is_declared_honestly(engine):
    """Without ``batch_lookup`` a lookup is refused; with it, a decoder speculates with its greedy rows' tokens
    unchanged, or refuses saying why where this load cannot (the torch engine without its fused CPU step)."""
    lookup = base.Lookup(ngram=1, tokens=4)
    if base.LOOKUP not in engine.features:
        with pytest.raises(InvalidArgumentError, match="--prompt-lookup"):
            engine.batch_decoder(lookup=lookup)
        return
    try:
        decoder = engine.batch_decoder(lookup=lookup)
    except InvalidArgumentError as e:
        assert "--prompt-lookup" in str(e)
        return
    prompt = PROMPT * 3
    decoder.add([base.BatchRow(0, prompt, GREEDY)])
    got = []
    while len(got) < 12:
        got += [token for _, token in decoder.step()]
    tokens = engine.generate_tokens(prompt, engine.make_cache(), GREEDY)
    assert got[:12] == [next(tokens) for _ in range(12)]
    tokens.close()


def test_deterministic_feature_is_declared_honestly(engine, tiny_dir):
    """Without ``deterministic`` the mode is refused by name; with it, an engine that cannot hold this load to
    it (the torch engine off its fused CPU step: float32 layers, CUDA) says why, and one that can gives a prompt
    split in two passes the bits of one (tests/engines/test_deterministic.py has the rest)."""
    fresh = type(engine).from_checkpoint(checkpoint.open_checkpoint(tiny_dir("llama")), device=engine.device,
                                         dtype="float32")  # the module's engine stays as it is
    try:
        fresh.make_deterministic()
    except InvalidArgumentError as e:
        assert "--deterministic" in str(e)
        return
    assert base.DETERMINISTIC in engine.features
    whole, split = fresh.make_cache(), fresh.make_cache()
    fresh.prefill(PROMPT[:-1], whole)
    fresh.prefill(PROMPT[:3], split)
    fresh.prefill(PROMPT[3:-1], split)
    assert np.array_equal(fresh.logits(PROMPT[-1:], whole), fresh.logits(PROMPT[-1:], split))


@pytest.mark.parametrize("bits", [None, 4])
def test_synthetic_engine_runs_the_protocol(engine, tiny_dir, bits):
    config = checkpoint.open_checkpoint(tiny_dir("llama")).config
    synth = type(engine).synthetic(config, device=engine.device, dtype="float32", bits=bits, group_size=32)
    assert synth.name == engine.name and synth.load_notes == ()
    w = synth.weight_info()
    assert w.params == engine.weight_info().params
    if bits:
        assert synth.quantization["bits"] == 4 and w.total_bytes < engine.weight_info().total_bytes
    tokens = synth.generate_tokens(PROMPT, synth.make_cache(), GREEDY)
    assert isinstance(next(tokens), int)
    tokens.close()


def test_peak_memory_and_wiring(engine):
    engine.reset_peak_memory()
    engine.logits(PROMPT)
    assert engine.peak_memory() > 0
    with engine.wired():
        assert engine.logits(PROMPT[:2]).shape[0] == 2


# -- the batch decoder's prompt-cache, export and log-probability protocol ---------------------------------------


def _batch(engine):
    if base.BATCH not in engine.features:
        pytest.skip(f"{engine.name} has no batch decoder")
    return engine.batch_decoder()


def _decode(decoder, want: dict[int, int]) -> dict[int, list[int]]:
    """Step ``decoder`` until each row id in ``want`` has returned that many tokens."""
    got: dict[int, list[int]] = {i: [] for i in want}
    for _ in range(4 * max(want.values()) + 4):
        for row, token in decoder.step():
            if row in got:
                got[row].append(token)
        if all(len(got[i]) >= n for i, n in want.items()):
            return {i: got[i][:n] for i, n in want.items()}
    raise AssertionError(f"rows returned too few tokens: {got}")


def _prefilled(engine, tokens):
    cache = engine.make_cache()
    engine.prefill(tokens, cache)
    return cache


def _close(a: np.ndarray, b: np.ndarray) -> None:
    np.testing.assert_allclose(a, b, atol=1e-4 * max(np.abs(b).max(), 1.0), rtol=0)


@pytest.mark.parametrize("mixed", [None, False, True])
def test_a_steps_prompt_slice_lands_in_its_cache_as_a_prefill(engine, mixed):
    """`BatchDecoder.step(prefill=...)`: the rows decode on as without it, the slice's cache continues as one
    `Engine.prefill` filled, and joins as one; ``mixed=True`` only with the ``mixed_steps`` feature."""
    if mixed and base.MIXED not in engine.features:
        with pytest.raises(InvalidArgumentError, match="--mixed-steps"):
            engine.batch_decoder(mixed=True)
        return
    plain = _batch(engine)
    plain.add([base.BatchRow(0, PROMPT, GREEDY)])
    want = _decode(plain, {0: 8})[0]
    decoder = engine.batch_decoder(mixed=mixed)
    assert decoder.mixes is bool(mixed) or mixed is None and isinstance(decoder.mixes, bool)
    decoder.add([base.BatchRow(0, PROMPT, GREEDY)])
    other = [9, 8, 7, 6, 5, 4, 3, 2, 1, 0, 12, 13]
    cache, got = engine.make_cache(), []
    for lo, hi in ((0, 5), (5, 6), (6, len(other) - 1)):
        got += [t for _, t in decoder.step((other[lo:hi], cache))]
    assert cache.offset == len(other) - 1
    _close(engine.logits(other[-1:], cache.copy(cache.offset)),
           engine.logits(other[-1:], _prefilled(engine, other[:-1])))
    decoder.add([base.BatchRow(1, other, GREEDY, cache=cache)])
    rest = _decode(decoder, {0: 8, 1: 4})
    assert (got + rest[0])[:8] == want
    lone = _batch(engine)
    lone.add([base.BatchRow(1, other, GREEDY)])
    assert rest[1] == _decode(lone, {1: 4})[1]


@pytest.mark.parametrize("held", [0, 4, len(PROMPT) - 1])
def test_batch_row_with_a_prefilled_cache_decodes_as_without(engine, held):
    plain = _batch(engine)
    plain.add([base.BatchRow(0, PROMPT, GREEDY)])
    want = _decode(plain, {0: 8})[0]

    alone = engine.batch_decoder()
    alone.add([base.BatchRow(0, PROMPT, GREEDY, cache=_prefilled(engine, PROMPT[:held]))])
    assert _decode(alone, {0: 8})[0] == want

    # Joining rows that are already running (and padded to another length) changes nothing.
    busy = engine.batch_decoder()
    busy.add([base.BatchRow(1, [9, 8, 7, 6, 5, 4, 3, 2, 1, 0, 12, 13], GREEDY), base.BatchRow(2, [3], GREEDY)])
    _decode(busy, {1: 3, 2: 3})
    busy.add([base.BatchRow(0, PROMPT, GREEDY, cache=_prefilled(engine, PROMPT[:held]))])
    assert _decode(busy, {0: 8})[0] == want


def test_batch_row_cache_is_checked(engine):
    _batch(engine)
    with pytest.raises(InvalidArgumentError):
        base.BatchRow(0, PROMPT[:3], GREEDY, cache=_prefilled(engine, PROMPT[:3]))  # nothing left to feed
    with pytest.raises(InvalidArgumentError):
        base.BatchRow(0, PROMPT, GREEDY, logprobs=base.MAX_LOGPROBS + 1)


@pytest.mark.parametrize("steps", [0, 1, 5])
def test_export_holds_the_rows_positions(engine, steps):
    decoder = _batch(engine)
    prompts = {0: PROMPT, 1: PROMPT[:4]}  # different lengths: one row is padded in a batch cache
    decoder.add([base.BatchRow(i, p, GREEDY) for i, p in prompts.items()])
    returned = {i: [] for i in prompts}
    for _ in range(steps):
        for row, token in decoder.step():
            returned[row].append(token)
    probe = [21, 22, 23]
    exported = {}
    for i, p in prompts.items():
        cache = decoder.export(i)
        assert isinstance(cache, base.KVCache) and cache.kv_bits is None
        n = len(returned[i])
        assert cache.offset in (len(p) + n - 1, len(p) + n)
        exported[i] = (cache, (list(p) + returned[i])[:cache.offset])
    for _ in range(3):  # the copies do not follow the batch
        decoder.step()
    decoder.remove([0])
    with pytest.raises(InvalidArgumentError):
        decoder.export(0)
    for cache, held in exported.values():
        _close(engine.logits(probe, cache), engine.logits(probe, _prefilled(engine, held)))


def test_an_exported_cache_trimmed_serves_a_longer_prompt(engine):
    decoder = _batch(engine)
    decoder.add([base.BatchRow(0, PROMPT, GREEDY), base.BatchRow(1, [4, 4, 2], GREEDY)])
    out = _decode(decoder, {0: 6})[0]
    cache = decoder.export(0)
    decoder.remove([0, 1])
    text = list(PROMPT) + out
    keep = len(PROMPT) + 2
    assert cache.trimmable and cache.trim(cache.offset - keep) >= 0 and cache.offset == keep
    longer = text[:keep] + [30, 31, 32, 33]

    plain = engine.batch_decoder()
    plain.add([base.BatchRow(0, longer, GREEDY)])
    want = _decode(plain, {0: 6})[0]
    again = engine.batch_decoder()
    again.add([base.BatchRow(5, [7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7], GREEDY)])
    again.step()
    again.add([base.BatchRow(0, longer, GREEDY, cache=cache)])
    assert _decode(again, {0: 6})[0] == want


def _log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    m = x.max(axis=-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(axis=-1, keepdims=True))


def _penalised(logits: np.ndarray, recent, penalty: float) -> np.ndarray:
    out = logits.copy()
    for t in set(recent):
        out[t] = out[t] / penalty if out[t] > 0 else out[t] * penalty
    return out


# A penalty below 1 favours the recent tokens: the penalised distribution is far from the raw one.
_PENALISED = base.BatchRow(3, [5, 5, 17, 5, 17], SamplingParams(temperature=0, repetition_penalty=0.1,
                                                                repetition_context=8), logprobs=3)
_LOGPROB_ROWS = {
    "mixed": [
        base.BatchRow(0, PROMPT, GREEDY, logprobs=5),
        base.BatchRow(1, PROMPT[:4], SamplingParams(temperature=1.0, top_k=3), seed=7, logprobs=0),
        base.BatchRow(2, [9, 8, 7, 6, 5], GREEDY),  # asks for none
        _PENALISED,
    ],
    "greedy": [base.BatchRow(0, PROMPT, GREEDY, logprobs=2), base.BatchRow(2, [9, 8, 7, 6, 5], GREEDY)],
    "penalised": [_PENALISED],  # no row served by the batched argmax
}


@pytest.mark.parametrize("case", list(_LOGPROB_ROWS))
def test_logprobs_are_the_models_distribution(engine, case):
    decoder = _batch(engine)
    rows = _LOGPROB_ROWS[case]
    decoder.add(rows)
    tokens = {r.id: [] for r in rows}
    figures = {r.id: [] for r in rows}
    for _ in range(7):
        out = decoder.step()
        probs = decoder.logprobs()
        assert set(probs) == {row for row, _ in out if row != 2}
        for row, token in out:
            tokens[row].append(token)
            if row in probs:
                figures[row].append(probs[row])
    for r in rows:
        if r.logprobs is None:
            continue
        assert len(figures[r.id]) == len(tokens[r.id]) >= 4
        text = list(r.prompt) + tokens[r.id]
        logits = engine.logits(text[:-1])[len(r.prompt) - 1:]  # (generated, V): row j drew token j
        for j, (token, (chosen, top)) in enumerate(zip(tokens[r.id], figures[r.id])):
            at = len(r.prompt) + j
            dist = logits[j]
            if r.sampling.repetition_penalty != 1.0:
                dist = _penalised(dist, text[:at][-r.sampling.repetition_context:], r.sampling.repetition_penalty)
            lp = _log_softmax(dist)
            assert abs(chosen - lp[token]) < 1e-4
            assert len(top) == r.logprobs
            values = [v for _, v in top]
            assert values == sorted(values, reverse=True)
            if top:
                assert top[0][0] == int(np.argmax(lp))
                assert top[0][0] == token  # greedy on the reported distribution
                for t, v in top:
                    assert abs(v - lp[t]) < 1e-4


def test_the_first_token_runs_the_output_head_on_one_position_only(engine, monkeypatch):
    """A long prompt fills the cache in chunks without logits; only the last position meets the head."""

    class Recorder:
        def __init__(self, model):
            self.model, self.lengths = model, []

        def __call__(self, tokens, *args, **kwargs):
            self.lengths.append(int(tokens.shape[-1]))
            return self.model(tokens, *args, **kwargs)

        def __getattr__(self, name):
            return getattr(self.model, name)

    import sys

    chunk = 128  # the tiny model's context is 512: smaller chunks, so that a prompt spans several
    monkeypatch.setattr(sys.modules[type(engine).__module__], "PREFILL_CHUNK", chunk)
    real = engine.model
    recorder = engine.model = Recorder(real)
    try:
        prompt = [(7 * i) % 500 + 3 for i in range(300)]
        tokens = engine.generate_tokens(prompt, engine.make_cache(), GREEDY)
        next(tokens)
        tokens.close()
    finally:
        engine.model = real
    # 299 prompt tokens in chunks of 128, 128 and 43 (no logits kept), then the last one alone through the head.
    assert recorder.lengths[:4] == [chunk, chunk, 299 - 2 * chunk, 1]
