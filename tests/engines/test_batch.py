"""Batched generation against the sequential decode loop as the oracle, on every engine (float32 on the CPU)."""

import re

import pytest

import umakit
from umakit.backends.base import BatchDecoder, BatchRow
from umakit.generate.batch import BatchRequest, generate_batch, plan_batch_size, stream_batch
from umakit.errors import InvalidArgumentError, UnsupportedModelError
from umakit.generate.sampling import SamplingParams
from support.markers import requires_default_model
from support.oracle import ENGINES, MAX_TOKENS, PROMPTS, batched_prompts, sequential

GREEDY = SamplingParams(temperature=0)


@pytest.fixture(scope="module", params=sorted(ENGINES))
def models(request, tiny_dir):
    """``models(family)``: the tiny checkpoint on this test's engine, loaded once per module."""
    loaded = {}

    def get(family):
        if family not in loaded:
            loaded[family] = umakit.load(tiny_dir(family), **ENGINES[request.param])
        return loaded[family]

    get.engine = request.param
    return get


def decoder_class(model) -> type:
    return type(model.engine.batch_decoder())


@pytest.mark.parametrize("family", ["llama", "qwen3", "gemma3"])
def test_greedy_batch_equals_sequential_token_for_token(models, family):
    model = models(family)
    expected = sequential(model, PROMPTS, max_tokens=MAX_TOKENS, temperature=0)
    for size in (1, 3, 8):
        run = generate_batch(model, batched_prompts(PROMPTS), max_tokens=MAX_TOKENS, sampling=GREEDY,
                             batch_size=size, raw=True)
        assert run.batch_size == size and run.note is None
        for i, (want, got) in enumerate(zip(expected, run)):
            assert got.tokens == want.tokens, f"{family} batch {size} prompt {i}"
            assert got.text == want.text and got.finish_reason == want.finish_reason
        assert run.stats.generated_tokens == sum(len(r.tokens) for r in expected)
        if size > 1:
            assert run.stats.steps < run.stats.generated_tokens  # one forward pass serves many rows


def test_gemma3_rows_outlive_the_sliding_window(models):
    # The tiny gemma3 window is 8 tokens: prompts and replies run far past it,
    # and slots are refilled while other rows' window caches have rotated.
    model = models("gemma3")
    assert model.engine.config["sliding_window"] == 8
    prompts = PROMPTS[:5]
    expected = sequential(model, prompts, max_tokens=40, temperature=0)
    run = generate_batch(model, batched_prompts(prompts), max_tokens=40, sampling=GREEDY, batch_size=2, raw=True)
    assert [r.tokens for r in run] == [r.tokens for r in expected]


def test_seeded_sampling_per_row_matches_sequential(models):
    model = models("llama")
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
    run = generate_batch(model, items, max_tokens=16, raw=True, batch_size=3)
    assert [r.tokens for r in run] == [r.tokens for r in expected]
    assert expected[0].tokens != expected[1].tokens  # the seeds really differ


def test_stop_strings_and_max_tokens_are_per_row(models):
    model = models("llama")
    prompts = [PROMPTS[0], PROMPTS[8], PROMPTS[2]]
    free = sequential(model, prompts, max_tokens=MAX_TOKENS, temperature=0)
    text = free[1].text  # a stop string from the middle of row 1's free reply
    stop = next(text[i:i + 3] for i in range(4, len(text) - 3) if "\ufffd" not in text[i:i + 3])
    items = [
        {"prompt": prompts[0], "max_tokens": 3},
        {"prompt": prompts[1], "stop": [stop]},
        {"prompt": prompts[2], "max_tokens": 11},
    ]
    run = generate_batch(model, items, max_tokens=MAX_TOKENS, sampling=GREEDY, raw=True, batch_size=3)
    assert run[0].finish_reason == "length" and len(run[0].tokens) == 3
    assert run[0].tokens == free[0].tokens[:3]
    assert run[1].finish_reason == "stop_string" and stop not in run[1].text
    assert len(run[1].tokens) < len(free[1].tokens)
    want = model.generate(prompts[1], raw=True, max_tokens=MAX_TOKENS, temperature=0, stop=[stop])
    assert run[1].text == want.text and run[1].tokens == want.tokens
    assert run[2].finish_reason == "length" and run[2].tokens == free[2].tokens[:11]


def test_stream_yields_each_index_once_as_rows_finish(models):
    model = models("llama")
    items = [{"prompt": "The", "max_tokens": 30}, {"prompt": "Paris is", "max_tokens": 2}, {"prompt": "fox", "max_tokens": 9}]
    stream = stream_batch(model, items, sampling=GREEDY, raw=True, batch_size=3)
    order = [i for i, _ in stream]
    assert order == [1, 2, 0]
    assert stream.stats.steps < 30 + 2 + 9  # one forward pass per step serves every row


def test_slots_are_refilled_while_other_rows_run(models, monkeypatch):
    """Continuous batching: a finished row's slot is taken by the next prompt at once."""
    model = models("llama")
    sizes_at_add, sizes_at_step = [], []
    cls = decoder_class(model)
    add, step = cls.add, cls.step
    monkeypatch.setattr(cls, "add", lambda self, rows: (sizes_at_add.append(self.size), add(self, rows))[1])
    monkeypatch.setattr(cls, "step", lambda self: (sizes_at_step.append(self.size), step(self))[1])
    prompts = [PROMPTS[i] for i in (0, 2, 4, 5, 7, 8)]  # none meets EOS early
    items = [{"prompt": p, "max_tokens": n} for p, n in zip(prompts, (20, 3, 5, 20, 4, 6))]
    run = generate_batch(model, items, sampling=GREEDY, raw=True, batch_size=3)
    assert all(r.finish_reason == "length" for r in run)
    assert max(sizes_at_step) == 3
    assert sizes_at_add[0] == 0 and any(n > 0 for n in sizes_at_add[1:])  # refills join running rows
    assert len(sizes_at_step) < sum(n + 1 for n in (20, 3, 5, 20, 4, 6))


def test_prefill_of_new_rows_leaves_running_caches_untouched(models):
    """Its internals differ by engine (MLX left-pads rows; torch keeps each row at its own length): each checked."""
    model = models("llama")
    if models.engine == "torch":
        return adding_rows_leaves_torch_caches_untouched(model)
    import mlx.core as mx

    dec = model.engine.batch_decoder()
    assert isinstance(dec, BatchDecoder)
    dec.add([BatchRow(0, model.encode("Paris is", raw=True), GREEDY)])
    for _ in range(4):
        dec.step()
    layer = dec._cache[0]
    pad, end = layer.left_padding.tolist()[0], layer.size()
    before = mx.array(layer.keys[0, :, pad:end])
    dec.add([BatchRow(1, model.encode(PROMPTS[1], raw=True), GREEDY), BatchRow(2, [5], GREEDY)])
    pad = layer.left_padding.tolist()[0]
    assert dec.size == 3 and pad > 0  # the running row was padded on the left, not rewritten
    assert mx.array_equal(layer.keys[0, :, pad:pad + before.shape[1]], before).item()


def test_memory_plan_lowers_the_batch_size_with_a_note(models, monkeypatch):
    model = models("llama")
    kv = model.info.weights.kv_bytes_per_token
    monkeypatch.setattr(decoder_class(model), "kv_budget_bytes", lambda self: int(2.5 * 256 * kv))
    run = generate_batch(model, batched_prompts(PROMPTS[:5]), max_tokens=8, sampling=GREEDY, raw=True, batch_size=8)
    assert run.batch_size == 2
    assert run.note.startswith("batch size lowered from 5 to 2: each sequence may hold 256 tokens")
    expected = sequential(model, PROMPTS[:5], max_tokens=8, temperature=0)
    assert [r.tokens for r in run] == [r.tokens for r in expected]
    monkeypatch.setattr(decoder_class(model), "kv_budget_bytes", lambda self: 1000)
    with pytest.raises(InvalidArgumentError, match="not even one sequence fits"):
        stream_batch(model, ["The"], max_tokens=8)


def test_plan_counts_the_longest_row_in_blocks():
    reqs = [BatchRequest((1,) * 10, max_tokens=20), BatchRequest((1,) * 300, max_tokens=10)]
    assert plan_batch_size(reqs, 8, 100.0, 10**9) == (2, None)  # no more rows than prompts
    size, note = plan_batch_size(reqs * 4, 8, 100.0, 512 * 100 * 3)
    assert size == 3 and "from 8 to 3" in note and "512 tokens" in note


def test_bad_prompts_are_rejected_before_anything_runs(models):
    model = models("llama")
    cases = [
        ({"prompt": "x", "max_token": 3}, "unknown setting(s) max_token"),
        ({"prompt": "x", "messages": []}, "give exactly one of 'prompt' or 'messages'"),
        ({"prompt": "x", "top_k": 1.5}, "top_k must be an integer"),
        ({"prompt": "x", "temperature": -1}, "temperature must be >= 0"),
        ({"prompt": "x", "stop": [1]}, "stop must be a string or a list of strings"),
        ({"prompt": "x", "max_tokens": 0}, "max_tokens must be at least 1"),
        ({"prompt": ""}, "the prompt is empty"),
        (42, "a prompt must be a string"),
    ]
    for item, message in cases:
        with pytest.raises(InvalidArgumentError, match="prompt 1: " + re.escape(message)):
            stream_batch(model, ["fine", item], raw=True)


def test_empty_batch_and_unsupported_backends(models, monkeypatch):
    model = models("llama")
    engine = type(model.engine)

    def no_batch(self, kv_bits=None, lookup=None):
        raise UnsupportedModelError("batched decoding is not available on the other backend yet")

    monkeypatch.setattr(engine, "batch_decoder", no_batch)
    run = generate_batch(model, [])  # nothing to decode: no decoder is asked for
    assert len(run) == 0 and run.stats.generated_tokens == 0
    # the engine's own refusal reaches the caller before anything runs
    with pytest.raises(UnsupportedModelError, match="batched decoding is not available on the other backend yet"):
        stream_batch(model, ["The"])


def test_on_error_skips_bad_prompts_and_keeps_the_callers_indices(models):
    model = models("llama")
    items = [{"prompt": "x", "max_token": 3}, "The", {"messages": [{"role": "user"}]}, {"prompt": "fox", "max_tokens": 2}]
    errors = []
    stream = stream_batch(model, items, max_tokens=5, sampling=GREEDY, raw=True,
                          on_error=lambda i, e: errors.append((i, type(e).__name__, str(e))))
    assert [(i, kind) for i, kind, _ in errors] == [(0, "InvalidArgumentError"), (2, "TokenizerError")]
    assert errors[0][2].startswith("unknown setting(s) max_token")  # the item's own message, no "prompt 0: "
    assert len(stream) == 2
    got = dict(iter(stream))
    assert sorted(got) == [1, 3]
    assert got[1].tokens == model.generate("The", raw=True, temperature=0, max_tokens=5).tokens
    assert got[3].tokens == model.generate("fox", raw=True, temperature=0, max_tokens=2).tokens
    with pytest.raises(InvalidArgumentError, match=re.escape("prompt 0: unknown setting(s) max_token")):
        stream_batch(model, items, raw=True)  # without on_error the first bad prompt raises


def adding_rows_leaves_torch_caches_untouched(model):
    import torch

    dec = model.engine.batch_decoder()
    assert isinstance(dec, BatchDecoder)
    dec.add([BatchRow(0, model.encode("Paris is", raw=True), GREEDY)])
    for _ in range(4):
        dec.step()
    n = dec.context_tokens()
    before = dec._cache.k[:, 0, :, :n].clone()
    dec.add([BatchRow(1, model.encode(PROMPTS[1], raw=True), GREEDY), BatchRow(2, [5], GREEDY)])
    assert dec.size == 3 and dec._cache.capacity >= dec.context_tokens()
    assert torch.equal(dec._cache.k[:, 0, :, :n], before)
    dec.remove([0])
    assert dec.size == 2 and sorted(rid for rid, _ in dec.step()) == [1, 2]  # the last row filled the hole


def test_unsupported_cache_layers_are_refused_clearly(models, monkeypatch):
    from umakit.backends.mlx.cache import QuantizedKVCache

    import umakit.backends.mlx.batch_decoder as mlx_batch

    if models.engine != "mlx":
        pytest.skip("MLX's cache layers: the torch engine has one kind")
    model = models("llama")
    monkeypatch.setattr(mlx_batch, "make_prompt_cache", lambda m: [QuantizedKVCache() for _ in m.layers])
    with pytest.raises(UnsupportedModelError, match="batched decoding does not support QuantizedKVCache cache layers"):
        stream_batch(model, ["The"])


def decode_rows(decoder, rows, count):
    """Add ``rows`` to ``decoder`` and step until each has returned ``count`` tokens; {row id: tokens}."""
    decoder.add(rows)
    got = {r.id: [] for r in rows}
    while any(len(t) < count for t in got.values()):
        for row, token in decoder.step():
            if row in got:  # rows already running are not ours
                got[row].append(token)
    return {i: t[:count] for i, t in got.items()}


def rows_with_caches_match_rows_without(engine, prompts, count=12):
    """Rows of mixed sampling, added in one call with and without prefilled caches, return the same tokens."""
    settings = [GREEDY, SamplingParams(temperature=0.9), SamplingParams(temperature=0, repetition_penalty=1.3),
                SamplingParams(temperature=1.0, top_k=20)]

    def rows(cached):
        out = []
        for i, prompt in enumerate(prompts):
            cache = None
            if cached and i % 3:  # some rows bring a cache, the others are prefilled by the decoder
                cache = engine.make_cache()
                engine.prefill(prompt[:len(prompt) * 2 // 3], cache)
            out.append(BatchRow(i, prompt, settings[i % len(settings)], seed=i, cache=cache, logprobs=i % 2 or None))
        return out

    plain, cached = engine.batch_decoder(), engine.batch_decoder()
    assert decode_rows(cached, rows(True), count) == decode_rows(plain, rows(False), count)


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_rows_with_prefilled_caches_match_rows_without(models, family):
    model = models(family)
    prompts = [model.encode(p, raw=True) for p in PROMPTS if isinstance(p, str)]
    rows_with_caches_match_rows_without(model.engine, prompts)


def test_gemma3_caches_past_the_sliding_window_round_trip(models):
    # The tiny gemma3 window is 8 tokens: the given prefix and the exported rows are longer than it.
    model = models("gemma3")
    engine = model.engine
    prompts = [model.encode(p, raw=True) for p in (PROMPTS[1], PROMPTS[7], PROMPTS[2])]
    rows_with_caches_match_rows_without(engine, prompts, count=20)

    dec = engine.batch_decoder()
    out = decode_rows(dec, [BatchRow(i, p, GREEDY) for i, p in enumerate(prompts)], 15)
    probe = [40, 41, 42]
    for i, p in enumerate(prompts):
        cache = dec.export(i)
        held = (list(p) + out[i])[:cache.offset]
        assert cache.offset >= len(p) + 14 > 8
        fresh = engine.make_cache()
        engine.prefill(held, fresh)
        want = engine.logits(probe, fresh)
        assert abs(engine.logits(probe, cache) - want).max() < 1e-4 * max(abs(want).max(), 1.0)
    # A stored cache serves a prompt that continues what it holds, past the window.
    cache = dec.export(1)
    longer = (list(prompts[1]) + out[1])[:cache.offset] + [30, 31, 32]
    want = decode_rows(engine.batch_decoder(), [BatchRow(0, longer, GREEDY)], 10)
    assert decode_rows(dec, [BatchRow(9, longer, GREEDY, cache=cache)], 10)[9] == want[0]


def test_every_way_in_checks_a_value_alike(models):
    """The API, a batch item and a CLI flag refuse the same bad value with the same message."""
    from click.testing import CliRunner

    from umakit.cli.main import main

    model = models("llama")
    for field, value, message in (("temperature", float("nan"), "temperature must be a finite number, got nan"),
                                  ("seed", 2**64, "seed must be in [-9223372036854775808, 9223372036854775807]")):
        with pytest.raises(InvalidArgumentError) as api:
            model.generate("The fox", raw=True, max_tokens=2, **{field: value})
        assert message in str(api.value)
        with pytest.raises(InvalidArgumentError) as item:
            stream_batch(model, [{"prompt": "The fox", field: value}], raw=True)
        assert message in str(item.value)
        flag = {"temperature": "--temp", "seed": "--seed"}[field]
        r = CliRunner().invoke(main, ["generate", "-p", "x", flag, str(value)])
        assert r.exit_code == 2 and message in r.output


@requires_default_model
def test_sixteen_rows_of_the_cpu_default_are_their_lone_runs():
    """The built-in model's default (the fused CPU step): 16 rows in one batch, each its lone greedy run. The
    step's output head once took the GEMMs from 16 rows, whose rows' bits depend on their neighbours: 2 of 8
    such rows then matched their lone runs."""
    model = umakit.load(backend="torch", device="cpu")
    prompts = [f"Write a long story about a lighthouse keeper named {name}." for name in
               ("Ann", "Bo", "Cy", "Di", "Ed", "Flo", "Gus", "Hal")] * 2
    rows = model.generate_batch(prompts, max_tokens=48, temperature=0, batch_size=16)
    for prompt, row in zip(prompts[:8], rows[:8]):
        assert row.tokens == model.generate(prompt, max_tokens=48, temperature=0).tokens, prompt


@pytest.mark.parametrize("family", ["qwen3_moe", "gemma3"])
def test_rows_on_the_eager_cpu_layers_are_their_lone_runs_past_the_gemm_crossover(quantized, family, monkeypatch):
    """Families the fused step does not cover decode a batch's rows in one eager pass: 18 rows, past the
    kernel's GEMM crossover (lowered to 4 rows here, so on every CPU), each still its lone greedy run. Before,
    the projections and experts of such a pass took the GEMMs: 4 of 18 qwen3_moe rows parted from their lone
    runs."""
    from umakit.backends.torch.cpu import affine_kernel

    monkeypatch.setattr(affine_kernel, "dense_rows", lambda: 4)
    model = umakit.load(quantized(family, 4), backend="torch", device="cpu", dtype="bfloat16")
    engine = model.engine
    assert engine._fused is None
    ids = model.tokenizer.encode("It is a truth universally acknowledged, that a single man in possession of a good")
    prompts = [ids[:4 + i] for i in range(18)]
    decoder = engine.batch_decoder()
    decoder.add([BatchRow(i, p, GREEDY) for i, p in enumerate(prompts)])
    got: dict[int, list[int]] = {i: [] for i in range(len(prompts))}
    for _ in range(10):
        for rid, token in decoder.step():
            got[rid].append(token)
    for i, p in enumerate(prompts):
        stream = engine.generate_tokens(p, engine.make_cache(), GREEDY)
        assert got[i] == [next(stream) for _ in got[i]], i
