"""The torch engine's quantized KV cache (``kv_bits`` 8 and 4, groups of 64): its arithmetic against the float
cache, decoding over it against decoding over the float cache, the eager path it takes, and agreement with the
MLX engine on what it accepts and on what a token costs."""

import json

import numpy as np
import pytest
import torch
from click.testing import CliRunner

import umakit
from umakit.backends.base import BatchRow
from umakit.backends.torch.cache import StaticKVCache
from umakit.backends.torch.quant_cache import QuantizedKVCache, dequantize, quantize
from umakit.core.affine import KV_BITS, KV_GROUP_SIZE
from umakit.errors import InvalidArgumentError
from umakit.generate.sampling import SamplingParams
from umakit.plan.roofline import kv_bytes_per_token

from support.tiny import make_tiny_model

PROMPT = list(range(10, 40))
BITS = sorted(KV_BITS)
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def wide_dir(tmp_path_factory):
    """A tiny llama whose heads are one KV group wide (head_dim 64), as a quantized cache needs."""
    return make_tiny_model("llama", tmp_path_factory.mktemp("wide"), hidden_size=128, num_attention_heads=2,
                           num_key_value_heads=1)


@pytest.fixture(scope="module")
def wide(wide_dir):
    return umakit.load(wide_dir, backend="torch", device="cpu", dtype="float32")


def greedy(model, cache, n: int = 24) -> list[int]:
    tokens = model.engine.generate_tokens(PROMPT, cache, SamplingParams(temperature=0))
    return [next(tokens) for _ in range(n)]


# -- the arithmetic ---------------------------------------------------------------
@pytest.mark.parametrize("bits", BITS)
def test_round_trip_is_within_half_a_step_of_each_group(bits):
    x = torch.randn(2, 3, 5, 128, generator=torch.Generator().manual_seed(0)) * 3  # (B, nkv, T, hd)
    codes, scales, biases = quantize(x, bits)
    assert codes.dtype == torch.uint8 and codes.shape == (2, 3, 5, 128 * bits // 8)
    assert scales.shape == biases.shape == (2, 3, 5, 128 // KV_GROUP_SIZE) and scales.dtype == x.dtype
    error = (dequantize(codes, scales, biases, bits, torch.float32) - x).unflatten(-1, (-1, KV_GROUP_SIZE))
    groups = x.unflatten(-1, (-1, KV_GROUP_SIZE))
    half_step = (groups.amax(-1) - groups.amin(-1)) / (2 * (2**bits - 1))  # (max - min) / 2 / levels
    assert (error.abs().amax(-1) <= half_step * (1 + 1e-5)).all()
    assert error.abs().max() > 0  # 128 random values are not all on the grid


@pytest.mark.parametrize("bits", BITS)
def test_codes_are_the_bytes_of_the_weights_affine_layout(bits):
    """The same min-max arithmetic as the weights' `quantize` (MLX's layout), codes in the same bytes."""
    from umakit.backends.torch.quant import layout

    x = torch.randn(6, 128, generator=torch.Generator().manual_seed(1))
    codes, scales, biases = quantize(x, bits)
    words, their_scales, their_biases = layout.quantize(x, bits, KV_GROUP_SIZE)
    assert torch.equal(codes, words.view(torch.uint8))
    assert torch.equal(scales, their_scales) and torch.equal(biases, their_biases)


@pytest.mark.parametrize("bits, tolerance", [(8, 0.02), (4, 0.3)])  # half a step of groups ranging up to ~8
def test_cache_holds_what_the_float_cache_holds_through_growth_and_trim(bits, tolerance):
    layers, heads, hd = 2, 2, 128
    exact = StaticKVCache(layers, heads, hd, 600, torch.float32, CPU, capacity=4)
    cache = QuantizedKVCache(layers, heads, hd, 600, bits, torch.float32, CPU, capacity=4)
    assert cache.kv_bits == bits and cache.trimmable and cache.offset == 0
    g = torch.Generator().manual_seed(0)
    # a prompt, a decode step, then growth past the first capacity and past a whole GROW_STEP
    for T, trim in ((3, 0), (1, 0), (300, 5), (1, 0)):
        assert cache.reserve(T) == exact.reserve(T)
        k, v = torch.randn(2, 1, heads, T, hd, generator=g)
        for layer in range(layers):
            got, want = cache.update(layer, k, v, None), exact.update(layer, k, v, None)
            for a, b in zip(got, want, strict=True):
                assert a.shape == b.shape and a.dtype == b.dtype
                assert (a - b).abs().max() <= tolerance
        cache.advance(T)
        exact.advance(T)
        assert cache.trim(trim) == exact.trim(trim) == trim and cache.offset == exact.offset
    assert cache.capacity == exact.capacity == 512
    assert cache.nbytes == kv_bytes_per_token(layers, heads, hd, bits, dtype_bytes=4) * cache.capacity
    held = cache.offset
    assert cache.trim(10**6) == held and cache.offset == 0


@pytest.mark.parametrize("bits", [3, 16, 0, True])
def test_other_widths_are_refused_naming_the_value(wide, bits):
    with pytest.raises(InvalidArgumentError, match=f"^kv_bits must be 4 or 8, got {bits}$"):
        wide.make_cache(kv_bits=bits)


# -- decoding over it -------------------------------------------------------------
def test_8_bit_cache_decodes_the_float_caches_greedy_tokens(wide):
    assert greedy(wide, wide.make_cache(8)) == greedy(wide, wide.make_cache())


def test_logits_move_a_little_at_8_bits_and_more_at_4(wide):
    base = wide.logits(PROMPT)
    moved = {bits: np.abs(wide.engine.logits(PROMPT, wide.make_cache(bits)) - base).max() for bits in BITS}
    scale = np.abs(base).max()
    assert 0 < moved[8] < 0.02 * scale and moved[8] < moved[4] < 0.2 * scale
    cache = wide.make_cache(4)
    assert len(set(greedy(wide, cache))) > 1 and cache.offset == len(PROMPT) + 23


@pytest.mark.parametrize("bits", BITS)
def test_prefill_then_cached_decode_equals_one_pass(wide, bits):
    """Each token's keys and values are quantized on their own: chunking does not change the result."""
    cache = wide.make_cache(bits)
    wide.engine.prefill(PROMPT[:-1], cache)
    last = wide.engine.logits(PROMPT[-1:], cache)[-1]
    np.testing.assert_allclose(last, wide.engine.logits(PROMPT, wide.make_cache(bits))[-1], atol=1e-5, rtol=0)


@pytest.mark.parametrize("bits", [8, 4])
def test_a_copy_of_a_quantized_cache_holds_its_prefix(wide, bits):
    """A shared prompt prefix handed on (`copy`): it continues as a cache prefilled with those tokens does."""
    engine = wide.engine
    prompt = list(range(3, 40))
    cache = engine.make_cache(bits)
    engine.prefill(prompt, cache)
    copied = cache.copy(20)
    assert copied.kv_bits == bits and copied.offset == 20 and cache.offset == len(prompt)
    fresh = engine.make_cache(bits)
    engine.prefill(prompt[:20], fresh)
    np.testing.assert_allclose(engine.logits([50, 51], copied), engine.logits([50, 51], fresh), atol=1e-5, rtol=0)


@pytest.mark.parametrize("family", ["gemma3", "qwen3_moe"])
def test_sliding_window_and_expert_families_quantize_their_cache_too(family, tmp_path):
    """gemma3's sliding layers (a cache MLX cannot quantize: mlx-lm rotates it) and a mixture of experts."""
    path = make_tiny_model(family, tmp_path, hidden_size=128, num_attention_heads=2, num_key_value_heads=1,
                           head_dim=64)
    model = umakit.load(path, backend="torch", device="cpu", dtype="float32")
    base = model.logits(PROMPT)  # 30 tokens: past gemma3's window of 8
    cache = model.make_cache(8)
    model.engine.prefill(PROMPT[:-1], cache)
    last = model.engine.logits(PROMPT[-1:], cache)[-1]
    np.testing.assert_allclose(last, base[-1], atol=0.05 * np.abs(base).max(), rtol=0)
    np.testing.assert_allclose(last, model.engine.logits(PROMPT, model.make_cache(8))[-1], atol=1e-5, rtol=0)


class FloatOnly:
    """Stands in for the fused CPU step and the CUDA graphs, which read and write a float cache in place."""

    def applies(self) -> bool:
        return True

    def __call__(self, *args):
        raise AssertionError("a decode step over a float cache's buffers")


def test_a_quantized_cache_decodes_eagerly(wide, monkeypatch):
    monkeypatch.setattr(wide.engine, "_fused", FloatOnly())
    monkeypatch.setattr(wide.engine, "_graphs", FloatOnly())
    with pytest.raises(AssertionError, match="a float cache's buffers"):  # the stand-ins are in the way
        greedy(wide, wide.make_cache(), 2)
    cache = wide.make_cache(8)
    assert len(greedy(wide, cache, 4)) == 4
    assert wide.engine.logits(PROMPT[:3], cache).shape[0] == 3


@pytest.mark.parametrize("bits", BITS)
def test_a_batch_of_quantized_caches_decodes_each_row_as_it_decodes_alone(wide, bits):
    """`batch --kv-bits` and `serve --kv-bits`: every row's cache quantized as make_cache(kv_bits) quantizes it,
    rows of different lengths side by side, rows leaving and exported."""
    from umakit.generate.batch import generate_batch

    prompts = ["The", "The quick brown fox jumps over the lazy dog. " * 3, "Paris is", "One two three four"]
    reply = dict(raw=True, max_tokens=12, temperature=0)
    alone = [wide.generate(p, kv_bits=bits, **reply) for p in prompts]
    run = generate_batch(wide, [{"prompt": p} for p in prompts], batch_size=3, kv_bits=bits, **reply)
    assert [r.tokens for r in run] == [r.tokens for r in alone]
    assert run.stats.steps < run.stats.generated_tokens
    float_run = generate_batch(wide, [{"prompt": p} for p in prompts], batch_size=3, **reply)
    assert run.stats.bytes_read < float_run.stats.bytes_read  # the cache's bytes, read every step, are fewer


def test_a_batch_takes_caches_of_its_own_bits_only(wide):
    decoder = wide.engine.batch_decoder(8)
    cache = wide.make_cache(8)
    wide.engine.prefill(PROMPT[:3], cache)
    decoder.add([BatchRow(0, PROMPT, SamplingParams(temperature=0), cache=cache)])  # a stored prefix
    first = [decoder.step() for _ in range(4)]
    copy = decoder.export(0)
    assert copy.kv_bits == 8 and copy.offset in (len(PROMPT) + 3, len(PROMPT) + 4)  # the last token fed or not
    for wrong, held in ((wide.make_cache(), "a float cache"), (wide.make_cache(4), "a 4-bit cache")):
        wide.engine.prefill(PROMPT[:3], wrong)
        with pytest.raises(InvalidArgumentError, match=f"brings {held}; this batch holds 8-bit caches"):
            decoder.add([BatchRow(1, PROMPT, SamplingParams(), cache=wrong)])
    single = wide.make_cache(8)
    assert [t for _, t in sum(first, [])] == greedy(wide, single, 4)


def test_batch_cli_with_kv_bits_writes_what_generate_gives(wide, wide_dir, tmp_path):
    from umakit.cli.main import main

    prompts = ["The quick", "Paris is the capital of", "One two"]
    (tmp_path / "in.jsonl").write_text("".join(json.dumps({"id": i, "prompt": p}) + "\n" for i, p in enumerate(prompts)))
    out = tmp_path / "out.jsonl"
    r = CliRunner().invoke(main, ["batch", str(wide_dir), "-i", str(tmp_path / "in.jsonl"), "-o", str(out), "--raw",
                                  "--temp", "0", "--max-tokens", "8", "--kv-bits", "4", "-b", "2", "--backend",
                                  "torch", "--device", "cpu", "--dtype", "float32"])
    assert r.exit_code == 0, r.output
    rows = {row["id"]: row["text"] for row in map(json.loads, out.read_text().splitlines())}
    assert rows == {i: wide.generate(p, kv_bits=4, raw=True, max_tokens=8, temperature=0).text
                    for i, p in enumerate(prompts)}


def test_the_server_scheduler_quantizes_every_requests_cache(wide):
    """`serve --kv-bits 8`: concurrent requests, then a follow-up turn that finds its quantized cache."""
    import asyncio

    from umakit.serve.scheduler import Scheduler
    from umakit.serve.types import FinalEvent, GenerationRequest, SchedulerSettings, TokenEvent

    greedy_ = SamplingParams(temperature=0)
    loop = asyncio.new_event_loop()

    def run(requests):
        async def collect(h):
            events = []
            while not isinstance(events[-1:] and events[-1], FinalEvent):
                events.append(await asyncio.wait_for(h.queue.get(), 60))
            return [e.token for e in events if isinstance(e, TokenEvent)], events[-1]
        handles = [s.submit(q, loop) for q in requests]

        async def all_of():
            return await asyncio.gather(*(collect(h) for h in handles))
        return loop.run_until_complete(all_of())

    s = Scheduler(wide, SchedulerSettings(kv_bits=8, prefill_chunk=4))
    s.start()
    try:
        prompts = [wide.encode(p, raw=True) for p in ("The quick brown fox", "Paris is", "One two three")]
        results = run([GenerationRequest(p, 10, greedy_) for p in prompts])
        for p, (tokens, _) in zip(prompts, results):
            alone = wide.engine.generate_tokens(p, wide.make_cache(8), greedy_)
            assert tokens == [next(alone) for _ in range(len(tokens))]
        follow = prompts[0] + results[0][0] + wide.encode(" and", raw=True)
        ((tokens, final),) = run([GenerationRequest(follow, 6, greedy_)])
        assert final.usage.cached_tokens > len(prompts[0])  # the stored quantized cache was taken
        stream = wide.engine.generate_tokens(follow, wide.make_cache(8), greedy_)
        assert tokens == [next(stream) for _ in range(len(tokens))]
        assert s.metrics()["requests_failed_total"] == 0
    finally:
        s.stop()
        loop.close()


def test_mlx_batches_refuse_kv_bits_naming_the_flag(wide_dir, tmp_path):
    pytest.importorskip("mlx_lm")
    from umakit.cli.main import main

    model = umakit.load(wide_dir, backend="mlx", device="cpu")
    with pytest.raises(InvalidArgumentError, match="does not support --kv-bits in a batch"):
        model.generate_batch(["The"], kv_bits=8, max_tokens=2)
    (tmp_path / "in.jsonl").write_text('{"id": 1, "prompt": "The"}\n')
    r = CliRunner().invoke(main, ["batch", str(wide_dir), "-i", str(tmp_path / "in.jsonl"), "-o",
                                  str(tmp_path / "out.jsonl"), "--kv-bits", "8", "--backend", "mlx", "--device", "cpu"])
    assert r.exit_code != 0 and "--kv-bits" in r.output and "Traceback" not in r.output
    assert not (tmp_path / "out.jsonl").exists() or not (tmp_path / "out.jsonl").read_text()


def test_generate_with_kv_bits_through_the_api_and_the_cli(wide, wide_dir):
    from umakit.cli.main import main

    reply = dict(raw=True, max_tokens=8, temperature=0)
    quantized = wide.generate("The quick", kv_bits=8, **reply)
    assert quantized.tokens == wide.generate("The quick", **reply).tokens
    # speculation trims the cache back and verifies several tokens in one pass over it
    assert wide.generate("The quick", kv_bits=8, prompt_lookup=True, **reply).tokens == quantized.tokens
    r = CliRunner().invoke(main, ["generate", "-m", str(wide_dir), "-p", "The quick", "--raw", "--temp", "0",
                                  "--max-tokens", "8", "--kv-bits", "8", "--backend", "torch", "--device", "cpu",
                                  "--dtype", "float32", "--json"])
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["tokens"] == quantized.tokens


def test_chat_turns_reuse_a_quantized_cache_as_a_fresh_one_would(wide):
    """`umakit run --kv-bits 8`: each turn trims the cache back to the shared prefix and prefills the rest."""
    from umakit.generate.chat import ChatSession, ChatSettings

    settings = ChatSettings(max_tokens=6, sampling=SamplingParams(temperature=0), kv_bits=8)
    chat = ChatSession(wide, settings)
    for i, text in enumerate(["The quick brown", "fox jumps over", "the lazy dog"]):
        infos = []
        reply = "".join(c.text for c in chat.send(text, on_ready=infos.append))
        assert chat.cache.kv_bits == 8 and chat.cache.offset == len(chat.cached_ids)
        assert (infos[0].reused_tokens > 0) == (i > 0)
        fresh = ChatSession(wide, settings)
        fresh.messages = chat.messages[:-2]  # the history before this turn
        assert reply == "".join(c.text for c in fresh.send(text))


# -- agreement with the MLX engine ------------------------------------------------
@pytest.fixture(scope="module")
def mlx_wide(wide_dir):
    pytest.importorskip("mlx_lm")
    return umakit.load(wide_dir, backend="mlx", device="cpu", dtype="float32")


def test_torch_and_mlx_count_and_hold_the_same_bytes_per_token(wide, mlx_wide):
    tokens = (PROMPT * 9)[:256]  # one whole growth step of either cache: its bytes per token are exact
    for bits in (None, *BITS):
        per_token = wide.engine.kv_bytes_per_token(bits)
        assert per_token == mlx_wide.engine.kv_bytes_per_token(bits)
        for model in (wide, mlx_wide):
            cache = model.make_cache(bits)
            model.engine.prefill(tokens, cache)
            assert cache.kv_bits == bits and cache.nbytes == per_token * len(tokens)


def test_torch_and_mlx_refuse_the_same_widths_and_heads_alike(wide, mlx_wide, tiny_dir):
    narrow = [umakit.load(tiny_dir("llama"), backend=name, device="cpu", dtype="float32") for name in ("torch", "mlx")]
    for models, bits in (((wide, mlx_wide), 3), ((wide, mlx_wide), 16), (narrow, 8)):
        messages = set()
        for model in models:
            with pytest.raises(InvalidArgumentError) as refused:
                model.make_cache(kv_bits=bits)
            messages.add(str(refused.value))
        assert len(messages) == 1, messages
    assert messages == {"a quantized KV cache needs a head size divisible by 64; this model's is 16"}
    for model in (wide, mlx_wide):
        assert {model.make_cache(bits).kv_bits for bits in BITS} == set(KV_BITS)
