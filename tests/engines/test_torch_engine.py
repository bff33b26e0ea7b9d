"""What only the torch engine has, against transformers and MLX: its cache's growth, half precision on CPU, the
architectures it names, the CUDA graph's static step run eagerly, sliding windows, settings the tiny families
leave off, and MLX-quantized checkpoints read as MLX reads them. The shared oracle is test_oracle.py; the quantized
KV cache is test_torch_kv_bits.py."""

import numpy as np
import pytest
import torch

import umakit
from umakit.errors import UnsupportedModelError

from support.oracle import PROMPT, ref_logits, reference


def test_cache_grows_past_its_first_capacity(tiny_dir):
    model = umakit.load(tiny_dir("llama"), backend="torch", device="cpu", dtype="float32")
    cache = model.make_cache()
    start = cache.capacity
    tokens = (PROMPT * 40)[: start + 20]
    model.engine.prefill(tokens[:-1], cache)
    assert cache.capacity > start
    last = model.engine.logits(tokens[-1:], cache)[-1]
    np.testing.assert_allclose(last, model.logits(tokens)[-1], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("dtype, tolerance", [("float16", 0.005), ("bfloat16", 0.05)])
def test_half_precision_on_cpu_is_close(tiny_dir, dtype, tolerance):
    path = tiny_dir("qwen2")
    model = umakit.load(path, backend="torch", device="cpu", dtype=dtype)
    assert model.info.dtype == dtype
    theirs = ref_logits(reference(path), PROMPT)
    assert np.abs(model.logits(PROMPT) - theirs).max() <= tolerance * np.abs(theirs).max()


def test_unsupported_model_type_names_the_supported_ones(tiny_dir, tmp_path):
    from umakit.backends.torch.engine import TorchEngine
    from umakit.checkpoint.files import open_checkpoint

    path = _edited(tiny_dir("llama"), tmp_path / "phi3", model_type="phi3")
    with pytest.raises(UnsupportedModelError, match="supported: llama, mistral, qwen2, qwen3, smollm3, gemma3_text, "
                                                    "gemma4_text, mixtral, qwen3_moe"):
        TorchEngine.from_checkpoint(open_checkpoint(path), device="cpu")
    with pytest.raises(UnsupportedModelError, match="the torch backend does not run model_type 'phi3'; "
                                                    "use --backend mlx"):
        umakit.load(path, backend="torch", device="cpu")


def _edited(src, path, **changes):
    """A copy of the checkpoint at ``src`` with config.json fields changed."""
    import json
    import shutil

    shutil.copytree(src, path)
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, **changes}))
    return path


@pytest.mark.parametrize("family", ["llama", "mistral"])
def test_static_decode_step_equals_eager(tiny_dir, family):
    """The CUDA-graph decode step (fixed attention span under a mask), run eagerly on CPU."""
    from umakit.backends.torch.cuda.graphs import GraphDecoder

    model = umakit.load(tiny_dir(family), backend="torch", device="cpu", dtype="float32")
    step = GraphDecoder(model.engine.model, capture=False)
    cache = model.make_cache()
    model.engine.prefill(PROMPT[:5], cache)
    with torch.inference_mode():
        got = [step(torch.tensor([t]), cache)[0].numpy() for t in PROMPT[5:]]
    assert cache.offset == len(PROMPT)
    np.testing.assert_allclose(np.stack(got), model.logits(PROMPT)[5:], atol=1e-4, rtol=1e-4)


def test_sliding_window_matches_transformers(tiny_dir, tmp_path):
    """Mistral with a window shorter than the prompt: prefill masks and cached decode both honour it."""
    path = _edited(tiny_dir("mistral"), tmp_path / "mistral-window", sliding_window=6)
    model, ref = umakit.load(path, backend="torch", device="cpu", dtype="float32"), reference(path)
    np.testing.assert_allclose(model.logits(PROMPT), ref_logits(ref, PROMPT), atol=1e-4, rtol=1e-4)
    cache = model.make_cache()
    model.engine.prefill(PROMPT[:4], cache)
    steps = [model.engine.logits([t], cache)[-1] for t in PROMPT[4:]]
    np.testing.assert_allclose(np.stack(steps), ref_logits(ref, PROMPT)[4:], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("family, changes", [
    ("gemma3", {"final_logit_softcapping": 0.5, "sliding_window": 3}),  # tanh bends these logits (max ~0.7)
    ("qwen3_moe", {"norm_topk_prob": False, "num_experts_per_tok": 3}),  # the picked weights not renormalised
])
def test_variants_match_transformers(tiny_dir, tmp_path, family, changes):
    """Settings the tiny families leave off, through prefill and cached decode."""
    path = _edited(tiny_dir(family), tmp_path / family, **changes)
    model, ref = umakit.load(path, backend="torch", device="cpu", dtype="float32"), reference(path)
    theirs = ref_logits(ref, PROMPT)
    np.testing.assert_allclose(model.logits(PROMPT), theirs, atol=1e-4, rtol=1e-4)
    cache = model.make_cache()
    model.engine.prefill(PROMPT[:2], cache)
    steps = [model.engine.logits([t], cache)[-1] for t in PROMPT[2:]]
    np.testing.assert_allclose(np.stack(steps), theirs[2:], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe", "gemma3"])
def test_mlx_quantized_checkpoint_runs_as_on_mlx(tiny_dir, tmp_path, family):
    """umakit quantize's output (mlx-lm's layout: experts stacked, each quantized alone) reads as MLX reads it."""
    from safetensors import safe_open

    from umakit.quantize.pipeline import quantize

    dst = tmp_path / "q4"
    quantize(tiny_dir(family), dst, bits=4, group_size=32)
    with safe_open(str(dst / "model.safetensors"), "np") as f:
        stacked = [k for k in f.keys() if ".switch_mlp." in k and k.endswith(".scales")]
    assert bool(stacked) == (family != "gemma3")
    torch_model = umakit.load(dst, backend="torch", device="cpu", dtype="float32")
    assert torch_model.info.weights.quantization.startswith("4-bit g32")
    mlx_logits = umakit.load(dst, backend="mlx").logits(PROMPT)
    np.testing.assert_allclose(torch_model.logits(PROMPT), mlx_logits, atol=1e-4, rtol=1e-4)


def test_qwen3_moe_with_a_dense_layer_matches_transformers(tmp_path):
    """mlp_only_layers: layer 1 keeps a dense MLP between sparse ones."""
    from support.tiny import make_tiny_model

    path = make_tiny_model("qwen3_moe", tmp_path / "mixed", num_hidden_layers=3, mlp_only_layers=[1])
    model = umakit.load(path, backend="torch", device="cpu", dtype="float32")
    assert [type(b.mlp).__name__ for b in model.engine.model.model.layers] == ["SparseMoE", "MLP", "SparseMoE"]
    np.testing.assert_allclose(model.logits(PROMPT), ref_logits(reference(path), PROMPT), atol=1e-4, rtol=1e-4)
