"""The default model on torch-CPU and MLX-CPU, float32: same greedy tokens, close logits."""

import numpy as np
import pytest

import umakit
from support.markers import requires_default_model
from umakit.generate.sampling import SamplingParams

pytestmark = [pytest.mark.slow, requires_default_model]

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Three prime numbers are"]
TOKENS = 16  # MLX-CPU prefill is slow; raw prompts keep this file to seconds


@pytest.fixture(scope="module")
def models():
    torch_model = umakit.load(None, backend="torch", device="cpu", dtype="float32")
    mlx_model = umakit.load(None, backend="mlx", device="cpu", dtype="float32")
    return torch_model, mlx_model


def greedy(model, ids):
    tokens = model.engine.generate_tokens(ids, model.make_cache(), SamplingParams(temperature=0))
    return [next(tokens) for _ in range(TOKENS)]


@pytest.mark.parametrize("prompt", PROMPTS)
def test_same_greedy_tokens(models, prompt):
    ours, theirs = models
    ids = ours.encode(prompt, raw=True)
    assert ids == theirs.encode(prompt, raw=True)
    assert greedy(ours, ids) == greedy(theirs, ids)


def test_logits_agree(models):
    ours, theirs = models
    ids = ours.encode(PROMPTS[0], raw=True)
    a, b = ours.logits(ids), theirs.logits(ids)
    np.testing.assert_allclose(a, b, atol=2e-3 * np.abs(b).max(), rtol=0)
    assert (a.argmax(-1) == b.argmax(-1)).all()


def test_weight_accounting_agrees(models):
    ours, theirs = models
    assert ours.info.weights.params == theirs.info.weights.params
    assert ours.info.weights.kv_bytes_per_token == theirs.info.weights.kv_bytes_per_token
