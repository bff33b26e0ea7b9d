"""gpt-oss as OpenAI ships it: routed experts in MXFP4 (tests/support/mxfp4.py). On MLX they stay MXFP4 (its
``mxfp4`` mode, 4.25 bits a weight) and decode exactly as transformers reads the format; on the torch side (the
transformers engine) each expert's projections run packed, as exact 5-bit codes and power-of-two scales
(backends/transformers/mxfp4.py). gpt-oss's yarn RoPE leaves its blend's range unrounded (``truncate``: false),
which mlx-lm's RoPE does not read: umakit corrects it (backends/mlx/rope.py). A float gpt-oss as transformers
saves it (fused, transposed experts) loads on MLX too (backends/mlx/fused_experts.py)."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
import torch

import umakit
from support import mxfp4
from support.oracle import greedy_reference, ref_logits
from umakit.generate.sampling import SamplingParams

pytest.importorskip("transformers")
mx = pytest.importorskip("mlx.core")

PROMPT = [(7 * i) % 400 + 3 for i in range(40)]  # longer than the sliding window


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = mxfp4.write(tmp_path_factory.mktemp("gpt_oss_mxfp4"))
    return path, mxfp4.reference(path)


def test_mlx_keeps_the_experts_in_mxfp4_as_transformers_reads_them(checkpoint):
    path, _ = checkpoint
    model = umakit.load(path, backend="mlx", dtype="float32")
    want = mxfp4.dequantized(path)
    experts = model.engine.model.model.layers[0].mlp.experts
    held = {}
    for name in ("gate_proj", "up_proj", "down_proj"):
        layer = getattr(experts, name)
        assert layer.mode == "mxfp4" and layer.weight.dtype == mx.uint32 and layer.scales.dtype == mx.uint8
        held[name] = np.array(mx.dequantize(layer.weight, layer.scales, None, 32, 4, mode="mxfp4").astype(mx.float32))
    fused = want["model.layers.0.mlp.experts.gate_up_proj"].transpose(1, 2).numpy()  # (experts, out, in)
    np.testing.assert_array_equal(held["gate_proj"], fused[:, 0::2])  # gate and up interleaved in the checkpoint
    np.testing.assert_array_equal(held["up_proj"], fused[:, 1::2])
    np.testing.assert_array_equal(held["down_proj"],
                                  want["model.layers.0.mlp.experts.down_proj"].transpose(1, 2).numpy())
    assert model.info.weights.quantization.startswith("mxfp4 g32")


# the packed torch form takes a 40-token prompt's bfloat16 GEMMs on a CPU that has them (inputs rounded to 2^-9)
@pytest.mark.parametrize("backend, tolerance", [("mlx", 1e-5), ("transformers", 5e-3)])
def test_logits_and_greedy_tokens_are_transformers(checkpoint, backend, tolerance):
    path, ref = checkpoint
    model = umakit.load(path, backend=backend, dtype="float32")
    want = ref_logits(ref, PROMPT)
    np.testing.assert_allclose(model.logits(PROMPT), want, atol=tolerance * np.abs(want).max(), rtol=0)
    tokens = model.engine.generate_tokens(PROMPT, model.make_cache(), SamplingParams(temperature=0))
    assert [next(tokens) for _ in range(8)] == greedy_reference(ref, PROMPT, 8)
    assert model.info.weights.quantization.startswith("mxfp4 g32") and not model.info.warnings


def test_the_torch_side_holds_each_expert_packed_exactly(checkpoint):
    """Each projection of each expert: 5-bit codes and float16 power-of-two scales that dequantize bit for bit to
    transformers' reading of the MXFP4 blocks; on a CPU with the packed kernel, run by it (bfloat16 names it)."""
    from umakit.backends.torch.cpu import affine_kernel
    from umakit.backends.transformers import mxfp4 as packed

    path, _ = checkpoint
    want = mxfp4.dequantized(path)
    from safetensors.torch import load_file

    stored = load_file(path / "model.safetensors")
    for name in ("gate_up_proj", "down_proj"):
        blocks, scales = (stored[f"model.layers.1.mlp.experts.{name}_{k}"] for k in ("blocks", "scales"))
        for e in range(blocks.shape[0]):
            q = packed.linear(blocks[e], scales[e], torch.zeros(blocks.shape[1]), torch.float32)
            assert q.bits == 5 and q.group_size == 32 and q.scales.dtype == torch.float16
            assert torch.equal(q.dequantized(torch.float32), want[f"model.layers.1.mlp.experts.{name}"][e].T)
    model = umakit.load(path, backend="transformers", dtype="bfloat16")
    twin = mxfp4.reference(path)  # transformers' float model of the checkpoint: its parameter count
    assert model.info.weights.params == sum(p.numel() for p in twin.parameters())
    experts = model.engine.model.model.layers[0].mlp.experts
    assert isinstance(experts, packed.PackedExperts) and len(experts.gate_up) == mxfp4.CONFIG["num_local_experts"]
    if affine_kernel.available():
        assert all(isinstance(m, affine_kernel.AffineLinear) for m in (*experts.gate_up, *experts.down))


def test_a_scale_outside_the_exact_range_runs_that_expert_dequantized(tmp_path):
    """An exponent of 2^20: 16 scales overflow float16, so that projection is held as float, and the load says
    how many were; the logits still are transformers'."""
    from safetensors.torch import load_file, save_file

    path = mxfp4.write(tmp_path / "m", seed=1)
    tensors = load_file(path / "model.safetensors")
    tensors["model.layers.0.mlp.experts.down_proj_scales"][2, 0, 0] = 127 + 20
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    model = umakit.load(path, backend="transformers", dtype="float32")
    assert tuple(model.info.warnings) == ("1 expert projections run dequantized to float32: their MXFP4 scales lie "
                                   "outside what the packed form holds exactly",)
    want = ref_logits(mxfp4.reference(path), PROMPT)
    np.testing.assert_allclose(model.logits(PROMPT), want, atol=5e-3 * np.abs(want).max(), rtol=0)


def test_yarn_unrounded_is_transformers_rope(checkpoint):
    """The periods umakit gives mlx-lm's yarn RoPE are transformers' own inverse frequencies for the checkpoint
    (its ``rope_init_fn``), and mlx-lm's rounded ones are not."""
    from transformers import GptOssConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    path, _ = checkpoint
    config = GptOssConfig.from_pretrained(path)
    inv_freq, _ = ROPE_INIT_FUNCTIONS["yarn"](config, "cpu")
    rope = umakit.load(path, backend="mlx", dtype="float32").engine.model.model.layers[0].self_attn.rope
    np.testing.assert_allclose(1.0 / np.array(rope._freqs), inv_freq.numpy(), rtol=1e-6)
    rounded = type(rope)(rope.dims, base=150000.0, scaling_factor=4.0, original_max_position_embeddings=128)
    assert not np.allclose(1.0 / np.array(rounded._freqs), inv_freq.numpy(), rtol=1e-4)


def test_generate_and_batch_run_it_from_the_command_line(checkpoint, tmp_path):
    path, ref = checkpoint
    run = subprocess.run([sys.executable, "-m", "umakit.cli.main", "generate", "-m", str(path), "-p", "The quick",
                          "--max-tokens", "4", "--temp", "0", "--raw"], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    assert "running on" not in run.stderr  # the default engine (torch, compact code) runs it: no fallback
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"id": i, "prompt": p}) + "\n"
                               for i, p in enumerate(["The quick", "Paris is the capital of", "fox"])))
    out = tmp_path / "out.jsonl"
    run = subprocess.run([sys.executable, "-m", "umakit.cli.main", "batch", str(path), "-i", str(prompts), "-o",
                          str(out), "--max-tokens", "5", "--temp", "0", "--raw"],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert sorted(r["id"] for r in rows) == [0, 1, 2] and all(r["text"] is not None for r in rows), rows


def test_a_float_gpt_oss_saved_by_transformers_runs_on_mlx(tmp_path):
    """Its experts fused and transposed, as transformers holds them: mlx-lm's sanitize alone mis-names them."""
    from support.oracle import reference

    path = mxfp4.write(tmp_path / "float", seed=2, packed=False)
    model = umakit.load(path, backend="mlx", dtype="float32")
    ref = reference(path)
    want = ref_logits(ref, PROMPT)
    np.testing.assert_allclose(model.logits(PROMPT), want, atol=1e-5 * np.abs(want).max(), rtol=0)
    tokens = model.engine.generate_tokens(PROMPT, model.make_cache(), SamplingParams(temperature=0))
    assert [next(tokens) for _ in range(8)] == greedy_reference(ref, PROMPT, 8)


def test_the_packing_is_kept_for_later_loads(tmp_path, monkeypatch):
    """The first CPU load packs each expert and keeps the packing under $UMAKIT_HOME; the next one reads it and
    packs nothing, with the same logits bit for bit."""
    from umakit.backends.transformers import mxfp4 as packed

    monkeypatch.setenv("UMAKIT_HOME", str(tmp_path / "home"))
    path = mxfp4.write(tmp_path / "m", seed=3)
    first = umakit.load(path, backend="transformers", dtype="float32").logits(PROMPT[:8])
    assert list((tmp_path / "home" / "packed").glob("*.safetensors"))

    def repacked(*args):
        raise AssertionError("packed again")

    monkeypatch.setattr(packed, "linear", repacked)
    again = umakit.load(path, backend="transformers", dtype="float32").logits(PROMPT[:8])
    np.testing.assert_array_equal(again, first)


def test_a_missing_expert_tensor_is_named(tmp_path):
    from safetensors.torch import load_file, save_file

    path = mxfp4.write(tmp_path / "m", seed=4)
    tensors = load_file(path / "model.safetensors")
    del tensors["model.layers.1.mlp.experts.down_proj_blocks"]
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(umakit.errors.UnsupportedModelError,
                       match=r"no tensor model\.layers\.1\.mlp\.experts\.down_proj_blocks"):
        umakit.load(path, backend="transformers", dtype="float32")
