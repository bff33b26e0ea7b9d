"""umakit on MLX against transformers (the reference implementation), float32."""

import numpy as np
import pytest
import torch

import umakit
from conftest import ALL_FAMILIES
from umakit.generate.sampling import SamplingParams

PROMPT = [5, 17, 42, 99, 3, 250, 7, 301, 12, 64, 128, 77, 31, 200, 11]
GREEDY = SamplingParams(temperature=0)


def reference(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def ref_logits(ref, tokens):
    with torch.no_grad():
        return ref(torch.tensor([tokens])).logits[0].numpy()


@pytest.fixture(scope="module", params=ALL_FAMILIES)
def pair(request, tiny_dir):
    path = tiny_dir(request.param)
    return request.param, umakit.load(path, backend="mlx"), reference(path)


def test_logits_match_transformers(pair):
    family, model, ref = pair
    ours, theirs = model.logits(PROMPT), ref_logits(ref, PROMPT)
    assert ours.shape == theirs.shape
    np.testing.assert_allclose(ours, theirs, atol=1e-4, rtol=1e-4, err_msg=family)


def test_greedy_32_tokens_match_transformers(pair):
    family, model, ref = pair
    ours = model.engine.generate_tokens(PROMPT, model.make_cache(), GREEDY)
    ours = [next(ours) for _ in range(32)]
    seq = list(PROMPT)
    for _ in range(32):  # the reference decodes without a cache: every step a full pass
        seq.append(int(ref_logits(ref, seq)[-1].argmax()))
    assert ours == seq[len(PROMPT):], family


def test_prefill_then_cached_decode_equals_full_forward(pair):
    family, model, _ = pair
    full = model.logits(PROMPT)
    cache = model.make_cache()
    steps = [model.engine.logits(PROMPT[:6], cache)[-1]]
    for t in PROMPT[6:]:
        steps.append(model.engine.logits([t], cache)[-1])
    assert cache.offset == len(PROMPT)
    np.testing.assert_allclose(np.stack(steps), full[5:], atol=1e-4, rtol=1e-4, err_msg=family)
