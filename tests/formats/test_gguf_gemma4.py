"""gemma4 GGUFs (llama.cpp's ``gemma4`` architecture: per-layer head counts and feed-forward widths, the global
layers' partial RoPE as a ``rope_freqs`` tensor, the 26B-A4B's experts as 3-D stacks with gate and up fused, a
SentencePiece-style vocabulary stored as ``gemma4``) imported and run on both engines. The files are tiny
checkpoints saved by the installed transformers, written by gguf.GGUFWriter in llama.cpp's layout
(support/gguf_gemma4.py, its tensor names from the gguf package's own map) and, where llama.cpp's sources are on
this machine, by llama.cpp's own convert_hf_to_gguf.py; the oracles are transformers' float32 model of the
original checkpoint, or of the float model a quantized file is (its weights dequantized by the gguf package)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
from gguf import GGMLQuantizationType as T

import umakit
from engines.test_torch_gemma4 import MOE, PROMPT, VARIANTS, greedy, make
from support import gguf_gemma4, gguf_gpt_oss
from support.gguf_files import with_metadata
from support.oracle import greedy_reference, ref_logits, reference
from umakit.checkpoint.gguf import import_gguf
from umakit.errors import UmakitError
from umakit.plan.sources import load_config

pytest.importorskip("transformers")
pytest.importorskip("mlx.core")

S, F = "sliding_attention", "full_attention"
CHECKPOINTS = {
    "defaults": VARIANTS["defaults"],
    "every-feature": VARIANTS["every-feature"],
    "mixture": dict(num_hidden_layers=2, layer_types=[S, F], global_head_dim=32, hidden_size_per_layer_input=0,
                    **MOE),
}


@pytest.fixture(scope="module", params=sorted(CHECKPOINTS))
def checkpoint(request, tmp_path_factory):
    return request.param, make(tmp_path_factory.mktemp(request.param), tokenizer=gguf_gemma4.write_tokenizer,
                               **CHECKPOINTS[request.param])


def _same_logits(model_dir, oracle_dir, backends=("torch", "mlx"), steps=8):
    ref = reference(oracle_dir)
    want = ref_logits(ref, PROMPT)
    for backend in backends:
        model = umakit.load(model_dir, backend=backend, dtype="float32")
        np.testing.assert_allclose(model.logits(PROMPT), want, atol=1e-5 * np.abs(want).max(), rtol=0,
                                   err_msg=backend)
        assert greedy(model, PROMPT, steps) == greedy_reference(ref, PROMPT, steps), backend


def test_a_float_gguf_runs_as_transformers_runs_its_checkpoint(checkpoint, tmp_path):
    name, path = checkpoint
    src = gguf_gemma4.write_gguf(path, tmp_path / "model.gguf")
    report = import_gguf(src, tmp_path / "imported")
    assert not report.lossy_tensors
    config = json.loads((tmp_path / "imported" / "config.json").read_text())
    original = json.loads((path / "config.json").read_text())
    for key in ("layer_types", "num_key_value_heads", "head_dim", "intermediate_size", "sliding_window",
                "num_kv_shared_layers", "use_double_wide_mlp", "attention_k_eq_v", "final_logit_softcapping",
                "hidden_size_per_layer_input", "num_experts", "top_k_experts", "moe_intermediate_size"):
        assert config.get(key) == original.get(key), key
    assert config["rope_parameters"] == original["rope_parameters"]
    for layer, heads in original["per_layer_config"].items():  # the global layers' heads
        assert config["per_layer_config"][layer]["head_dim"] == heads["head_dim"]
    _same_logits(tmp_path / "imported", path)


@pytest.mark.parametrize("dense, experts", [(T.Q8_0, T.Q8_0), (T.Q4_0, T.Q4_0)])
def test_quantized_files_import_exactly(checkpoint, dense, experts, tmp_path):
    """Q8_0 and Q4_0 are MLX's affine groups already, the expert stacks too: nothing re-quantized, and the engines
    run the float model the file's weights are."""
    name, path = checkpoint
    src = gguf_gemma4.write_gguf(path, tmp_path / "model.gguf", dense=dense, experts=experts)
    report = import_gguf(src, tmp_path / "imported")
    assert not report.lossy_tensors
    config = json.loads((tmp_path / "imported" / "config.json").read_text())
    assert config["quantization"]["bits"] == {T.Q8_0: 8, T.Q4_0: 4}[dense]
    twin = gguf_gemma4.dequantized_twin(src, path, tmp_path / "twin")
    _same_logits(tmp_path / "imported", twin, steps=6)


def test_expert_stacks_of_a_re_quantized_type_are_reported_and_run(tmp_path):
    """IQ4_NL has no affine form: each stack is re-quantized (reported with its error) and split into mlx-lm's
    gate and up modules like the exact ones; `umakit plan` reads the file as its import."""
    path = make(tmp_path / "hf", tokenizer=gguf_gemma4.write_tokenizer, **CHECKPOINTS["mixture"])
    src = gguf_gemma4.write_gguf(path, tmp_path / "model.gguf", dense=T.Q8_0, experts=T.IQ4_NL)
    report = import_gguf(src, tmp_path / "imported")
    lossy = {t.name: t for t in report.lossy_tensors}
    assert set(lossy) == {f"model.layers.{i}.experts.{p}" for i in range(2) for p in ("gate_up_proj", "down_proj")}
    assert all(t.from_type == "IQ4_NL" and 0 < t.max_abs_err < 1e-2 for t in lossy.values())
    from safetensors.numpy import load_file

    stored = load_file(tmp_path / "imported" / "model.safetensors")
    gate, up = (stored[f"model.layers.0.experts.switch_glu.{p}_proj.scales"] for p in ("gate", "up"))
    assert gate.shape == up.shape == (4, 32, 2)  # 4 experts, 32 rows each of gate and up, 64 columns in 32s
    written = load_config(tmp_path / "imported")
    written.pop("umakit")
    assert load_config(src) == written  # `umakit plan FILE.gguf` plans what the import writes
    twin = gguf_gemma4.dequantized_twin(src, path, tmp_path / "twin")
    want = ref_logits(reference(twin), PROMPT)
    got = [umakit.load(tmp_path / "imported", backend=b, dtype="float32").logits(PROMPT) for b in ("torch", "mlx")]
    np.testing.assert_allclose(got[0], got[1], atol=1e-5 * np.abs(want).max(), rtol=0)  # one form, both engines
    np.testing.assert_allclose(got[0], want, atol=0.1 * np.abs(want).max(), rtol=0)  # near the file's values


def test_the_vocabulary_is_the_checkpoint_s(checkpoint, tmp_path):
    from transformers import AutoTokenizer

    name, path = checkpoint
    import_gguf(gguf_gemma4.write_gguf(path, tmp_path / "model.gguf"), tmp_path / "imported")
    ours, theirs = (AutoTokenizer.from_pretrained(p) for p in (tmp_path / "imported", path))
    for text in ["It is a truth universally acknowledged", "  two  spaces", "ünïcödé 🙂 and bytes",
                 "<start_of_turn>user\nhi<end_of_turn>\n"]:
        assert ours(text)["input_ids"] == theirs(text)["input_ids"], text
        assert ours.decode(ours(text)["input_ids"], skip_special_tokens=True) == text.replace(
            "<start_of_turn>", "").replace("<end_of_turn>", "")
    assert ours("x")["input_ids"][0] == theirs.bos_token_id


def test_rope_scaling_and_uneven_layers_are_refused_by_name(tmp_path):
    path = make(tmp_path / "hf", tokenizer=gguf_gemma4.write_tokenizer, **CHECKPOINTS["every-feature"])
    src = gguf_gemma4.write_gguf(path, tmp_path / "model.gguf")
    for key, value, needle in [("{arch}.rope.scaling.type", "yarn", "RoPE scaling"),
                               ("{arch}.attention.head_count_kv", [2, 1, 2, 1, 1, 1], "head count"),
                               ("{arch}.attention.sliding_window_pattern", [True] * 6, "without global layers")]:
        with pytest.raises(UmakitError, match=needle):
            import_gguf(with_metadata(src, tmp_path / "edited.gguf", **{key: value}), tmp_path / "never")
        assert not (tmp_path / "never").exists()


@pytest.mark.skipif(not gguf_gpt_oss.CONVERTERS, reason="llama.cpp's convert_hf_to_gguf.py is not here "
                    "(~/.cache/umakit-peers/src/*/vendor/llama.cpp): run ../shared/tools/build_llama_peers.sh")
def test_llama_cpp_s_own_converter(checkpoint, tmp_path):
    name, path = checkpoint
    src = gguf_gpt_oss.llama_cpp_convert(path, tmp_path / "converted.gguf")
    import_gguf(src, tmp_path / "imported")
    _same_logits(tmp_path / "imported", path, steps=4)


def test_generate_runs_the_gguf_from_the_command_line(tmp_path):
    path = make(tmp_path / "hf", tokenizer=gguf_gemma4.write_tokenizer, **CHECKPOINTS["every-feature"])
    src = gguf_gemma4.write_gguf(path, tmp_path / "model.gguf", dense=T.Q8_0)
    env = {**os.environ, "UMAKIT_HOME": str(tmp_path / "home")}
    run = subprocess.run([sys.executable, "-m", "umakit.cli.main", "generate", "-m", str(src), "-p",
                          "It is a truth", "--max-tokens", "4", "--temp", "0", "--json"],
                         capture_output=True, text=True, timeout=300, env=env)
    assert run.returncode == 0, run.stderr
    assert "running on" not in run.stderr  # the default engine (torch, compact code) runs it: no fallback
    assert len(json.loads(run.stdout)["tokens"]) == 4
