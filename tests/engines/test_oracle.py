"""umakit against transformers (the reference implementation), float32, on every engine: logits, greedy text,
and prefill plus cached decode equal to one full pass, for every tiny family."""

import numpy as np
import pytest

import umakit
from umakit.generate.sampling import SamplingParams
from support.oracle import ENGINES, PROMPT, ref_logits, reference
from support.tiny import ALL_FAMILIES

GREEDY = SamplingParams(temperature=0)


@pytest.fixture(scope="module", params=[(e, f) for e in sorted(ENGINES) for f in ALL_FAMILIES],
                ids=lambda p: f"{p[0]}-{p[1]}")
def pair(request, tiny_dir):
    engine, family = request.param
    path = tiny_dir(family)
    return f"{engine} {family}", umakit.load(path, **ENGINES[engine]), reference(path)


def test_logits_match_transformers(pair):
    name, model, ref = pair
    assert model.info.dtype == "float32"
    ours, theirs = model.logits(PROMPT), ref_logits(ref, PROMPT)
    assert ours.shape == theirs.shape
    np.testing.assert_allclose(ours, theirs, atol=1e-4, rtol=1e-4, err_msg=name)


def test_greedy_32_tokens_match_transformers(pair):
    name, model, ref = pair
    ours = model.engine.generate_tokens(PROMPT, model.make_cache(), GREEDY)
    ours = [next(ours) for _ in range(32)]
    seq = list(PROMPT)
    for _ in range(32):  # the reference decodes without a cache: every step a full pass
        seq.append(int(ref_logits(ref, seq)[-1].argmax()))
    assert ours == seq[len(PROMPT):], name


def test_prefill_then_cached_decode_equals_full_forward(pair):
    name, model, _ = pair
    full = model.logits(PROMPT)
    cache = model.make_cache()
    steps = [model.engine.logits(PROMPT[:6], cache)[-1]]
    for t in PROMPT[6:]:
        steps.append(model.engine.logits([t], cache)[-1])
    assert cache.offset == len(PROMPT)
    np.testing.assert_allclose(np.stack(steps), full[5:], atol=1e-4, rtol=1e-4, err_msg=name)


def test_prefill_trim_and_continue(pair):
    """A cache that was prefilled, trimmed and refilled gives the logits of a fresh pass."""
    name, model, _ = pair
    engine = model.engine
    cache = model.make_cache()
    if not cache.trimmable:
        pytest.skip(f"{name}: this cache cannot always be rewound (sliding-window layers)")
    engine.prefill(PROMPT[:10], cache)
    assert cache.trim(4) == 4 and cache.offset == 6
    last = engine.logits(PROMPT[6:], cache)[-1]
    np.testing.assert_allclose(last, model.logits(PROMPT)[-1], atol=1e-4, rtol=1e-4, err_msg=name)


def test_sampled_generation_is_seeded(pair):
    name, model, _ = pair
    a = model.generate("The quick brown", raw=True, max_tokens=12, temperature=1.0, seed=7)
    b = model.generate("The quick brown", raw=True, max_tokens=12, temperature=1.0, seed=7)
    assert a.tokens == b.tokens and a.stats.decode_tps > 0 and a.stats.peak_memory_bytes > 0, name
