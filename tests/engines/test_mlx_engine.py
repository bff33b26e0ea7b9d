"""MLX engine logic that matters most on Metal, tested through the same code paths on MLX's CPU backend."""

from __future__ import annotations

import mlx.core as mx
import pytest

import umakit
from umakit.backends.mlx import engine as mlx_engine
from umakit.generate.sampling import SamplingParams


def test_auto_dtype_follows_the_matrices_not_the_count_of_float32_norms():
    norms = {f"model.layers.{i}.norm.weight": mx.zeros((64,), dtype=mx.float32) for i in range(25)}
    mats = {f"model.layers.{i}.mlp.weight": mx.zeros((64, 64), dtype=mx.float16) for i in range(12)}
    assert mlx_engine.auto_dtype({}, {**norms, **mats}) == mx.float16  # 25 float32 tensors, fewer bytes
    assert mlx_engine.auto_dtype({"torch_dtype": "bfloat16"}, {**norms, **mats}) == mx.bfloat16  # declared wins
    f64 = {"x.weight": mx.zeros((128, 128), dtype=mx.float64)}
    assert mlx_engine.auto_dtype({}, {**f64, **mats}) == mx.float16  # the GPU has no float64: never voted for
    assert mlx_engine.auto_dtype({}, {}) == mx.float16


def test_float64_tensors_are_cast_on_the_cpu_stream(monkeypatch):
    streams = []
    real = mx.array.astype

    def spy(self, dtype, stream=None):
        streams.append(stream)
        return real(self, dtype, stream=stream) if stream is not None else real(self, dtype)

    monkeypatch.setattr(mx.array, "astype", spy)
    mlx_engine._cast(mx.zeros((2, 2), dtype=mx.float64), mx.float16)
    mlx_engine._cast(mx.zeros((2, 2), dtype=mx.float32), mx.float16)
    assert streams == [mx.cpu, None]


@pytest.fixture(scope="module")
def model(tiny_dir):
    return umakit.load(tiny_dir("llama"), backend="mlx")


def test_freed_buffers_are_released_after_prefill_chunks_and_every_256_steps(model, monkeypatch):
    calls = []
    monkeypatch.setattr(mx, "clear_cache", lambda: calls.append(1))
    monkeypatch.setattr(mlx_engine, "PREFILL_CHUNK", 64)
    prompt = [(5 * i) % 400 + 3 for i in range(150)]  # 149 prefilled: chunks of 64, 64, 21
    tokens = model.engine.generate_tokens(prompt, model.make_cache(), SamplingParams(temperature=0))
    next(tokens)
    assert len(calls) == 3
    for _ in range(mlx_engine.CLEAR_EVERY):
        next(tokens)
    tokens.close()
    assert len(calls) == 4


def test_greedy_decoding_splits_no_key_and_grows_no_window(model, monkeypatch):
    splits, concats = [], []
    real_split, real_concat = mx.random.split, mx.concatenate
    monkeypatch.setattr(mx.random, "split", lambda *a, **k: splits.append(1) or real_split(*a, **k))
    monkeypatch.setattr(mx, "concatenate", lambda *a, **k: concats.append(1) or real_concat(*a, **k))

    def run(**sampling):
        splits.clear()
        concats.clear()
        tokens = model.engine.generate_tokens([5, 6, 7], model.make_cache(), SamplingParams(**sampling), seed=0)
        for _ in range(20):
            next(tokens)
        tokens.close()
        return len(splits), len(concats)

    assert run(temperature=0) == (0, 0)
    split, concat = run(temperature=0.8, repetition_penalty=1.2)
    assert split >= 20 and concat >= 20
    greedy = model.generate("The quick brown fox", raw=True, max_tokens=12, temperature=0)
    again = model.generate("The quick brown fox", raw=True, max_tokens=12, temperature=0, repetition_penalty=1.0)
    assert greedy.tokens == again.tokens


def test_cast_weights_keeps_what_the_models_cast_predicate_keeps():
    weights = {"a.weight": mx.zeros((2, 2)), "router.bias": mx.zeros((2,)), "idx": mx.zeros((2,), dtype=mx.int32),
               "gate.bias64": mx.zeros((2,), dtype=mx.float64)}
    out = mlx_engine.cast_weights(weights, mx.float16, lambda k: "bias" not in k)
    assert out["a.weight"].dtype == mx.float16 and out["idx"].dtype == mx.int32
    assert out["router.bias"].dtype == mx.float32
    assert out["gate.bias64"].dtype == mx.float32  # kept, but never float64: the GPU has none


@pytest.fixture
def norms_kept_in_float32(monkeypatch):
    """The tiny llama's class declares mlx-lm's `cast_predicate`, keeping its norms in float32."""
    from mlx_lm.models import llama

    monkeypatch.setattr(llama.Model, "cast_predicate", property(lambda self: lambda k: "norm" not in k),
                        raising=False)


def _dtypes(engine):
    from mlx.utils import tree_flatten

    return {k: v.dtype for k, v in tree_flatten(engine.model.parameters())}


def test_loading_honours_the_models_cast_predicate(tiny_dir, norms_kept_in_float32):
    m = umakit.load(tiny_dir("llama"), backend="mlx", device="cpu", dtype="float16")
    dtypes = _dtypes(m.engine)
    norms = {k for k in dtypes if "norm" in k}
    assert norms and all(dtypes[k] == mx.float32 for k in norms)  # the checkpoint stores float32
    assert all(d == mx.float16 for k, d in dtypes.items() if k not in norms)
    assert m.generate("The quick", raw=True, max_tokens=3, temperature=0).tokens


def test_synthetic_models_honour_the_cast_predicate_too(tiny_dir, norms_kept_in_float32):
    import json

    config = json.loads((tiny_dir("llama") / "config.json").read_text())
    dtypes = _dtypes(umakit.load_synthetic(config, backend="mlx", device="cpu", dtype="float16").engine)
    assert all((d == mx.float32) == ("norm" in k) for k, d in dtypes.items())
