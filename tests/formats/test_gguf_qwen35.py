"""Qwen3.5 GGUFs (llama.cpp's ``qwen35``: the dense hybrid models) imported back into transformers' layout: the
value heads llama.cpp tiles for ggml's broadcast put back in their groups (rows, and ``out_proj``'s columns in
whole heads, quantized or not), the norms stored as 1 + w, A_log stored as -exp(A_log) and the squeezed conv
kernel undone; then run on the MLX engine (mlx-lm's qwen3_5 file, which takes a text-only config) and on the
torch side's transformers engine (``auto``). Files written by gguf.GGUFWriter as llama.cpp's converter writes
them (support/gguf_qwen35.py) and, where llama.cpp's sources are here, by that converter; oracles: the original
checkpoint's tensors and transformers' float32 model of it."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType as T

import umakit
from engines.test_torch_gemma4 import PROMPT, greedy
from support import gguf_gpt_oss, gguf_qwen35
from support.gguf_files import with_metadata
from support.oracle import greedy_reference, ref_logits, reference
from umakit.checkpoint.gguf import import_gguf
from umakit.errors import UmakitError

pytest.importorskip("transformers")
mx = pytest.importorskip("mlx.core")


@pytest.fixture(scope="module")
def original(tmp_path_factory):
    return gguf_qwen35.make(tmp_path_factory.mktemp("qwen35") / "hf")


def _tensors(path):
    from safetensors.numpy import load_file

    return load_file(path / "model.safetensors")


def _dequantized(path) -> dict[str, np.ndarray]:
    config = json.loads((path / "config.json").read_text())
    q, stored = config.get("quantization", {}), mx.load(str(path / "model.safetensors"))
    out = {}
    for name, arr in stored.items():
        if name.endswith((".scales", ".biases")):
            continue
        module = name.removesuffix(".weight")
        if f"{module}.scales" in stored:
            spec = q.get(module) if isinstance(q.get(module), dict) else q
            arr = mx.dequantize(arr, stored[f"{module}.scales"], stored[f"{module}.biases"],
                                group_size=spec["group_size"], bits=spec["bits"])
        out[name] = np.array(arr.astype(mx.float32))
    return out


def _runs_as_transformers_runs(imported, checkpoint, monkeypatch) -> None:
    """The float import's logits (1e-5 of the largest) and greedy tokens on MLX and on ``auto`` (the transformers
    engine) as transformers' own float32 model of ``checkpoint`` gives them; the transformers engine's decode
    steps through the library's gated delta step (csrc/delta.cpp), where it is built."""
    import torch

    from umakit.backends.torch.cpu import build

    ref = reference(checkpoint)
    want = ref_logits(ref, PROMPT)
    steps = []
    if build.ensure():
        real = torch.ops.umakit.delta_rule_step
        monkeypatch.setattr(torch.ops.umakit, "delta_rule_step", lambda *a: steps.append(1) or real(*a))
    for backend, engine in (("mlx", "mlx"), ("auto", "transformers")):
        model = umakit.load(imported, backend=backend, dtype="float32")
        assert model.info.backend == engine
        np.testing.assert_allclose(model.logits(PROMPT), want, atol=1e-5 * np.abs(want).max(), rtol=0)
        assert greedy(model, PROMPT, 8) == greedy_reference(ref, PROMPT, 8), backend
    assert bool(steps) == build.ensure()  # the decode steps' linear attention, each layer's


def test_a_float_file_comes_back_as_its_checkpoint_and_runs_as_transformers_runs_it(original, tmp_path,
                                                                                   monkeypatch):
    src = gguf_qwen35.write_gguf(original, tmp_path / "model.gguf")
    report = import_gguf(src, tmp_path / "imported")
    assert not report.lossy_tensors
    ours, theirs = _tensors(tmp_path / "imported"), _tensors(original)
    assert ours.keys() == theirs.keys()
    for name, want in theirs.items():  # A_log (through -exp) and the norms (through 1 + w) come back rounded
        rounded = name.endswith("A_log") or (name.endswith("norm.weight") and ".linear_attn." not in name)
        np.testing.assert_allclose(ours[name], want, rtol=1e-6 if rounded else 0, atol=1e-7 if rounded else 0,
                                   err_msg=name)
    config = json.loads((tmp_path / "imported" / "config.json").read_text())
    assert config["model_type"] == "qwen3_5_text" and config["layer_types"][-1] == "full_attention"
    _runs_as_transformers_runs(tmp_path / "imported", original, monkeypatch)


@pytest.mark.parametrize("qtype, step", [(T.Q8_0, 1 / 127), (T.Q4_0, 1 / 7)])
def test_quantized_weights_are_reordered_in_whole_groups(original, qtype, step, tmp_path):
    """Quantized rows and out_proj's columns put back exactly (no re-quantization): each weight within its format's
    step of the original's (a head misplaced would be off by the weights' own size)."""
    src = gguf_qwen35.write_gguf(original, tmp_path / "model.gguf", dense=qtype)
    report = import_gguf(src, tmp_path / "imported")
    assert not report.lossy_tensors
    ours, theirs = _dequantized(tmp_path / "imported"), _tensors(original)
    for name in ("linear_attn.in_proj_qkv.weight", "linear_attn.in_proj_z.weight", "linear_attn.out_proj.weight"):
        got, want = ours[f"model.layers.0.{name}"], theirs[f"model.layers.0.{name}"]
        tolerance = step * np.abs(want).reshape(want.shape[0], -1, 32).max(axis=-1, keepdims=True)
        assert np.all(np.abs(got - want).reshape(tolerance.shape[0], -1, 32) <= tolerance * 1.01), name
    model = umakit.load(tmp_path / "imported", backend="mlx", dtype="float32")
    want = ref_logits(reference(original), PROMPT)
    np.testing.assert_allclose(model.logits(PROMPT), want, atol=0.25 * np.abs(want).max(), rtol=0)


def test_a_file_of_mixed_widths_runs_alike_on_both_engines(original, tmp_path):
    """Layers at other widths than the rest (as a Q4_K_M's) are per-layer entries of the import's quantization
    block, named as transformers names the layers; mlx-lm's qwen3_5 file runs the text model inside its
    multimodal wrapper (``language_model.`` before every name), and finds them there too."""
    src = gguf_qwen35.write_gguf(original, tmp_path / "model.gguf", dense=T.Q4_0,
                                 overrides={"v_proj.weight": T.Q8_0, "out_proj.weight": T.Q8_0})
    import_gguf(src, tmp_path / "imported")
    q = json.loads((tmp_path / "imported" / "config.json").read_text())["quantization"]
    assert q["bits"] == 4 and q["model.layers.3.self_attn.v_proj"]["bits"] == 8
    got = {b: umakit.load(tmp_path / "imported", backend=b, dtype="float32") for b in ("mlx", "auto")}
    assert got["auto"].info.backend == "transformers"
    want = got["auto"].logits(PROMPT)
    # the transformers engine's packed CPU kernels round activations as the MLX kernels do not: alike, not equal
    np.testing.assert_allclose(got["mlx"].logits(PROMPT), want, atol=2e-2 * np.abs(want).max(), rtol=0)
    assert greedy(got["mlx"], PROMPT, 6) == greedy(got["auto"], PROMPT, 6)


@pytest.mark.parametrize("key, value, needle", [
    ("{arch}.nextn_predict_layers", 1, "multi-token-prediction"),
    ("{arch}.attention.recurrent_layers", [True, False, True, True], "uneven intervals"),
])
def test_what_the_engines_would_run_wrong_is_refused_by_name(original, key, value, needle, tmp_path):
    src = gguf_qwen35.write_gguf(original, tmp_path / "model.gguf")
    with pytest.raises(UmakitError, match=needle):
        import_gguf(with_metadata(src, tmp_path / "edited.gguf", **{key: value}), tmp_path / "never")
    assert not (tmp_path / "never").exists()


def test_the_layers_kinds_come_from_the_file_s_layer_list(tmp_path):
    """Full attention every second layer: the interval mlx-lm reads is the layer list's, not the file's own
    interval key (llama.cpp's converter writes 4 when the checkpoint states its layers as a list)."""
    path = gguf_qwen35.make(tmp_path / "hf", layer_types=["linear_attention", "full_attention"] * 2)
    src = with_metadata(gguf_qwen35.write_gguf(path, tmp_path / "model.gguf"), tmp_path / "stale.gguf",
                        **{"{arch}.full_attention_interval": 4})
    import_gguf(src, tmp_path / "imported")
    assert json.loads((tmp_path / "imported" / "config.json").read_text())["full_attention_interval"] == 2
    want = ref_logits(reference(path), PROMPT)
    got = umakit.load(tmp_path / "imported", backend="mlx", dtype="float32").logits(PROMPT)
    np.testing.assert_allclose(got, want, atol=1e-5 * np.abs(want).max(), rtol=0)


@pytest.mark.skipif(not gguf_gpt_oss.CONVERTERS, reason="llama.cpp's convert_hf_to_gguf.py is not here "
                    "(~/.cache/umakit-peers/src/*/vendor/llama.cpp): run ../shared/tools/build_llama_peers.sh")
@pytest.mark.parametrize("family", ["qwen35", "qwen3next"])
def test_llama_cpp_s_own_converter_writes_what_the_writer_here_writes(family, original, tmp_path):
    import gguf

    if family == "qwen3next":
        original = gguf_qwen35.make(tmp_path / "next", next_=True)
    ours = gguf.GGUFReader(gguf_qwen35.write_gguf(original, tmp_path / "ours.gguf"))
    theirs = gguf.GGUFReader(gguf_qwen35.llama_cpp_convert(original, tmp_path / "theirs.gguf"))
    assert {t.name for t in ours.tensors} == {t.name for t in theirs.tensors}
    by_name = {t.name: np.asarray(t.data) for t in theirs.tensors}
    for t in ours.tensors:
        np.testing.assert_allclose(np.asarray(t.data), by_name[t.name], rtol=1e-6, atol=0, err_msg=t.name)
    import_gguf(tmp_path / "theirs.gguf", tmp_path / "imported")
    want = ref_logits(reference(original), PROMPT)
    got = umakit.load(tmp_path / "imported", backend="mlx", dtype="float32").logits(PROMPT)
    np.testing.assert_allclose(got, want, atol=1e-5 * np.abs(want).max(), rtol=0)


@pytest.fixture(scope="module")
def mixture(tmp_path_factory):
    return gguf_qwen35.make(tmp_path_factory.mktemp("qwen35moe") / "hf", moe=True)


def test_the_mixture_s_file_runs_on_both_engines_as_transformers_runs_its_checkpoint(mixture, tmp_path,
                                                                                    monkeypatch):
    """qwen35moe: the routed experts (3-D stacks) become mlx-lm's ``switch_mlp`` stacks, which MLX reads and the
    transformers engine takes into transformers' own experts modules (switch.py); ``auto`` takes the latter."""
    src = gguf_qwen35.write_gguf(mixture, tmp_path / "model.gguf")
    import_gguf(src, tmp_path / "imported")
    config = json.loads((tmp_path / "imported" / "config.json").read_text())
    assert config["model_type"] == "qwen3_5_moe_text" and config["num_experts"] == 4
    _runs_as_transformers_runs(tmp_path / "imported", mixture, monkeypatch)


@pytest.fixture(scope="module")
def quantized_mixture(mixture, tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen35moe-q8")
    src = gguf_qwen35.write_gguf(mixture, path / "model.gguf", dense=T.Q8_0)
    report = import_gguf(src, path / "imported")
    assert not report.lossy_tensors
    return path / "imported"


def test_the_mixture_s_quantized_experts_import_exactly(mixture, quantized_mixture):
    ours, theirs = _dequantized(quantized_mixture), _tensors(mixture)
    got = ours["model.layers.0.mlp.switch_mlp.up_proj.weight"]
    want = np.stack([theirs[f"model.layers.0.mlp.experts.{e}.up_proj.weight"] for e in range(4)])
    assert got.shape == want.shape
    np.testing.assert_allclose(got, want, atol=np.abs(want).max() / 127 * 1.01, rtol=0)
    want = ref_logits(reference(mixture), PROMPT)
    for backend in ("mlx", "transformers"):
        model = umakit.load(quantized_mixture, backend=backend, dtype="float32")
        np.testing.assert_allclose(model.logits(PROMPT), want, atol=0.1 * np.abs(want).max(), rtol=0)


def test_the_mixture_s_packed_experts_run_as_mlx_runs_them_and_batch_rows_as_lone_ones(quantized_mixture):
    """On the transformers engine each quantized expert is its own layer on umakit's CPU kernel, and the router's
    quantized weight is dequantized: the logits are MLX's of the same codes within the packed forms' tolerance
    (the kernel's int8 inputs, in two passes), and rows of a batch (one joining mid-way) give their lone runs'
    tokens."""
    from umakit.backends.base import BatchRow
    from umakit.backends.torch.cpu.affine_kernel import AffineLinear
    from umakit.generate.sampling import SamplingParams

    model = umakit.load(quantized_mixture, backend="transformers", dtype="float32")
    engine = model.engine
    packed = [p for p, m in engine.model.named_modules() if isinstance(m, AffineLinear) and ".switch_mlp." in p]
    assert len(packed) == 4 * 3 * 4  # layers, projections, experts
    # transformers' SiLU module taken as torch's own, so a decode step's experts are one C++ call (experts.cpp)
    assert all(m.native_act == 0 for m in engine.model.modules() if type(m).__name__ == "SwitchMLP")
    mlx = umakit.load(quantized_mixture, backend="mlx", dtype="float32").logits(PROMPT)
    np.testing.assert_allclose(model.logits(PROMPT), mlx, atol=1e-2 * np.abs(mlx).max(), rtol=0)
    info = engine.weight_info()
    assert 0 < info.bytes_per_token < info.total_bytes  # 2 of 4 experts read a token
    greedy_ = SamplingParams(temperature=0)
    prompts = {0: PROMPT, 1: PROMPT[:3], 2: [9, 8, 7, 6, 5, 4, 3]}
    decoder = engine.batch_decoder()
    decoder.add([BatchRow(i, p, greedy_) for i, p in prompts.items() if i != 2])
    got = {i: [] for i in prompts}
    for step in range(8):
        if step == 2:
            decoder.add([BatchRow(2, prompts[2], greedy_)])
        for row, token in decoder.step():
            got[row].append(token)
    for i, p in prompts.items():
        lone = engine.generate_tokens(p, engine.make_cache(), greedy_)
        assert got[i] == [next(lone) for _ in range(len(got[i]))], i


def test_a_second_load_reads_the_packing_the_first_kept_and_no_load_holds_the_checkpoint_mapped(
        quantized_mixture, monkeypatch, tmp_path):
    """The transformers engine keeps its CPU packing (every expert's, every linear layer's) under $UMAKIT_HOME as
    the torch engine does, so a second load repacks nothing and reads no kept linear layer's codes from the
    checkpoint; and once loaded the model reads nothing from the checkpoint's file, whose mapping would keep every
    page the load read resident."""
    import shutil

    from umakit.backends.torch.cpu import affine_kernel as affine

    if not affine.available():
        pytest.skip("umakit's affine kernel is not built here")
    monkeypatch.setenv("UMAKIT_HOME", str(tmp_path / "home"))
    path = shutil.copytree(quantized_mixture, tmp_path / "checkpoint")
    repacked, planes = [], affine.planes
    monkeypatch.setattr(affine, "planes", lambda m: repacked.append(1) or planes(m))
    from transformers import core_model_loading

    read, materialize = [], core_model_loading.spawn_materialize  # the checkpoint's tensors transformers reads
    monkeypatch.setattr(core_model_loading, "spawn_materialize", lambda *a, **k: read.__setitem__(-1, read[-1] + 1)
                        or materialize(*a, **k))
    read.append(0)
    first = umakit.load(path, backend="transformers", dtype="float32")
    read.append(0)
    assert repacked and list((tmp_path / "home" / "packed").glob("*.safetensors"))
    assert str((path / "model.safetensors").resolve()) not in Path("/proc/self/maps").read_text()
    before = len(repacked)
    second = umakit.load(path, backend="transformers", dtype="float32")
    assert len(repacked) == before
    np.testing.assert_array_equal(second.logits(PROMPT), first.logits(PROMPT))
    assert read[1] < read[0] - 3 * 4  # a linear layer's kept: its codes, scales and biases not read at all


def test_a_column_order_that_would_split_quantized_groups_is_refused_by_name(tmp_path):
    """Value heads of 16 columns in groups of 32: out_proj's columns cannot be put back without re-quantizing,
    so the import stops, naming the tensor, and writes nothing."""
    path = gguf_qwen35.make(tmp_path / "hf", linear_key_head_dim=16, linear_value_head_dim=16)
    src = gguf_qwen35.write_gguf(path, tmp_path / "model.gguf", dense=T.Q8_0)
    with pytest.raises(UmakitError, match=r"blk\.0\.ssm_out\.weight \(Q8_0\) cannot be reordered"):
        import_gguf(src, tmp_path / "never")
    assert not (tmp_path / "never").exists()


@pytest.fixture(scope="module")
def next_(tmp_path_factory):
    return gguf_qwen35.make(tmp_path_factory.mktemp("qwen3next") / "hf", next_=True)


def test_qwen3_next_s_split_projection_is_joined_back(next_, tmp_path, monkeypatch):
    """qwen3next: llama.cpp splits ``in_proj_qkvz`` (each key head's q, k, v and z together) into ``attn_qkv`` and
    ``attn_gate``; the import joins them back (quantized rows as stored) and writes mlx-lm's own layout for the
    model (its experts as stacks, so its norms as 1 + w and its conv kernel (channels, kernel, 1)), which MLX runs
    as transformers runs the checkpoint, and so does the transformers engine, which puts those values back
    (mlx_layout.py); ``auto`` takes it."""
    src = gguf_qwen35.write_gguf(next_, tmp_path / "model.gguf")
    import_gguf(src, tmp_path / "imported")
    ours, theirs = _tensors(tmp_path / "imported"), _tensors(next_)
    name = "model.layers.0.linear_attn.in_proj_qkvz.weight"
    np.testing.assert_array_equal(ours[name], theirs[name])
    _runs_as_transformers_runs(tmp_path / "imported", next_, monkeypatch)
    quantized = gguf_qwen35.write_gguf(next_, tmp_path / "q8.gguf", dense=T.Q8_0)
    import_gguf(quantized, tmp_path / "q8")
    got, want_w = _dequantized(tmp_path / "q8")[name], theirs[name]
    np.testing.assert_allclose(got, want_w, atol=np.abs(want_w).max() / 127 * 1.01, rtol=0)
    mlx = umakit.load(tmp_path / "q8", backend="mlx", dtype="float32").logits(PROMPT)
    packed = umakit.load(tmp_path / "q8", backend="transformers", dtype="float32").logits(PROMPT)
    np.testing.assert_allclose(packed, mlx, atol=1e-2 * np.abs(mlx).max(), rtol=0)


def test_halves_of_two_types_are_joined_as_their_values(next_, tmp_path):
    """attn_qkv at Q8_0 beside attn_gate at Q4_0: one quantized module cannot hold both, so the joined projection
    is their values in float32 (each within its own format's step)."""
    src = gguf_qwen35.write_gguf(next_, tmp_path / "model.gguf", dense=T.Q8_0, overrides={"in_proj_z.weight": T.Q4_0})
    import_gguf(src, tmp_path / "imported")
    stored, want = _tensors(tmp_path / "imported"), _tensors(next_)
    name = "model.layers.0.linear_attn.in_proj_qkvz"
    assert f"{name}.scales" not in stored and stored[f"{name}.weight"].dtype == np.float32
    np.testing.assert_allclose(stored[f"{name}.weight"], want[f"{name}.weight"],
                               atol=np.abs(want[f"{name}.weight"]).max() / 7 * 1.01, rtol=0)
