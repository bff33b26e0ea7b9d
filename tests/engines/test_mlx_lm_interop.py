"""Quantized checkpoints travel both ways between mlx-lm and umakit, with equal logits."""

import json

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.convert import convert
from mlx_lm.utils import load_model

import umakit
from umakit.quantize import quantize, quantized_layers

PROMPT = [5, 17, 42, 99, 3, 250, 7, 301, 12, 64, 128, 77, 31, 200, 11]


def mlx_lm_logits(path, tokens=PROMPT):
    model, _ = load_model(path)
    return np.array(model(mx.array([tokens]))[0].astype(mx.float32))


@pytest.mark.parametrize("recipe", [None, "mixed_3_6"])
def test_mlx_lm_convert_output_loads_in_umakit(tiny_dir, tmp_path, recipe):
    dst = tmp_path / "mlx"
    convert(str(tiny_dir("llama")), str(dst), quantize=True, q_bits=4, q_group_size=64, quant_predicate=recipe)
    config = json.loads((dst / "config.json").read_text())
    assert (recipe is None) == (not any(isinstance(v, dict) for v in config["quantization"].values()))
    ours = umakit.load(dst, backend="mlx")
    theirs, _ = load_model(dst)
    bits = quantized_layers(ours.engine.model)
    assert bits == quantized_layers(theirs)
    assert set(bits.values()) == ({4} if recipe is None else {3, 6})
    np.testing.assert_allclose(ours.logits(PROMPT), mlx_lm_logits(dst), atol=1e-5, rtol=1e-5)
    float_logits = umakit.load(tiny_dir("llama"), backend="mlx").logits(PROMPT)
    assert not np.allclose(ours.logits(PROMPT), float_logits, atol=1e-3)  # it really is quantized


@pytest.mark.parametrize("recipe", ["default", "mixed"])
def test_umakit_checkpoint_loads_in_mlx_lm(tiny_dir, tmp_path, recipe):
    r = quantize(tiny_dir("llama"), tmp_path / "q", bits=4, group_size=32, recipe=recipe)
    import mlx_lm

    model, tokenizer = mlx_lm.load(str(r.dst))  # the full mlx-lm entry point, tokenizer included
    assert tokenizer.encode("Paris is the capital of France.") == umakit.load(r.dst).tokenizer.encode(
        "Paris is the capital of France.")
    layer = model.model.layers[0]
    assert (layer.self_attn.q_proj.bits, layer.mlp.down_proj.bits) == (4, 8 if recipe == "mixed" else 4)
    assert model.lm_head.bits == model.model.embed_tokens.bits == 8
    np.testing.assert_allclose(umakit.load(r.dst, backend="mlx").logits(PROMPT), mlx_lm_logits(r.dst),
                               atol=1e-5, rtol=1e-5)


def test_uniform_recipe_writes_the_same_tensors_as_mlx_lm(tiny_dir, tmp_path):
    # mlx-lm's plain `convert -q` quantizes every layer, embeddings included: our "uniform".
    convert(str(tiny_dir("llama")), str(tmp_path / "mlx"), quantize=True, q_bits=4, q_group_size=64)
    r = quantize(tiny_dir("llama"), tmp_path / "ours", bits=4, group_size=64, recipe="uniform")
    theirs = mx.load(str(tmp_path / "mlx" / "model.safetensors"))
    ours = mx.load(str(r.dst / "model.safetensors"))
    assert sorted(ours) == sorted(theirs)
    for k in ours:
        assert ours[k].dtype == theirs[k].dtype and mx.array_equal(ours[k], theirs[k]).item(), k
    config = json.loads((tmp_path / "mlx" / "config.json").read_text())
    assert config["quantization"] == r.quantization
