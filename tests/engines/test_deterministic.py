"""--deterministic (`Engine.make_deterministic`, torch engine on a CPU): every token gets the bits of its own
decode step, so a prompt's split (a prompt cache's prefix, slices, chunks), the rows beside it and a reply's own
tokens change nothing; what cannot keep that is refused by name."""

from __future__ import annotations

import asyncio
import itertools

import numpy as np
import pytest
from click.testing import CliRunner

import umakit
from umakit.backends import base
from umakit.backends.torch.cpu import affine_kernel
from umakit.cli.main import main
from umakit.errors import InvalidArgumentError
from umakit.generate.sampling import SamplingParams
from umakit.serve.scheduler import Scheduler
from umakit.serve.types import ErrorEvent, FinalEvent, GenerationRequest, SchedulerSettings, TokenEvent

from support.markers import requires_default_model

GREEDY = SamplingParams(temperature=0)
TEXT = "It is a truth universally acknowledged, that a single man in possession of a good fortune, must be in want"


@pytest.fixture(scope="module")
def exact(quantized):
    """A tiny quantized qwen2 (q/k/v biases, a tied head) on the CPU's fused step, made deterministic."""
    model = umakit.load(quantized("qwen2", 4), backend="torch", device="cpu", dtype="bfloat16", deterministic=True)
    assert model.engine._fused is not None and model.info.deterministic
    return model


def greedy(engine, ids: list[int], split: int, n: int = 12) -> list[int]:
    cache = engine.make_cache()
    if split:
        engine.prefill(ids[:split], cache)
    return list(itertools.islice(engine.generate_tokens(ids[split:], cache, GREEDY), n))


def test_a_prompt_split_anywhere_gives_the_same_bits(exact, monkeypatch):
    """Prefilled in two passes at any point, a prompt leaves the cache and next logits of one pass, bit for bit,
    even where the passes' row counts would take the GEMMs (crossover lowered to 4 rows here)."""
    monkeypatch.setattr(affine_kernel, "dense_rows", lambda: 4)
    engine, ids = exact.engine, exact.tokenizer.encode(TEXT)
    whole = engine.make_cache()
    engine.prefill(ids[:-1], whole)
    want = engine.logits(ids[-1:], whole)
    for split in (1, 3, 4, 9, 16, len(ids) - 2):
        cache = engine.make_cache()
        engine.prefill(ids[:split], cache)
        engine.prefill(ids[split:-1], cache)
        assert np.array_equal(engine.logits(ids[-1:], cache), want), split
        n = len(ids)  # (layers, 1, heads, positions, head size)
        assert np.array_equal(cache.k[..., :n, :], whole.k[..., :n, :]) and \
            np.array_equal(cache.v[..., :n, :], whole.v[..., :n, :])
    assert all(greedy(engine, ids, split) == greedy(engine, ids, 0) for split in (2, 7, 15))


def test_a_prefill_writes_what_decode_steps_write(exact):
    """A reply's tokens enter the cache through decode steps; a later prompt holding them prefills them with the
    same bits, so a next turn that reuses the cache is a lone run of its whole text."""
    engine, ids = exact.engine, exact.tokenizer.encode(TEXT)
    stepped, prefilled = engine.make_cache(), engine.make_cache()
    rows = np.concatenate([engine.logits([t], stepped) for t in ids])
    together = engine.logits(ids, prefilled)
    n = len(ids)
    assert np.array_equal(rows, together) and np.array_equal(stepped.k[..., :n, :], prefilled.k[..., :n, :])


def test_batch_rows_beside_any_number_of_others_keep_their_lone_tokens(exact, monkeypatch):
    """Rows of a batch (more of them than the head's GEMM crossover, lowered to 4 here) and prompts that join
    mid-run decode as their lone runs do."""
    monkeypatch.setattr(affine_kernel, "dense_rows", lambda: 4)
    engine, ids = exact.engine, exact.tokenizer.encode(TEXT)
    prompts = [ids[:5 + 2 * i] for i in range(7)]
    decoder = engine.batch_decoder()
    assert not decoder.mixes
    got: dict[int, list[int]] = {i: [] for i in range(len(prompts))}
    decoder.add([base.BatchRow(i, p, GREEDY) for i, p in enumerate(prompts[:4])])
    for step in range(14):
        if step == 3:
            decoder.add([base.BatchRow(i, p, GREEDY) for i, p in enumerate(prompts) if i >= 4])
        for rid, token in decoder.step():
            got[rid].append(token)
    for i, p in enumerate(prompts):
        lone = greedy(engine, p, 0, len(got[i]))
        assert got[i] == lone, i


def test_the_head_of_many_rows_gives_each_its_own_steps_logits(quantized, monkeypatch):
    """Without --deterministic too: logits of a verification's tokens from the fused step, past the head's GEMM
    crossover (lowered to 4 rows), are each token's own step's (16 rows of the built-in model's head once moved
    its logits by 0.15)."""
    monkeypatch.setattr(affine_kernel, "dense_rows", lambda: 4)
    model = umakit.load(quantized("llama", 4), backend="torch", device="cpu", dtype="bfloat16")
    engine, ids = model.engine, model.tokenizer.encode(TEXT)
    assert isinstance(engine.model.lm_head, affine_kernel.AffineLinear) and engine._fused is not None
    together, alone = engine.make_cache(), engine.make_cache()
    block = engine.logits(ids[:11], together)
    assert np.array_equal(block, np.concatenate([engine.logits([t], alone) for t in ids[:11]]))


def test_what_cannot_keep_the_bits_is_refused_by_name(exact, tiny_dir):
    engine = exact.engine
    for call in (lambda: engine.make_cache(8), lambda: engine.batch_decoder(kv_bits=4)):
        with pytest.raises(InvalidArgumentError, match="--deterministic does not take --kv-bits"):
            call()
    with pytest.raises(InvalidArgumentError, match="--mixed-steps and --deterministic"):
        engine.batch_decoder(mixed=True)
    with pytest.raises(InvalidArgumentError, match="does not cover llama"):  # float32 layers: no fused step
        umakit.load(tiny_dir("llama"), backend="torch", device="cpu", dtype="float32", deterministic=True)
    for backend in ("mlx", "transformers"):
        with pytest.raises(InvalidArgumentError, match=f"the {backend} backend does not support --deterministic"):
            umakit.load(tiny_dir("llama"), backend=backend, deterministic=True)


@pytest.mark.parametrize("argv, said", [
    (["generate", "--deterministic", "--kv-bits", "8", "Hi"], "--deterministic does not take --kv-bits"),
    (["serve", "--deterministic", "--mixed-steps"], "--deterministic does not take --mixed-steps"),
    (["batch", "-i", "in.jsonl", "-o", "out.jsonl", "--deterministic", "--kv-bits", "4"], "does not take --kv-bits"),
])
def test_the_cli_refuses_what_cannot_keep_the_bits_before_loading(argv, said, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "in.jsonl").write_text('{"id": 1, "prompt": "Hi"}\n')
    r = CliRunner().invoke(main, argv)
    assert r.exit_code == 2 and said in r.output, r.output


def _answers(scheduler, loop, requests):
    async def collect(handle):
        tokens = []
        while True:
            event = await asyncio.wait_for(handle.queue.get(), 120)
            if isinstance(event, TokenEvent):
                tokens.append(event.token)
            if isinstance(event, (FinalEvent, ErrorEvent)):
                assert isinstance(event, FinalEvent), event
                return tokens, event

    async def all_of(handles):
        return await asyncio.gather(*(collect(h) for h in handles))

    return loop.run_until_complete(all_of([scheduler.submit(r, loop) for r in requests]))


@requires_default_model
def test_served_turns_are_lone_runs_of_their_whole_text():
    """The built-in model behind the server's scheduler: first turns sent together, then each conversation's
    second turn, which finds its first in the prompt cache and prefills only the rest. Every reply is a lone
    greedy run of its whole prompt. Without --deterministic the second turn of "What is two plus two?" was not,
    on an AVX-512 Xeon (the reused prefix came from other passes than one prefill's)."""
    model = umakit.load(deterministic=True)
    questions = ["What is two plus two?", "Name a fruit.", "Say hello."]
    convos = [[{"role": "user", "content": q}] for q in questions]
    loop = asyncio.new_event_loop()
    scheduler = Scheduler(model, SchedulerSettings(max_concurrency=4, step_tokens=16))
    scheduler.start()
    try:
        prompts = [model.encode(None, c, None, False) for c in convos]
        firsts = _answers(scheduler, loop, [GenerationRequest(p, 24, GREEDY) for p in prompts])
        for convo, (tokens, _) in zip(convos, firsts):
            convo += [{"role": "assistant", "content": model.tokenizer.decode(tokens)},
                      {"role": "user", "content": "Tell me more about it in two sentences."}]
        seconds = _answers(scheduler, loop, [GenerationRequest(model.encode(None, c, None, False), 32, GREEDY)
                                             for c in convos])
    finally:
        scheduler.stop()
        loop.close()
    for prompt, (tokens, _) in zip(prompts, firsts):
        assert tokens == greedy(model.engine, prompt, 0, len(tokens))
    assert sum(final.usage.cached_tokens for _, final in seconds) > 0
    for convo, (tokens, _) in zip(convos, seconds):
        assert tokens == greedy(model.engine, model.encode(None, convo, None, False), 0, len(tokens))
