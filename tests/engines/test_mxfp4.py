"""gpt-oss as OpenAI ships it: routed experts in MXFP4 (tests/support/mxfp4.py). On MLX they stay MXFP4 (its
``mxfp4`` mode, 4.25 bits a weight) and decode exactly as transformers reads the format; the transformers engine
runs them dequantized, and says so. gpt-oss's yarn RoPE leaves its blend's range unrounded (``truncate``:
false), which mlx-lm's RoPE does not read: umakit corrects it (backends/mlx/rope.py)."""

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


@pytest.mark.parametrize("backend", ["mlx", "transformers"])
def test_logits_and_greedy_tokens_are_transformers(checkpoint, backend):
    path, ref = checkpoint
    model = umakit.load(path, backend=backend, dtype="float32")
    want = ref_logits(ref, PROMPT)
    np.testing.assert_allclose(model.logits(PROMPT), want, atol=1e-5 * np.abs(want).max(), rtol=0)
    tokens = model.engine.generate_tokens(PROMPT, model.make_cache(), SamplingParams(temperature=0))
    assert [next(tokens) for _ in range(8)] == greedy_reference(ref, PROMPT, 8)
    if backend == "transformers":
        assert any("mxfp4 layers run dequantized to float32" in w for w in model.info.warnings)


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
    assert "running on mlx" in run.stderr
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
