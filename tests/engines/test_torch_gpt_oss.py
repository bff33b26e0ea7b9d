"""gpt-oss on the torch engine's compact code (model/openai_moe.py): attention sinks, sliding layers, yarn RoPE
unrounded, its router and clamped-SwiGLU experts with biases. Both layouts users download: transformers' float
save and OpenAI's MXFP4 (held exactly at 5 bits, load/openai_experts.py). transformers' GptOssForCausalLM is the oracle;
batch rows, the CUDA-graph step run eagerly, a quantized KV cache and offloaded experts against lone runs."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

import umakit
from support import mxfp4
from support.oracle import MAX_TOKENS, PROMPTS, batched_prompts, greedy_reference, ref_logits, sequential
from umakit.generate.sampling import SamplingParams

transformers = pytest.importorskip("transformers")

PROMPT = [(7 * i) % 400 + 3 for i in range(40)]  # past the sliding window of 8
GREEDY = SamplingParams(temperature=0)


@pytest.fixture(scope="module")
def float_checkpoint(tmp_path_factory):
    path = mxfp4.write(tmp_path_factory.mktemp("gpt_oss_float"), packed=False)
    return path, transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def packed_checkpoint(tmp_path_factory):
    path = mxfp4.write(tmp_path_factory.mktemp("gpt_oss_mxfp4"), seed=1)
    return path, mxfp4.reference(path)


def greedy(model, prompt, n=10):
    tokens = model.engine.generate_tokens(prompt, model.make_cache(), GREEDY)
    return [next(tokens) for _ in range(n)]


@pytest.mark.parametrize("which", ["float_checkpoint", "packed_checkpoint"])
def test_logits_and_greedy_tokens_are_transformers(request, which):
    path, ref = request.getfixturevalue(which)
    model = umakit.load(path, dtype="float32")
    assert model.info.backend == "torch" and model.engine._fused is None
    want = ref_logits(ref, PROMPT)
    np.testing.assert_allclose(model.logits(PROMPT), want, atol=1e-4 * np.abs(want).max(), rtol=0)
    assert greedy(model, PROMPT, 12) == greedy_reference(ref, PROMPT, 12)


def test_mxfp4_experts_are_held_at_5_bits_exactly(packed_checkpoint):
    """Every expert's projection dequantizes bit for bit to transformers' reading of the MXFP4 blocks."""
    path, _ = packed_checkpoint
    model = umakit.load(path, backend="torch", device="cpu", dtype="float32")
    want = mxfp4.dequantized(path)
    experts = model.engine.model.model.layers[1].mlp.switch_mlp
    n = mxfp4.CONFIG["num_local_experts"]
    for name in ("gate_up_proj", "down_proj"):
        held = getattr(experts, name)
        assert held.bits == 5 and held.group_size == 32 and held.weight.dtype == torch.uint32
        w, b = held.picked(torch.arange(n), torch.float32)
        stored = want[f"model.layers.1.mlp.experts.{name}"]  # (experts, in, out), as transformers holds it
        torch.testing.assert_close(w, stored.transpose(1, 2), rtol=0, atol=0)
        torch.testing.assert_close(b, want[f"model.layers.1.mlp.experts.{name}_bias"], rtol=0, atol=0)
    assert model.info.weights.quantization.startswith("5-bit g32")


def test_sinks_take_their_share_of_the_attention(float_checkpoint):
    """Without its sinks the model's logits leave transformers': the oracle test would see them dropped."""
    path, ref = float_checkpoint
    model = umakit.load(path, backend="torch", device="cpu", dtype="float32")
    for layer in model.engine.model.model.layers:
        layer.self_attn.sinks.data.fill_(-1e4)
    want = ref_logits(ref, PROMPT)
    assert np.abs(model.logits(PROMPT) - want).max() > 1e-3 * np.abs(want).max()


def test_greedy_batch_rows_equal_lone_runs(packed_checkpoint):
    path, _ = packed_checkpoint
    model = umakit.load(path, backend="torch", device="cpu", dtype="float32")
    expected = sequential(model, PROMPTS, max_tokens=MAX_TOKENS, temperature=0)
    run = model.generate_batch(batched_prompts(PROMPTS), max_tokens=MAX_TOKENS, temperature=0, batch_size=4,
                               raw=True)
    assert [r.tokens for r in run] == [r.tokens for r in expected]


def test_static_decode_step_equals_eager(packed_checkpoint):
    """The CUDA-graph decode step (a fixed span under a mask, experts gathered), run eagerly on a CPU."""
    from support.oracle import static_steps

    path, _ = packed_checkpoint
    model = umakit.load(path, backend="torch", device="cpu", dtype="float32")
    np.testing.assert_allclose(static_steps(model, PROMPT[:20], 3), model.logits(PROMPT[:20])[3:], atol=1e-4,
                               rtol=1e-4)


def test_offloaded_experts_give_the_resident_logits(packed_checkpoint):
    """Layer 1's experts in host memory, copied as they are picked (their biases too)."""
    path, _ = packed_checkpoint
    resident = umakit.load(path, backend="torch", device="cpu", dtype="float32")
    streamed = umakit.load(path, backend="torch", device="cpu", dtype="float32", gpu_layers=1)
    assert streamed.engine.experts_streamer is not None and streamed.engine.offload.offloaded_layers == (1,)
    np.testing.assert_array_equal(streamed.logits(PROMPT), resident.logits(PROMPT))
    assert greedy(streamed, PROMPT, 8) == greedy(resident, PROMPT, 8)


def test_an_8_bit_kv_cache_gives_the_float_caches_tokens(tmp_path):
    """With gpt-oss's own head size (64, whole groups of the quantized cache)."""
    path = mxfp4.write(tmp_path / "m", head_dim=64)
    model = umakit.load(path, backend="torch", device="cpu", dtype="float32")
    tokens = model.engine.generate_tokens(PROMPT, model.make_cache(kv_bits=8), GREEDY)
    assert [next(tokens) for _ in range(8)] == greedy(model, PROMPT, 8)


@pytest.mark.parametrize("bits", [None, 4])
def test_a_synthetic_gpt_oss_has_the_checkpoint_shapes(bits):
    config = {**json.loads(json.dumps(mxfp4.CONFIG)), "model_type": "gpt_oss", "attention_bias": True}
    m = umakit.load_synthetic(config, backend="torch", device="cpu", dtype="float32", bits=bits, group_size=32)
    logits = m.engine.logits(PROMPT)
    assert logits.shape == (len(PROMPT), config["vocab_size"]) and np.isfinite(logits).all()


def test_a_missing_scales_tensor_is_named(tmp_path):
    from safetensors.torch import load_file, save_file

    path = mxfp4.write(tmp_path / "m")
    tensors = load_file(path / "model.safetensors")
    del tensors["model.layers.0.mlp.experts.down_proj_scales"]
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(umakit.errors.CheckpointError, match="down_proj_scales"):
        umakit.load(path, backend="torch", device="cpu", dtype="float32")


def test_the_cpu_default_runs_each_expert_on_the_packed_kernel(tmp_path, monkeypatch):
    """"auto" on a CPU: one packed layer an expert (quant/forms.py `pack_experts`), within the kernel's tolerance
    of transformers; the packing kept under $UMAKIT_HOME, so the next load reads no MXFP4 block, packs nothing and
    gives the same bits."""
    from umakit.backends.torch.cpu import affine_kernel

    if not affine_kernel.available():
        pytest.skip(f"umakit's CPU kernel is not built here ({affine_kernel.__name__})")
    monkeypatch.setenv("UMAKIT_HOME", str(tmp_path / "home"))
    path = mxfp4.write(tmp_path / "m", seed=1)
    ref = mxfp4.reference(path)
    model = umakit.load(path, backend="torch", device="cpu")
    experts = model.engine.model.model.layers[0].mlp.switch_mlp
    assert all(len(p.forms) == mxfp4.CONFIG["num_local_experts"] for p in (experts.gate_up_proj, experts.down_proj))
    assert "packed kernels" in model.info.weights.quantization
    want = ref_logits(ref, PROMPT)
    first = model.logits(PROMPT)
    np.testing.assert_allclose(first, want, atol=5e-3 * np.abs(want).max(), rtol=0)
    assert greedy(model, PROMPT, 8) == greedy_reference(ref, PROMPT, 8)
    assert list((tmp_path / "home" / "packed").glob("*.safetensors"))

    def repacked(*args):
        raise AssertionError("packed again")

    from umakit.backends.torch.load import openai_experts

    monkeypatch.setattr(affine_kernel, "planes", repacked)
    monkeypatch.setattr(openai_experts, "packed_codes", repacked)  # the blocks are not even read
    again = umakit.load(path, backend="torch", device="cpu")
    np.testing.assert_array_equal(again.logits(PROMPT), first)


def test_a_scale_outside_float16s_range_keeps_that_projection_stacked(tmp_path):
    """An exponent of 2^20 (16 steps overflow float16, which the packed planes hold): that layer's down_proj stays
    stacked and dequantizes its picked experts each step, exactly (bfloat16 steps); the rest run packed."""
    from safetensors.torch import load_file, save_file

    from umakit.backends.torch.cpu import affine_kernel

    if not affine_kernel.available():
        pytest.skip("umakit's CPU kernel is not built here")
    path = mxfp4.write(tmp_path / "m", seed=1)
    tensors = load_file(path / "model.safetensors")
    tensors["model.layers.0.mlp.experts.down_proj_scales"][2, 0, 0] = 127 + 20
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    model = umakit.load(path, backend="torch", device="cpu")
    experts = model.engine.model.model.layers[0].mlp.switch_mlp
    assert experts.down_proj.forms is None and experts.gate_up_proj.forms is not None
    want = ref_logits(mxfp4.reference(path), PROMPT)
    np.testing.assert_allclose(model.logits(PROMPT), want, atol=5e-3 * np.abs(want).max(), rtol=0)


def test_a_kept_packing_that_does_not_fit_is_refused_not_run(tmp_path, monkeypatch):
    """A later load reads no MXFP4 blocks where the kept packing has every expert's layer; should that packing not
    fit (a format changed), the load says so instead of running codes it never read."""
    from umakit.backends.torch.cpu import affine_kernel

    if not affine_kernel.available():
        pytest.skip("umakit's CPU kernel is not built here")
    monkeypatch.setenv("UMAKIT_HOME", str(tmp_path / "home"))
    path = mxfp4.write(tmp_path / "m", seed=2)
    umakit.load(path, backend="torch", device="cpu")
    monkeypatch.setattr(affine_kernel.AffineLinear, "_fits", staticmethod(lambda *a: False))
    with pytest.raises(umakit.errors.CheckpointError, match="does not fit this load"):
        umakit.load(path, backend="torch", device="cpu")


def test_deterministic_gives_every_token_its_decode_steps_bits(packed_checkpoint, monkeypatch):
    """--deterministic on gpt-oss's eager layers: sinks, a sliding window, MXFP4 experts, past the GEMM crossover
    (lowered to 4 rows)."""
    from support import exact
    from umakit.backends.torch.cpu import affine_kernel

    monkeypatch.setattr(affine_kernel, "dense_rows", lambda: 4)
    model = umakit.load(packed_checkpoint[0], backend="torch", device="cpu", deterministic=True)
    exact.assert_exact(model.engine, PROMPT[:30])
