"""umakit on PyTorch (CPU) against transformers (the reference implementation), float32."""

import numpy as np
import pytest
import torch

import umakit
from umakit.errors import InvalidArgumentError, UnsupportedModelError
from umakit.sampling import SamplingParams

FAMILIES = ["llama", "mistral", "qwen2", "qwen3"]
PROMPT = [5, 17, 42, 99, 3, 250, 7, 301, 12, 64, 128, 77, 31, 200, 11]
GREEDY = SamplingParams(temperature=0)


def reference(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def ref_logits(ref, tokens):
    with torch.no_grad():
        return ref(torch.tensor([tokens])).logits[0].numpy()


@pytest.fixture(scope="module", params=FAMILIES)
def pair(request, tiny_dir):
    path = tiny_dir(request.param)
    return request.param, umakit.load(path, backend="torch", device="cpu", dtype="float32"), reference(path)


def test_logits_match_transformers(pair):
    family, model, ref = pair
    assert model.info.dtype == "float32"
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


def test_prefill_trim_and_continue(pair):
    """A cache that was prefilled, trimmed and refilled gives the logits of a fresh pass."""
    family, model, _ = pair
    engine = model.engine
    cache = model.make_cache()
    engine.prefill(PROMPT[:10], cache)
    assert cache.trim(4) == 4 and cache.offset == 6
    last = engine.logits(PROMPT[6:], cache)[-1]
    np.testing.assert_allclose(last, model.logits(PROMPT)[-1], atol=1e-4, rtol=1e-4, err_msg=family)


def test_cache_grows_past_its_first_capacity(tiny_dir):
    model = umakit.load(tiny_dir("llama"), backend="torch", device="cpu", dtype="float32")
    cache = model.make_cache()
    start = cache.capacity
    tokens = (PROMPT * 40)[: start + 20]
    model.engine.prefill(tokens[:-1], cache)
    assert cache.capacity > start
    last = model.engine.logits(tokens[-1:], cache)[-1]
    np.testing.assert_allclose(last, model.logits(tokens)[-1], atol=1e-4, rtol=1e-4)


def test_sampled_generation_is_seeded(tiny_dir):
    model = umakit.load(tiny_dir("qwen2"), backend="torch", device="cpu", dtype="float32")
    a = model.generate("The quick brown", raw=True, max_tokens=12, temperature=1.0, seed=7)
    b = model.generate("The quick brown", raw=True, max_tokens=12, temperature=1.0, seed=7)
    assert a.tokens == b.tokens and a.stats.decode_tps > 0 and a.stats.peak_memory_bytes > 0


@pytest.mark.parametrize("dtype, tolerance", [("float16", 0.005), ("bfloat16", 0.05)])
def test_half_precision_on_cpu_is_close(tiny_dir, dtype, tolerance):
    path = tiny_dir("qwen2")
    model = umakit.load(path, backend="torch", device="cpu", dtype=dtype)
    assert model.info.dtype == dtype
    theirs = ref_logits(reference(path), PROMPT)
    assert np.abs(model.logits(PROMPT) - theirs).max() <= tolerance * np.abs(theirs).max()


def test_unsupported_model_type_names_the_supported_ones(tiny_dir):
    with pytest.raises(UnsupportedModelError, match="supported: llama, mistral, qwen2, qwen3"):
        umakit.load(tiny_dir("gemma3"), backend="torch", device="cpu")


def test_kv_bits_is_refused(pair):
    with pytest.raises(InvalidArgumentError, match="kv_bits"):
        pair[1].make_cache(kv_bits=8)


@pytest.mark.parametrize("family", ["llama", "mistral"])
def test_static_decode_step_equals_eager(tiny_dir, family):
    """The CUDA-graph decode step (fixed attention span under a mask), run eagerly on CPU."""
    from umakit.backends.torch.kernels import GraphDecoder

    model = umakit.load(tiny_dir(family), backend="torch", device="cpu", dtype="float32")
    step = GraphDecoder(model.engine.model, capture=False)
    cache = model.make_cache()
    model.engine.prefill(PROMPT[:5], cache)
    with torch.inference_mode():
        got = [step(torch.tensor([t]), cache)[0].numpy() for t in PROMPT[5:]]
    assert cache.offset == len(PROMPT)
    np.testing.assert_allclose(np.stack(got), model.logits(PROMPT)[5:], atol=1e-4, rtol=1e-4)


def test_sliding_window_matches_transformers(tiny_dir, tmp_path):
    """Mistral with a window shorter than the prompt: prefill masks and cached decode both honour it."""
    import json
    import shutil

    path = tmp_path / "mistral-window"
    shutil.copytree(tiny_dir("mistral"), path)
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "sliding_window": 6}))
    model, ref = umakit.load(path, backend="torch", device="cpu", dtype="float32"), reference(path)
    np.testing.assert_allclose(model.logits(PROMPT), ref_logits(ref, PROMPT), atol=1e-4, rtol=1e-4)
    cache = model.make_cache()
    model.engine.prefill(PROMPT[:4], cache)
    steps = [model.engine.logits([t], cache)[-1] for t in PROMPT[4:]]
    np.testing.assert_allclose(np.stack(steps), ref_logits(ref, PROMPT)[4:], atol=1e-4, rtol=1e-4)
