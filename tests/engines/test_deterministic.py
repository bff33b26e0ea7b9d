"""--deterministic (`Engine.make_deterministic`, torch engine on a CPU): every token gets the bits of its own
decode step, on the fused step and on the eager layers, so a prompt's split (a prompt cache's prefix, slices,
chunks), the rows beside it and a reply's own tokens change nothing; what cannot keep that is refused by name."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
from click.testing import CliRunner

import umakit
from umakit.backends.torch.cpu import affine_kernel
from umakit.cli.main import main
from umakit.errors import InvalidArgumentError
from umakit.generate.sampling import SamplingParams
from umakit.serve.scheduler import Scheduler
from umakit.serve.types import GenerationRequest, SchedulerSettings

from support import exact
from support.exact import greedy
from support.markers import requires_default_model
from support.serve_helpers import answers

GREEDY = SamplingParams(temperature=0)
TEXT = "It is a truth universally acknowledged, that a single man in possession of a good fortune, must be in want"


@pytest.mark.parametrize("family, kv_bits", [("qwen2", None), ("qwen2", 8), ("qwen3_moe", None), ("gemma3", None),
                                             ("mixtral", 4)])
def test_every_token_gets_its_own_decode_steps_bits(quantized, family, kv_bits, monkeypatch):
    """On the fused step (qwen2's float cache) and on the eager layers (the mixtures, gemma3's sliding window, and
    any family over a quantized KV cache): splits, one call against one-token calls, and batch rows, past the
    kernel's GEMM crossover (lowered to 4 rows here, so on every CPU)."""
    monkeypatch.setattr(affine_kernel, "dense_rows", lambda: 4)
    extra = {"hidden_size": 256} if kv_bits else {}  # heads of 64: a quantized KV cache's groups
    model = umakit.load(quantized(family, 4, **extra), backend="torch", device="cpu", dtype="bfloat16",
                        deterministic=True)
    assert model.info.deterministic and (model.engine._fused is not None) == (family == "qwen2")
    exact.assert_exact(model.engine, model.tokenizer.encode(TEXT), kv_bits)


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


def test_what_cannot_keep_the_bits_is_refused_by_name(quantized, tiny_dir):
    model = umakit.load(quantized("qwen2", 4), backend="torch", device="cpu", dtype="bfloat16", deterministic=True)
    with pytest.raises(InvalidArgumentError, match="--mixed-steps and --deterministic"):
        model.engine.batch_decoder(mixed=True)
    with pytest.raises(InvalidArgumentError, match=r"--deterministic: its layer .* runs as Linear, whose rows share "
                                                   r"a GEMM \(load it quantized\)"):
        umakit.load(tiny_dir("llama"), backend="torch", device="cpu", dtype="float32", deterministic=True)
    for backend in ("mlx", "transformers"):
        with pytest.raises(InvalidArgumentError, match=f"the {backend} backend does not support --deterministic"):
            umakit.load(tiny_dir("llama"), backend=backend, deterministic=True)


def test_serve_refuses_mixed_steps_with_it_before_loading():
    r = CliRunner().invoke(main, ["serve", "--deterministic", "--mixed-steps"])
    assert r.exit_code == 2 and "--deterministic does not take --mixed-steps" in r.output, r.output


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
        firsts = answers(scheduler, loop, [GenerationRequest(p, 24, GREEDY) for p in prompts])
        for convo, (tokens, _) in zip(convos, firsts):
            convo += [{"role": "assistant", "content": model.tokenizer.decode(tokens)},
                      {"role": "user", "content": "Tell me more about it in two sentences."}]
        seconds = answers(scheduler, loop, [GenerationRequest(model.encode(None, c, None, False), 32, GREEDY)
                                             for c in convos])
    finally:
        scheduler.stop()
        loop.close()
    for prompt, (tokens, _) in zip(prompts, firsts):
        assert tokens == greedy(model.engine, prompt, 0, len(tokens))
    assert sum(final.usage.cached_tokens for _, final in seconds) > 0
    for convo, (tokens, _) in zip(convos, seconds):
        assert tokens == greedy(model.engine, model.encode(None, convo, None, False), 0, len(tokens))
