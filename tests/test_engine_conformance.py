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

from umakit import backends, checkpoint
from umakit.backends import base
from umakit.errors import InvalidArgumentError
from umakit.sampling import SamplingParams
from tiny import make_tiny_model

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
