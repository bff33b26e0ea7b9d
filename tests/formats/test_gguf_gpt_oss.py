"""gpt-oss GGUFs as llama.cpp writes them (architecture ``gpt-oss``, routed experts in ggml's MXFP4, type 39):
the import writes the experts back in OpenAI's MXFP4 layout, the same bytes as the checkpoint they came from, so
both engines load them through gpt-oss's own path (tests/engines/test_mxfp4.py). The files are the tiny OpenAI
checkpoint of support/mxfp4.py written by gguf.GGUFWriter in llama.cpp's layout, and, where llama.cpp's sources
are on this machine, converted by llama.cpp's own convert_hf_to_gguf.py; the oracles are the gguf package's
MXFP4 dequantization and transformers' float32 model of the original checkpoint."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
from gguf import GGMLQuantizationType as T
from gguf import quants as gguf_quants

import umakit
from support import gguf_gpt_oss, mxfp4
from support.oracle import ref_logits
from umakit.checkpoint.gguf import import_gguf
from umakit.checkpoint.gguf.reader import open_gguf

pytest.importorskip("transformers")
mx = pytest.importorskip("mlx.core")

PROMPT = [(7 * i) % 400 + 3 for i in range(40)]  # longer than the sliding window
requires_converter = pytest.mark.skipif(
    not gguf_gpt_oss.CONVERTERS,
    reason="llama.cpp's convert_hf_to_gguf.py is not here (~/.cache/umakit-peers/src/*/vendor/llama.cpp): "
           "run ../shared/tools/build_llama_peers.sh")


@pytest.fixture(scope="module")
def original(tmp_path_factory):
    path = mxfp4.write(tmp_path_factory.mktemp("gpt_oss") / "hf", seed=5)
    return path, mxfp4.reference(path)


@pytest.fixture(scope="module")
def imported(original, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("gpt_oss_gguf")
    src = gguf_gpt_oss.write_gguf(original[0], tmp / "tiny.gguf")
    import_gguf(src, tmp / "imported")
    return src, tmp / "imported"


def _stored(path):
    from safetensors.numpy import load_file

    return load_file(path / "model.safetensors")


def _assert_same_checkpoint(model_dir, original_dir):
    ours, theirs = _stored(model_dir), _stored(original_dir)
    assert ours.keys() == theirs.keys()
    for name, want in theirs.items():
        assert ours[name].dtype == want.dtype and np.array_equal(ours[name], want), name


def test_the_experts_come_back_as_the_checkpoint_s_bytes(original, imported):
    """Every tensor, the MXFP4 blocks and scales included, is the original checkpoint's bit for bit; and the GGUF's
    experts, as the gguf package dequantizes them, are transformers' reading of the checkpoint."""
    src, out = imported
    _assert_same_checkpoint(out, original[0])
    want = mxfp4.dequantized(original[0])
    gf = open_gguf(src)
    for layer in (0, 1):
        fused = want[f"model.layers.{layer}.mlp.experts.gate_up_proj"].transpose(1, 2).numpy()  # (experts, out, in)
        for part, rows in (("gate", fused[:, 0::2]), ("up", fused[:, 1::2])):
            t = gf.tensors[f"blk.{layer}.ffn_{part}_exps.weight"]
            assert t.tensor_type == T.MXFP4
            np.testing.assert_array_equal(gguf_quants.dequantize(np.asarray(t.data), T.MXFP4), rows)
        down = gguf_quants.dequantize(np.asarray(gf.tensors[f"blk.{layer}.ffn_down_exps.weight"].data), T.MXFP4)
        np.testing.assert_array_equal(down, want[f"model.layers.{layer}.mlp.experts.down_proj"].transpose(1, 2))


def test_config_and_tokenizer_files(original, imported):
    _, out = imported
    config = json.loads((out / "config.json").read_text())
    theirs = json.loads((original[0] / "config.json").read_text())
    assert config["model_type"] == "gpt_oss" and config["architectures"] == ["GptOssForCausalLM"]
    assert config["quantization_config"]["quant_method"] == "mxfp4" and "quantization" not in config
    for key in ("num_local_experts", "num_experts_per_tok", "sliding_window", "layer_types", "head_dim",
                "intermediate_size", "num_key_value_heads", "swiglu_limit", "tie_word_embeddings"):
        assert config[key] == theirs[key], key
    rope = {k: v for k, v in theirs["rope_parameters"].items() if k != "rope_theta"}
    assert config["rope_scaling"] == rope and config["rope_theta"] == theirs["rope_parameters"]["rope_theta"]
    tok_config = json.loads((out / "tokenizer_config.json").read_text())
    assert tok_config["chat_template"] == json.loads((original[0] / "tokenizer_config.json").read_text())[
        "chat_template"]


@pytest.mark.parametrize("backend, tolerance, held", [("mlx", 1e-5, "mxfp4 g32"), ("transformers", 5e-3, "mxfp4 g32"),
                                                     ("torch", 1e-5, "5-bit g32")])  # as test_mxfp4.py's
def test_logits_are_transformers_on_the_original(original, imported, backend, tolerance, held):
    """The torch engine's compact code holds the experts at 5 bits exactly (tests/engines/test_torch_gpt_oss.py)."""
    path, ref = original
    model = umakit.load(imported[1], backend=backend, dtype="float32")
    want = ref_logits(ref, PROMPT)
    np.testing.assert_allclose(model.logits(PROMPT), want, atol=tolerance * np.abs(want).max(), rtol=0)
    assert model.info.weights.quantization.startswith(held) and not model.info.warnings


def test_quantized_dense_weights_are_dequantized_beside_the_experts(original, tmp_path):
    """Q8_0 attention and embeddings (as --outtype q8_0 writes): float32, the gguf package's values exactly,
    since the engines take OpenAI's layout with float tensors beside it."""
    src = gguf_gpt_oss.write_gguf(original[0], tmp_path / "q8.gguf", dense=T.Q8_0)
    import_gguf(src, tmp_path / "q8")
    ours, gf = _stored(tmp_path / "q8"), open_gguf(src)
    t = gf.tensors["blk.1.attn_q.weight"]
    assert t.tensor_type == T.Q8_0
    q = ours["model.layers.1.self_attn.q_proj.weight"]
    assert q.dtype == np.float32 and np.array_equal(q, gguf_quants.dequantize(np.asarray(t.data), T.Q8_0))
    theirs = _stored(original[0])
    assert np.array_equal(ours["model.layers.1.mlp.experts.down_proj_blocks"],
                          theirs["model.layers.1.mlp.experts.down_proj_blocks"])
    model = umakit.load(tmp_path / "q8", backend="mlx", dtype="float32")
    want = ref_logits(original[1], PROMPT)
    np.testing.assert_allclose(model.logits(PROMPT), want, atol=2e-2 * np.abs(want).max(), rtol=0)


def test_experts_of_another_type_are_named(original, tmp_path):
    src = gguf_gpt_oss.write_gguf(original[0], tmp_path / "f32.gguf", experts=T.F32)
    with pytest.raises(umakit.errors.UnsupportedModelError,
                       match=r"gpt-oss expert tensor blk\.0\.ffn_down_exps\.weight is F32; only MXFP4"):
        import_gguf(src, tmp_path / "out")
    assert not (tmp_path / "out").exists()


@requires_converter
def test_llama_cpp_s_own_converter(original, tmp_path):
    """convert_hf_to_gguf.py's file (its float tensors kept float32): the same checkpoint back, bit for bit, and
    transformers' logits on MLX."""
    path, ref = original
    src = gguf_gpt_oss.llama_cpp_convert(path, tmp_path / "converted.gguf")
    assert open_gguf(src).tensors["blk.0.ffn_up_exps.weight"].tensor_type == T.MXFP4
    import_gguf(src, tmp_path / "imported")
    _assert_same_checkpoint(tmp_path / "imported", path)
    model = umakit.load(tmp_path / "imported", backend="mlx", dtype="float32")
    want = ref_logits(ref, PROMPT)
    np.testing.assert_allclose(model.logits(PROMPT), want, atol=1e-5 * np.abs(want).max(), rtol=0)


def test_generate_runs_the_gguf_from_the_command_line(imported, tmp_path):
    env = {**os.environ, "UMAKIT_HOME": str(tmp_path / "home")}
    run = subprocess.run([sys.executable, "-m", "umakit.cli.main", "generate", "-m", str(imported[0]), "-p",
                          "The quick", "--max-tokens", "4", "--temp", "0", "--raw"],
                         capture_output=True, text=True, timeout=300, env=env)
    assert run.returncode == 0, run.stderr
    assert "running on" not in run.stderr  # the default engine (torch) runs it: no fallback
