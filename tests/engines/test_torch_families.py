"""gemma3 and the mixture-of-experts families on the torch engine's other paths (CPU, float32):
the batch decoder, the CUDA-graph decode step run eagerly, streamed (offloaded) layers, synthetic torch_models."""

import numpy as np
import pytest
import torch

import umakit
from umakit.generate.sampling import SamplingParams
from support.oracle import MAX_TOKENS, PROMPT, PROMPTS, batched_prompts, sequential

FAMILIES = ["gemma3", "mixtral", "qwen3_moe"]


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_batch_equals_sequential(torch_models, family):
    """Rows at their own positions (past gemma3's window of 8; several tokens routed at once)."""
    model = torch_models(family)
    expected = sequential(model, PROMPTS, max_tokens=MAX_TOKENS, temperature=0)
    run = model.generate_batch(batched_prompts(PROMPTS), max_tokens=MAX_TOKENS, temperature=0, batch_size=4,
                               raw=True)
    assert [r.tokens for r in run] == [r.tokens for r in expected], family


@pytest.mark.parametrize("family", FAMILIES)
def test_static_decode_step_equals_eager(torch_models, family):
    """The CUDA-graph decode step (fixed span under a mask, experts gathered), run eagerly on CPU."""
    from umakit.backends.torch.cuda.graphs import GraphDecoder

    model = torch_models(family)
    step = GraphDecoder(model.engine.model, capture=False)
    cache = model.make_cache()
    model.engine.prefill(PROMPT[:3], cache)
    with torch.inference_mode():
        got = [step(torch.tensor([t]), cache)[0].numpy() for t in PROMPT[3:]]
    np.testing.assert_allclose(np.stack(got), model.logits(PROMPT)[3:], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("family", FAMILIES)
def test_streamed_layers_give_the_resident_tokens(torch_models, tiny_dir, family):
    resident = torch_models(family)
    streamed = umakit.load(tiny_dir(family), backend="torch", device="cpu", dtype="float32", gpu_layers=1)
    assert streamed.engine.offload.offloaded_layers
    np.testing.assert_array_equal(streamed.logits(PROMPT), resident.logits(PROMPT))
    greedy = SamplingParams(temperature=0)
    a = streamed.engine.generate_tokens(PROMPT, streamed.make_cache(), greedy)
    b = resident.engine.generate_tokens(PROMPT, resident.make_cache(), greedy)
    assert [next(a) for _ in range(12)] == [next(b) for _ in range(12)]


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("bits", [None, 4])
def test_synthetic_model_has_the_checkpoint_shapes(tiny_dir, family, bits):
    """A random model of the family's config runs (benchmarks), quantized experts included."""
    import json

    config = json.loads((tiny_dir(family) / "config.json").read_text())
    m = umakit.load_synthetic(config, backend="torch", device="cpu", dtype="float32", bits=bits, group_size=32)
    logits = m.engine.logits(PROMPT)
    assert logits.shape == (len(PROMPT), config["vocab_size"]) and np.isfinite(logits).all()


def test_routing_uses_more_than_one_expert_per_token(torch_models):
    """The tiny MoE configs route each token to two of four experts, and different tokens to different ones."""
    moe = torch_models("mixtral").engine.model.model.layers[0].block_sparse_moe
    x = torch.randn(32, moe.gate.in_features)
    weights, idx = moe.route(x)
    assert idx.shape == (32, 2) and len(torch.unique(idx)) == 4
    torch.testing.assert_close(weights.sum(-1), torch.ones(32))


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe"])
def test_moe_offload_copies_only_the_picked_experts(torch_models, tiny_dir, family):
    """Routed experts of the streamed layer live in host memory; a decode step copies the 2 of 4 it picked."""
    from umakit.plan.placement import ROUTED_EXPERTS

    m = umakit.load(tiny_dir(family), backend="torch", device="cpu", dtype="float32", gpu_layers=1)
    plan, streamer = m.engine.offload, m.engine.experts_streamer
    assert plan.placement == ROUTED_EXPERTS and plan.offloaded_layers == (1,) and m.engine.model.streamer is None
    switch = m.engine.model.model.layers[1]._modules[m.engine.args.ffn_name].switch_mlp
    per_expert = sum(p.weight[0].nbytes for p in (switch.gate_proj, switch.up_proj, switch.down_proj))
    assert plan.streamed_bytes == m.info.weights.streamed_bytes_per_token == 2 * per_expert
    assert streamer.host_bytes == 4 * per_expert
    np.testing.assert_array_equal(m.logits(PROMPT), torch_models(family).logits(PROMPT))  # bit-identical

    cache = m.make_cache()
    m.engine.prefill(PROMPT, cache)
    for t in PROMPT[:6]:  # one token a step: two experts, each of its three projections copied once
        before = streamer.copied_bytes
        m.engine.logits([t], cache)
        assert streamer.copied_bytes - before == 2 * per_expert

    streamer.cached = 4  # keep every expert on the device: copies stop once each was seen
    for t in PROMPT:
        m.engine.logits([t], cache)
    before = streamer.copied_bytes
    m.engine.logits([PROMPT[0]], cache)
    assert streamer.copied_bytes == before and streamer.hit_rate > 0.5


def test_moe_offload_budget_keeps_more_experts_resident_as_it_grows(tiny_dir):
    from umakit.errors import DoesNotFitError

    path = tiny_dir("mixtral")
    whole = umakit.load(path, backend="torch", device="cpu", dtype="float32", gpu_layers=2).engine.offload
    one = umakit.load(path, backend="torch", device="cpu", dtype="float32", gpu_layers=1).engine.offload
    kept = []
    for extra in (0, whole.resident_bytes):  # room for the dense parts and a ring of picked experts; for all
        budget = whole.fixed_bytes + whole.reserved_bytes + 3 * one.streamed_bytes + extra
        kept.append(umakit.load(path, backend="torch", device="cpu", dtype="float32",
                                vram_budget=budget).engine.offload.gpu_layers)
    assert kept[0] < kept[1] == 2
    with pytest.raises(DoesNotFitError):
        umakit.load(path, backend="torch", device="cpu", vram_budget=whole.fixed_bytes // 2)


@pytest.mark.parametrize("family", FAMILIES)
def test_speculation_is_lossless(torch_models, family):
    """Trimming the cache after rejected proposals (gemma3: past its window, masked in the full cache)."""
    model = torch_models(family)
    prompt = "The quick brown fox jumps over the lazy dog. The quick brown"
    plain = model.generate(prompt, raw=True, max_tokens=32, temperature=0)
    assert model.generate(prompt, raw=True, max_tokens=32, temperature=0, prompt_lookup=True).tokens == plain.tokens


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe"])
def test_quantized_experts_run_one_packed_layer_each_on_the_cpu_default(tiny_dir, tmp_path, family):
    """`umakit quantize`'s 4-bit experts on the CPU default: each expert its own layer on umakit's packed kernel
    (quant/forms.py `pack_experts`), the stacked codes dropped; greedy tokens those of the same quantized weights
    dequantized in float32."""
    from click.testing import CliRunner

    from umakit.backends.torch.cpu import affine_kernel
    from umakit.cli.main import main

    if not affine_kernel.available():
        pytest.skip("umakit's CPU kernel is not built here")
    out = tmp_path / "q4"
    result = CliRunner().invoke(main, ["quantize", str(tiny_dir(family)), "-o", str(out), "--bits", "4",
                                       "--group-size", "32"])
    assert result.exit_code == 0, result.output
    packed = umakit.load(out, backend="torch", device="cpu")
    exact = umakit.load(out, backend="torch", device="cpu", dtype="float32")
    moe = packed.engine.model.model.layers[0]._modules[packed.engine.args.ffn_name].switch_mlp
    assert len(moe.gate_proj.forms) == 4 and "weight" not in moe.gate_proj._buffers
    assert exact.engine.model.model.layers[0]._modules[exact.engine.args.ffn_name].switch_mlp.gate_proj.forms is None
    greedy = SamplingParams(temperature=0)
    ours = packed.engine.generate_tokens(PROMPT, packed.make_cache(), greedy)
    want = exact.engine.generate_tokens(PROMPT, exact.make_cache(), greedy)
    assert [next(ours) for _ in range(12)] == [next(want) for _ in range(12)]
