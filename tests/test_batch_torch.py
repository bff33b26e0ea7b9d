"""Batched generation on the torch engine (CPU, float32) against its own sequential decode loop."""

import pytest
import torch

from umakit.backends.base import BatchDecoder, BatchRow
from umakit.backends.torch.batch_decoder import TorchBatchDecoder
from umakit.generate.sampling import SamplingParams

from test_batch import MAX_TOKENS, PROMPTS, batched_prompts, sequential


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_greedy_batch_equals_sequential_token_for_token(torch_models, family):
    model = torch_models(family)
    assert isinstance(model.engine.batch_decoder(), TorchBatchDecoder)
    expected = sequential(model, PROMPTS, max_tokens=MAX_TOKENS, temperature=0)
    for size in (1, 3, 8):
        run = model.generate_batch(batched_prompts(PROMPTS), max_tokens=MAX_TOKENS, temperature=0,
                             batch_size=size, raw=True)
        assert run.batch_size == size and run.note is None
        for i, (want, got) in enumerate(zip(expected, run)):
            assert got.tokens == want.tokens, f"{family} batch {size} prompt {i}"
            assert got.text == want.text and got.finish_reason == want.finish_reason
        assert run.stats.generated_tokens == sum(len(r.tokens) for r in expected)
        if size > 1:
            assert run.stats.steps < run.stats.generated_tokens  # one forward pass serves many rows


def test_seeded_sampling_per_row_matches_sequential(torch_models):
    model = torch_models("llama")
    settings = [
        dict(temperature=0.8, seed=1),
        dict(temperature=1.0, top_k=20, seed=2),
        dict(temperature=0),
        dict(temperature=0.7, top_p=0.9, min_p=0.05, seed=3),
        dict(temperature=0, repetition_penalty=1.3),
    ]
    prompts = [PROMPTS[i] for i in (0, 1, 2, 6, 9)]
    expected = [model.generate(p, raw=True, max_tokens=16, **s) for p, s in zip(prompts, settings)]
    items = [{"prompt": p, **s} for p, s in zip(prompts, settings)]
    run = model.generate_batch(items, max_tokens=16, raw=True, batch_size=3)
    assert [r.tokens for r in run] == [r.tokens for r in expected]
    assert expected[0].tokens != expected[1].tokens  # the seeds really differ


def test_stop_strings_and_max_tokens_are_per_row(torch_models):
    model = torch_models("llama")
    prompts = [PROMPTS[0], PROMPTS[8], PROMPTS[2]]
    free = sequential(model, prompts, max_tokens=MAX_TOKENS, temperature=0)
    text = free[1].text  # a stop string from the middle of row 1's free reply
    stop = next(text[i:i + 3] for i in range(4, len(text) - 3) if "\ufffd" not in text[i:i + 3])
    items = [
        {"prompt": prompts[0], "max_tokens": 3},
        {"prompt": prompts[1], "stop": [stop]},
        {"prompt": prompts[2], "max_tokens": 11},
    ]
    run = model.generate_batch(items, max_tokens=MAX_TOKENS, temperature=0, raw=True, batch_size=3)
    assert run[0].finish_reason == "length" and run[0].tokens == free[0].tokens[:3]
    assert run[1].finish_reason == "stop_string" and stop not in run[1].text
    want = model.generate(prompts[1], raw=True, max_tokens=MAX_TOKENS, temperature=0, stop=[stop])
    assert run[1].text == want.text and run[1].tokens == want.tokens
    assert run[2].finish_reason == "length" and run[2].tokens == free[2].tokens[:11]


def test_stream_refills_slots_and_yields_rows_as_they_finish(torch_models):
    model = torch_models("llama")
    items = [{"prompt": "The", "max_tokens": 30}, {"prompt": "Paris is", "max_tokens": 2},
             {"prompt": "fox", "max_tokens": 9}, {"prompt": PROMPTS[1], "max_tokens": 5}]
    stream = model.stream_batch(items, temperature=0, raw=True, batch_size=3)
    results = dict(stream)
    assert sorted(results) == [0, 1, 2, 3]
    expected = [model.generate(it["prompt"], raw=True, temperature=0, max_tokens=it["max_tokens"]) for it in items]
    assert [results[i].tokens for i in range(4)] == [r.tokens for r in expected]
    assert stream.stats.steps < 30 + 2 + 9 + 5


def test_adding_rows_leaves_running_caches_untouched(torch_models):
    model = torch_models("llama")
    dec = TorchBatchDecoder(model.engine)
    assert isinstance(dec, BatchDecoder)
    greedy = SamplingParams(temperature=0)
    dec.add([BatchRow(0, model.encode("Paris is", raw=True), greedy)])
    for _ in range(4):
        dec.step()
    n = dec.context_tokens()
    before = dec._cache.k[:, 0, :, :n].clone()
    dec.add([BatchRow(1, model.encode(PROMPTS[1], raw=True), greedy), BatchRow(2, [5], greedy)])
    assert dec.size == 3 and dec._cache.capacity >= dec.context_tokens()
    assert torch.equal(dec._cache.k[:, 0, :, :n], before)
    dec.remove([0])
    assert dec.size == 2 and [rid for rid, _ in dec.step()] == [1, 2]


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_rows_with_prefilled_caches_match_rows_without(torch_models, family):
    from test_batch import rows_with_caches_match_rows_without

    model = torch_models(family)
    prompts = [model.encode(p, raw=True) for p in PROMPTS if isinstance(p, str)]
    rows_with_caches_match_rows_without(model.engine, prompts)
