"""gemma4 (text) on the torch engine's compact code (model/gemma4.py): tiny random checkpoints saved by the
installed transformers, one of its defaults and one with every per-layer feature (global heads of another size
and count, values from the keys' projection, partial RoPE, layers sharing earlier layers' keys and values,
double-wide MLPs there, per-layer inputs, soft-capped logits). Logits and greedy tokens against transformers,
the 4-bit packed forms against the same weights in float32, batch rows and prompt lookup against lone runs, a
quantized KV cache, a reused cache, a multimodal checkpoint's language model, the mixture-of-experts block
(26B-A4B's) in both checkpoint layouts, and "auto" for what the compact code lacks going on to the transformers
engine."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

import umakit
from support.oracle import greedy_reference, ref_logits, reference
from support.tiny import VOCAB, write_tokenizer
from umakit.backends.base import BatchRow
from umakit.backends.torch.cpu import build
from umakit.backends.torch.model.norm import Norm
from umakit.generate.sampling import SamplingParams

transformers = pytest.importorskip("transformers")

GREEDY = SamplingParams(temperature=0)
S, F = "sliding_attention", "full_attention"
SMALL = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
             head_dim=16, max_position_embeddings=512, bos_token_id=1, eos_token_id=2, pad_token_id=0,
             sliding_window=8)
VARIANTS = {
    # transformers' defaults for what the config leaves out: global heads of 512, a quarter of them turned
    "defaults": dict(num_hidden_layers=3, layer_types=[S, S, F], hidden_size_per_layer_input=0),
    "every-feature": dict(num_hidden_layers=6, layer_types=[S, F, S, F, S, F], global_head_dim=32,
                          num_global_key_value_heads=1, attention_k_eq_v=True, num_kv_shared_layers=2,
                          use_double_wide_mlp=True, vocab_size_per_layer_input=VOCAB,
                          hidden_size_per_layer_input=16, final_logit_softcapping=30.0),
}
PROMPT = [(7 * i) % 400 + 3 for i in range(40)]  # longer than the sliding window


def make(path, tokenizer=write_tokenizer, **extra):
    config = transformers.Gemma4TextConfig(**{**SMALL, **extra})
    torch.manual_seed(0)
    model = transformers.Gemma4ForCausalLM(config)
    with torch.no_grad():
        for name, t in [*model.named_parameters(), *model.named_buffers()]:
            if name.endswith(("q_norm.weight", "k_norm.weight")):
                t.fill_(0.25)  # unscaled scores of unit-normed heads make a random model chaotic; real ones are not
            if name.endswith("layer_scalar"):
                t.fill_(0.7)  # not 1, so a scalar left out would show
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path, safe_serialization=True)
    tokenizer(path)
    return path


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def gemma4(request, tmp_path_factory):
    return request.param, make(tmp_path_factory.mktemp(request.param), **VARIANTS[request.param])


def greedy(model, prompt, n, cache=None):
    tokens = model.engine.generate_tokens(prompt, cache if cache is not None else model.make_cache(), GREEDY)
    return [next(tokens) for _ in range(n)]


def test_gemma4_runs_on_the_compact_code_as_transformers_runs_it(gemma4):
    name, path = gemma4
    model = umakit.load(path, dtype="float32")
    assert model.info.backend == "torch" and type(model.engine.model).__name__ == "Gemma4Transformer"
    norms = [m for m in model.engine.model.modules() if isinstance(m, Norm)]
    assert norms and all(m.native == build.ensure() for m in norms)  # each one call of csrc/norm.cpp
    layers = model.engine.model.args.gemma4
    if name == "every-feature":
        assert layers.slots == (0, 1, 2, 3, 2, 3) and layers.shared == (False,) * 4 + (True,) * 2
        assert layers.k_eq_v == (False, True) * 3 and layers.head_dims == (16, 32) * 3
    ref = reference(path)
    want = ref_logits(ref, PROMPT)
    np.testing.assert_allclose(model.logits(PROMPT), want, atol=1e-5 * np.abs(want).max(), rtol=0)
    assert greedy(model, PROMPT, 12) == greedy_reference(ref, PROMPT, 12)


def test_the_cache_holds_each_layer_kind_at_its_own_size(gemma4):
    """Sliding slots at 2 x 16, global ones at their own size; shared layers hold none (every-feature)."""
    name, path = gemma4
    model = umakit.load(path, backend="torch", dtype="float32")
    cache = model.make_cache()
    model.engine.prefill(PROMPT, cache)
    glob = (2, 512) if name == "defaults" else (1, 32)
    slots = [(2, 16), (2, 16), glob] if name == "defaults" else [(2, 16), glob] * 2
    assert cache.offset == len(PROMPT)
    assert model.engine.kv_bytes_per_token() == sum(2 * h * d * 4 for h, d in slots)
    assert cache.nbytes == model.engine.kv_bytes_per_token() * cache.capacity


def test_a_reused_cache_continues_as_a_fresh_run(gemma4):
    """A cache trimmed back, and a copy of its first tokens, continue as a run that prefilled everything."""
    _, path = gemma4
    model = umakit.load(path, backend="torch", dtype="float32")
    fresh = greedy(model, PROMPT, 8)
    cache = model.make_cache()
    model.engine.prefill(PROMPT + [5, 6, 7], cache)
    copied = cache.copy(20)
    assert cache.trim(4) == 4 and cache.offset == len(PROMPT) - 1
    assert greedy(model, PROMPT[cache.offset:], 8, cache) == fresh  # a cache given holds the prompt's start
    assert copied.offset == 20 and greedy(model, PROMPT[20:], 8, copied) == fresh


def test_a_4_bit_gemma4_decodes_as_its_float_twin_on_its_packed_forms(gemma4, tmp_path):
    """`umakit quantize`'s 4-bit form on the CPU default (packed kernels, its float layers as float16 weights)
    against the same quantized weights in float32."""
    from click.testing import CliRunner

    from umakit.cli.main import main

    _, path = gemma4
    out = tmp_path / "q4"
    result = CliRunner().invoke(main, ["quantize", str(path), "-o", str(out), "--bits", "4", "--group-size", "32"])
    assert result.exit_code == 0, result.output
    packed = umakit.load(out, backend="torch", device="cpu")
    exact = umakit.load(out, backend="torch", device="cpu", dtype="float32")
    assert packed.info.weights.quantization.startswith("4-bit") and packed.engine.dtype == "bfloat16"
    prompt = PROMPT[:12]
    ours, want = packed.logits(prompt), exact.logits(prompt)
    assert np.abs(ours - want).max() <= 1e-2 * np.abs(want).max(), np.abs(ours - want).max()
    assert greedy(packed, prompt, 8) == greedy(exact, prompt, 8)


def test_batch_rows_give_the_lone_tokens(gemma4):
    _, path = gemma4
    model = umakit.load(path, backend="torch", dtype="float32")
    prompts = [PROMPT, PROMPT[:25], PROMPT[:9]]
    decoder = model.engine.batch_decoder()
    decoder.add([BatchRow(id=i, prompt=p, sampling=GREEDY) for i, p in enumerate(prompts)])
    got = {i: [] for i in range(len(prompts))}
    for _ in range(10):
        for rid, token in decoder.step():
            got[rid].append(token)
    assert [got[i] for i in range(len(prompts))] == [greedy(model, p, 10) for p in prompts]


@pytest.mark.parametrize("kv_bits", [None, 8])
def test_speculating_rows_keep_their_lone_tokens_in_fewer_steps(monkeypatch, tmp_path, kv_bits):
    """Proposals from the rows' lone continuations, every third one wrong (`Oracle`), verified in the batch's
    step and rolled back where wrong, with a float and an 8-bit cache (heads of 64 and 128: whole groups)."""
    from engines.test_batch_lookup import speculates_as_lone
    from umakit.backends.torch import batch_decoder

    path = make(tmp_path / "m", **{**VARIANTS["every-feature"], "head_dim": 64, "global_head_dim": 128})
    speculates_as_lone(umakit.load(path, backend="torch", device="cpu", dtype="float32"), batch_decoder, monkeypatch,
                       kv_bits)


def test_an_8_bit_kv_cache_gives_the_float_caches_tokens(tmp_path):
    """Heads of 64 and 128, whole groups of the quantized cache; a batch of 8-bit rows too."""
    path = make(tmp_path / "m", **{**VARIANTS["every-feature"], "head_dim": 64, "global_head_dim": 128})
    model = umakit.load(path, backend="torch", dtype="float32")
    want = greedy(model, PROMPT, 8)
    assert greedy(model, PROMPT, 8, model.engine.make_cache(kv_bits=8)) == want
    decoder = model.engine.batch_decoder(kv_bits=8)
    decoder.add([BatchRow(id=0, prompt=PROMPT, sampling=GREEDY)])
    assert [decoder.step()[0][1] for _ in range(8)] == want


def test_a_multimodal_checkpoints_language_model_is_the_model(gemma4, tmp_path):
    """Gemma4ForConditionalGeneration's names (``model.language_model.``) and towers beside it, left unread."""
    from safetensors.torch import load_file, save_file

    _, path = gemma4
    text = json.loads((path / "config.json").read_text())
    out = tmp_path / "mm"
    out.mkdir()
    state = {k.replace("model.", "model.language_model.", 1): v for k, v in
             load_file(path / "model.safetensors").items()}
    state["model.vision_tower.patch_embedder.weight"] = torch.zeros(4, 4)
    save_file(state, out / "model.safetensors")
    config = {"model_type": "gemma4", "architectures": ["Gemma4ForConditionalGeneration"], "text_config": text,
              "tie_word_embeddings": True}
    (out / "config.json").write_text(json.dumps(config))
    write_tokenizer(out)
    model = umakit.load(out, backend="torch", dtype="float32")
    want = umakit.load(path, backend="torch", dtype="float32").logits(PROMPT)
    np.testing.assert_array_equal(model.logits(PROMPT), want)


MOE = dict(enable_moe_block=True, num_experts=4, top_k_experts=2, moe_intermediate_size=32)


@pytest.fixture(scope="module")
def moe(tmp_path_factory):
    """gemma4's 26B-A4B layout in small: experts beside each layer's dense MLP (transformers' fused gate_up_proj)."""
    path = make(tmp_path_factory.mktemp("moe"), **VARIANTS["every-feature"], **MOE)
    from safetensors.torch import load_file, save_file

    # decisive routers, so that a wrong expert would show; scales that are not 1, so that one left out would
    scaled = {"router.proj.weight": 20.0, "router.scale": 1.3, "router.per_expert_scale": torch.linspace(0.5, 2, 4)}
    state = load_file(path / "model.safetensors")
    for k in state:
        for end, by in scaled.items():
            state[k] = state[k] * by if k.endswith(end) else state[k]
    save_file(state, path / "model.safetensors")
    return path


def test_the_mixture_of_experts_block_runs_as_transformers_runs_it(moe):
    model = umakit.load(moe, dtype="float32")
    assert model.info.backend == "torch" and model.engine.model.args.num_experts == 4
    ref = reference(moe)
    want = ref_logits(ref, PROMPT)
    np.testing.assert_allclose(model.logits(PROMPT), want, atol=1e-5 * np.abs(want).max(), rtol=0)
    assert greedy(model, PROMPT, 12) == greedy_reference(ref, PROMPT, 12)
    prompts = [PROMPT, PROMPT[:25]]
    decoder = model.engine.batch_decoder()
    decoder.add([BatchRow(id=i, prompt=p, sampling=GREEDY) for i, p in enumerate(prompts)])
    rows = [decoder.step() for _ in range(8)]
    assert [[dict(r)[i] for r in rows] for i in range(2)] == [greedy(model, p, 8) for p in prompts]


def test_a_4_bit_mixture_runs_its_experts_packed_as_its_float_twin(moe, tmp_path):
    """`umakit quantize`'s output names the experts as mlx-lm does (``switch_glu``); on the CPU default each
    expert is a packed layer of its own."""
    from click.testing import CliRunner

    from umakit.cli.main import main

    out = tmp_path / "q4"
    result = CliRunner().invoke(main, ["quantize", str(moe), "-o", str(out), "--bits", "4", "--group-size", "32"])
    assert result.exit_code == 0, result.output
    from safetensors import safe_open

    names = [k for f in out.glob("*.safetensors") for k in safe_open(str(f), "pt").keys()]
    assert any(".experts.switch_glu.gate_proj.scales" in k for k in names)
    packed = umakit.load(out, backend="torch", device="cpu")
    exact = umakit.load(out, backend="torch", device="cpu", dtype="float32")
    assert any(getattr(m, "forms", None) for m in packed.engine.model.modules())  # the experts packed one by one
    # tanh GELU, one the experts' C++ call computes: a decode step's experts in one call (experts.cpp)
    assert all(m.native_act == 1 for m in packed.engine.model.modules() if type(m).__name__ == "SwitchMLP")
    prompt = PROMPT[:12]
    ours, want = packed.logits(prompt), exact.logits(prompt)
    assert np.abs(ours - want).max() <= 1e-2 * np.abs(want).max(), np.abs(ours - want).max()
    assert greedy(packed, prompt, 8) == greedy(exact, prompt, 8)


def test_what_the_compact_code_lacks_goes_on_to_the_transformers_engine(tmp_path):
    """Bidirectional attention over all tokens: refused by the torch engine by name, run by transformers."""
    path = make(tmp_path / "bidi", **VARIANTS["defaults"], use_bidirectional_attention="all")
    with pytest.raises(umakit.errors.UnsupportedModelError, match="bidirectional"):
        umakit.load(path, backend="torch", dtype="float32")
    model = umakit.load(path, dtype="float32")
    assert model.info.backend == "transformers"
    np.testing.assert_allclose(model.logits(PROMPT[:12]), ref_logits(reference(path), PROMPT[:12]), atol=1e-4,
                               rtol=0)


def test_tensor_parallel_refuses_gemma4_by_name(gemma4):
    from umakit.backends.distributed.torch_engine import shard_config

    _, path = gemma4
    with pytest.raises(umakit.errors.UnsupportedModelError, match="gemma4"):
        shard_config(json.loads((path / "config.json").read_text()), 2)


def test_the_cuda_graph_step_run_eagerly_gives_the_prompts_logits(gemma4):
    """The CUDA-graph decode step (a fixed span of each shape's cache under a mask), run eagerly on a CPU, past
    the sliding window."""
    from support.oracle import static_steps

    _, path = gemma4
    model = umakit.load(path, backend="torch", device="cpu", dtype="float32")
    np.testing.assert_allclose(static_steps(model, PROMPT[:20], 3), model.logits(PROMPT[:20])[3:], atol=1e-5,
                               rtol=1e-5)


def test_plan_counts_the_weights_and_cache_the_engine_holds(gemma4):
    """`umakit plan` reads the same per-layer shapes: every tensor of the checkpoint, and the cache bytes a token
    costs (plan counts 16-bit elements; this engine's cache here holds float32)."""
    import math

    from safetensors import safe_open

    from umakit.plan import planner

    _, path = gemma4
    config = json.loads((path / "config.json").read_text())
    plan = planner.plan_model(config)
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        assert plan.params == sum(math.prod(f.get_slice(k).get_shape()) for k in f.keys())
    model = umakit.load(path, backend="torch", dtype="float32")
    assert plan.kv_bytes_per_token * 2 == model.engine.kv_bytes_per_token()


def test_the_servers_prompt_cache_reuses_a_gemma4_conversation_part_way(gemma4):
    """The cache trims, so the scheduler's prompt cache serves a conversation's next turn and a prompt that shares
    only its start (which the transformers engine's sliding windows cannot), each with a fresh run's tokens;
    concurrent requests batch as lone runs."""
    import asyncio

    from serve.test_scheduler import run_all, text_and_tokens
    from umakit.serve.scheduler import Scheduler
    from umakit.serve.types import GenerationRequest, SchedulerSettings

    _, path = gemma4
    model = umakit.load(path, backend="torch", dtype="float32")
    loop, s = asyncio.new_event_loop(), Scheduler(model, SchedulerSettings())
    s.start()
    try:
        first = GenerationRequest(PROMPT[:24], 10, GREEDY)
        (events,) = run_all(loop, [s.submit(first, loop)])
        _, tokens, _ = text_and_tokens(events)
        for prompt in (first.prompt + tokens + [33, 44, 55], first.prompt[:20] + [66, 77, 88]):
            (events,) = run_all(loop, [s.submit(GenerationRequest(prompt, 8, GREEDY), loop)])
            _, again, final = text_and_tokens(events)
            assert final.usage.cached_tokens >= 19 and again == greedy(model, prompt, len(again))
        both = run_all(loop, [s.submit(GenerationRequest(p, 8, GREEDY), loop) for p in (PROMPT[:30], PROMPT[5:])])
        assert [text_and_tokens(e)[1] for e in both] == [greedy(model, p, 8) for p in (PROMPT[:30], PROMPT[5:])]
    finally:
        s.stop()
        loop.close()


def test_deterministic_gives_every_token_its_decode_steps_bits(gemma4, tmp_path, monkeypatch):
    """--deterministic on gemma4's eager layers (each variant: per-layer inputs of 16 floats, whose activation a
    row at a time keeps the scalar tail a lone step's loop takes; shared KV layers; two cache shapes), past the
    GEMM crossover (lowered to 4 rows)."""
    from click.testing import CliRunner

    from support import exact
    from umakit.backends.torch.cpu import affine_kernel
    from umakit.cli.main import main

    _, path = gemma4
    out = tmp_path / "q4"
    result = CliRunner().invoke(main, ["quantize", str(path), "-o", str(out), "--bits", "4", "--group-size", "32"])
    assert result.exit_code == 0, result.output
    monkeypatch.setattr(affine_kernel, "dense_rows", lambda: 4)
    model = umakit.load(out, backend="torch", device="cpu", deterministic=True)
    exact.assert_exact(model.engine, PROMPT[:30])
