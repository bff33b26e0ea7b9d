"""Sampling semantics, checked identically on every backend."""

import numpy as np
import pytest

from support.samplers import BACKENDS
from umakit.errors import InvalidArgumentError
from umakit.generate.sampling import SamplingParams

V = 50
NO_RECENT = np.zeros((1, 0), dtype=np.int64)


@pytest.fixture(params=sorted(BACKENDS))
def sample(request):
    return BACKENDS[request.param]


def logits_with(probs: dict[int, float]) -> np.ndarray:
    """(1, V) logits whose softmax puts ``probs`` on the given ids and shares the rest."""
    rest = (1 - sum(probs.values())) / (V - len(probs))
    p = np.full(V, rest)
    for i, q in probs.items():
        p[i] = q
    return np.log(p)[None].astype(np.float32)


def draws(sample, logits, params, n=200, recent=NO_RECENT):
    return {int(sample(logits, recent, params, seed)[0]) for seed in range(n)}


def test_temperature_zero_is_argmax(sample):
    logits = np.random.default_rng(0).normal(size=(3, V)).astype(np.float32)
    out = sample(logits, np.zeros((3, 0), dtype=np.int64), SamplingParams(temperature=0), 0)
    assert list(out) == list(logits.argmax(-1))


def test_top_k_one_is_greedy_at_any_temperature(sample):
    logits = logits_with({7: 0.3, 8: 0.29})
    assert draws(sample, logits, SamplingParams(temperature=5.0, top_k=1, top_p=1.0)) == {7}


def test_top_k_keeps_only_k_best(sample):
    logits = logits_with({1: 0.2, 2: 0.19, 3: 0.18})
    assert draws(sample, logits, SamplingParams(temperature=3.0, top_k=3, top_p=1.0)) == {1, 2, 3}


def test_top_p_keeps_the_nucleus(sample):
    logits = logits_with({4: 0.5, 5: 0.3, 6: 0.15})
    # mass before 5 is 0.5 < 0.7 -> kept; before 6 is 0.8 >= 0.7 -> dropped
    assert draws(sample, logits, SamplingParams(temperature=1.0, top_p=0.7)) == {4, 5}


def test_min_p_drops_unlikely_tokens(sample):
    logits = logits_with({9: 0.5, 10: 0.3, 11: 0.1})
    # threshold 0.25 * 0.5 = 0.125 keeps 9 and 10 only
    assert draws(sample, logits, SamplingParams(temperature=1.0, top_p=1.0, min_p=0.25)) == {9, 10}


def test_full_distribution_is_sampled(sample):
    logits = np.zeros((1, 4), dtype=np.float32)
    assert draws(sample, logits, SamplingParams(temperature=1.0, top_p=1.0), n=100) == {0, 1, 2, 3}


def test_same_seed_same_draw(sample):
    logits = np.zeros((1, V), dtype=np.float32)
    p = SamplingParams(temperature=1.0, top_p=1.0)
    assert [int(sample(logits, NO_RECENT, p, 123)[0]) for _ in range(3)] == [int(sample(logits, NO_RECENT, p, 123)[0])] * 3
    assert len({int(sample(logits, NO_RECENT, p, s)[0]) for s in range(20)}) > 5


def test_repetition_penalty_demotes_recent_tokens(sample):
    logits = np.zeros((1, V), dtype=np.float32)
    logits[0, 3], logits[0, 4], logits[0, 5] = 2.0, 1.8, -1.0
    recent = np.array([[3, 5]])
    greedy = SamplingParams(temperature=0, repetition_penalty=1.5)
    assert int(sample(logits, recent, greedy, 0)[0]) == 4  # 2.0 / 1.5 < 1.8
    assert int(sample(logits, recent, SamplingParams(temperature=0), 0)[0]) == 3


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"temperature": -1}, "temperature must be >= 0"),
        ({"top_p": 0}, "top_p must be in"),
        ({"top_k": -2}, "top_k must be >= 0"),
        ({"min_p": 1.0}, "min_p must be in"),
        ({"repetition_penalty": 0}, "repetition_penalty must be > 0"),
    ],
)
def test_invalid_params(kwargs, message):
    with pytest.raises(InvalidArgumentError, match=message):
        SamplingParams(**kwargs)
