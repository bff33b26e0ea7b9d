"""A GGUF's first run on a CPU leaves its quantized layers in the GGUF (`checkpoint/gguf/left_layers.py`) and packs
them from the GGUF's blocks (`backends/torch/load/gguf_layers.py`): the same packing, and so the same logits, as
an import of every layer gives; engines that read MLX's layout make the left layers once, the bytes `umakit import`
writes; a moved or changed GGUF, or a kept packing that lacks a layer, is said or repacked, never read wrong."""

import json
import os

import mlx.core as mx
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T

import umakit
from support.gguf_files import EXACT_LAYERS, IDS, tensor_data, write_gguf
from umakit.backends.torch.cpu import affine_kernel as affine
from umakit.checkpoint.files import open_checkpoint, size_on_disk as checkpoint_size
from umakit.checkpoint.gguf import import_gguf, left_layers, quants
from umakit.errors import CheckpointError

pytestmark = pytest.mark.skipif(not affine.available(), reason="umakit's CPU kernel is not built here")
# every exact block type, Q6_K among them, and float layers beside them
MIXED = [dict(EXACT_LAYERS[0], attn_v=T.Q6_K), EXACT_LAYERS[1]]


@pytest.fixture
def cpu_only(tmp_path, monkeypatch):
    from umakit import backends

    monkeypatch.setattr(backends, "is_apple_silicon", lambda: False)
    monkeypatch.setattr(backends, "_cuda_available", lambda: False)
    monkeypatch.setenv("UMAKIT_HOME", str(tmp_path / "home"))


def _packed(model_dir):
    return list((model_dir.parents[2] / "packed").glob("*.safetensors"))


@pytest.mark.parametrize("qtype", [T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0, T.Q4_K, T.Q5_K, T.Q6_K],
                         ids=lambda t: t.name)
@pytest.mark.parametrize("rows, cols", [(3, 256), (37, 512)])
def test_the_blocks_decode_as_the_import_decodes(qtype, rows, cols):
    """The C++ decoder gives the import's numpy decoders' codes (in MLX's packing), scales and biases, bit for
    bit, for every exact type."""
    data = tensor_data(qtype, rows, cols, np.random.default_rng(int(qtype) + rows))
    aff = (quants.to_affine16 if qtype in quants.EXACT16 else quants.to_affine)(data, qtype, cols)
    ggml = left_layers.FORMS[qtype.name][0]
    words, scales, biases = torch.ops.umakit.gguf_affine(torch.from_numpy(data.copy()), ggml)
    assert np.array_equal(words.numpy(), quants.pack(aff.q, aff.bits).view(np.uint8))
    for got, want in ((scales, aff.scales), (biases, aff.biases)):
        assert np.array_equal(got.numpy().view(np.uint32), want.astype(np.float32).view(np.uint32))
    # straight into the kernel's tiles: `affine_planes` of those codes, rows padded to 8 and put in any order
    for order in (None, torch.from_numpy(np.random.default_rng(rows).permutation(rows))):
        want = [t if order is None else t.index_select(0, order) for t in (words, scales, biases)]
        padded = torch.cat([want[0], want[0].new_zeros(-rows % 8, want[0].shape[1])]).view(torch.uint32)
        tiles, s, b = torch.ops.umakit.gguf_tiles(torch.from_numpy(data.copy()), ggml, order)
        assert torch.equal(tiles, torch.ops.umakit.affine_planes(padded, aff.bits))
        assert torch.equal(s, want[1]) and torch.equal(b, want[2])


def test_a_block_type_without_an_exact_form_is_refused():
    with pytest.raises(RuntimeError, match="no exact affine form"):
        torch.ops.umakit.gguf_affine(torch.zeros(2, 110, dtype=torch.uint8), int(T.Q3_K))


@pytest.mark.parametrize("tied", [True, False])
def test_a_first_cpu_run_packs_the_ggufs_own_blocks(tmp_path, cpu_only, tied):
    """The first run's import holds no quantized layer of the GGUF's (a tied table neither; an untied one, read
    by lookups, it holds); its load packs them from the GGUF exactly as from a whole import, and a later load
    reads the packing alone: the GGUF may be gone."""
    src = write_gguf(tmp_path / "m.gguf", layers=MIXED, tied=tied, embed=T.Q4_K)
    first = umakit.load(src)
    out = first.info.path
    config = json.loads((out / "config.json").read_text())
    left = left_layers.left(config)
    quantized = {f"model.layers.{i}.{m}" for i, kinds in enumerate(MIXED) for name, kind in kinds.items()
                 if kind not in (T.F16, T.BF16, T.F32) for m in [_module(name)]}
    assert set(left) == quantized | ({"model.embed_tokens"} if tied else {"lm_head"})
    assert config["umakit"]["import_format"] == 2 and config["quantization"]["model.layers.0.self_attn.v_proj"] == \
        {"group_size": 32, "bits": 8}  # as an import with its Q6_K copies deferred says it
    held = open_checkpoint(out).tensors
    assert not any(name.rsplit(".", 1)[0] in left for name in held)
    assert ("model.embed_tokens.weight" in held) == (not tied)
    # named by path, size and time, not hashed; its size counts the layers it reads from the GGUF
    assert config["umakit"]["sha256"] is None and config["umakit"]["gguf_layers"]["gguf"] == str(src.resolve())
    own = (out / "model.safetensors").stat().st_size
    assert checkpoint_size(out) == own + sum(e["bytes"] for e in left.values()) == first.info.size_on_disk

    whole = umakit.load(import_gguf(src, tmp_path / "whole").out_dir)  # every layer imported, then packed
    assert np.array_equal(first.logits(IDS), whole.logits(IDS))
    assert first.generate("the", max_tokens=6, temperature=0, raw=True).tokens == \
        whole.generate("the", max_tokens=6, temperature=0, raw=True).tokens

    os.rename(src, tmp_path / "away.gguf")
    again = umakit.load(out)  # by its directory, as `umakit ls` names it: the kept packing holds every layer
    assert np.array_equal(again.logits(IDS), whole.logits(IDS))


def _module(gguf_name: str) -> str:
    return {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
            "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
            "ffn_down": "mlp.down_proj"}[gguf_name]


@pytest.mark.parametrize("backend, dtype", [("torch", "float32"), ("mlx", "float32")])
def test_an_engine_of_mlxs_layout_makes_the_left_layers_once(tmp_path, cpu_only, backend, dtype):
    """After a CPU run left the layers in the GGUF, an engine that reads MLX's layout has them made, once, into
    `LAYERS_FILE`: the bytes `umakit import` writes for them; it then runs as on a whole import."""
    src = write_gguf(tmp_path / "m.gguf", layers=MIXED, tied=False, output=T.Q6_K)
    out = umakit.load(src).info.path
    made = out / left_layers.LAYERS_FILE
    assert not made.exists()
    heard = []
    model = umakit.load(out, backend=backend, dtype=dtype, import_progress=lambda d, t: heard.append((d, t)))
    assert made.is_file() and heard and heard[-1][0] == heard[-1][1] > 0
    whole = import_gguf(src, tmp_path / "whole").out_dir
    written = mx.load(str(whole / "model.safetensors"))
    for name, array in mx.load(str(made)).items():
        assert array.dtype == written[name].dtype and np.array_equal(np.array(array), np.array(written[name])), name
    assert np.array_equal(model.logits(IDS), umakit.load(whole, backend=backend, dtype=dtype).logits(IDS))
    stamp = made.stat().st_mtime_ns
    umakit.load(out, backend=backend, dtype=dtype)
    assert made.stat().st_mtime_ns == stamp  # made once


def test_a_moved_or_changed_gguf_is_named(tmp_path, cpu_only):
    src = write_gguf(tmp_path / "m.gguf", layers=MIXED)
    out = umakit.load(src).info.path
    for packing in _packed(out):
        packing.unlink()  # so the next CPU load reads the GGUF again
    os.rename(src, tmp_path / "away.gguf")
    with pytest.raises(CheckpointError, match=f"reads its quantized layers from {src}, which is gone"):
        umakit.load(out)
    os.rename(tmp_path / "away.gguf", src)
    os.utime(src, ns=(1, 1))
    with pytest.raises(CheckpointError, match="which has changed since it was imported"):
        open_checkpoint(out).complete()
    assert not (out / left_layers.LAYERS_FILE).exists() and not list((out / "gguf").iterdir())  # nothing half made
    assert umakit.load(src).logits(IDS).shape[0] == len(IDS)  # the changed file: imported again


def test_a_kept_packing_that_lacks_a_left_layer_is_made_again(tmp_path, cpu_only):
    from safetensors.torch import save_file

    src = write_gguf(tmp_path / "m.gguf", layers=MIXED)
    first = umakit.load(src)
    want = first.logits(IDS)
    (packing,) = _packed(first.info.path)
    save_file({"model.norm.nothing": torch.zeros(64, dtype=torch.uint8)}, str(packing))  # keeps its name
    again = umakit.load(src)
    assert np.array_equal(again.logits(IDS), want)
    assert packing.stat().st_size > 1000  # packed again, whole


@pytest.mark.parametrize("backend, dtype, left", [("auto", "auto", True), ("torch", "float32", False),
                                                  ("mlx", "float32", False)])
def test_only_a_run_on_the_cpu_kernel_leaves_layers_in_the_gguf(tmp_path, cpu_only, backend, dtype, left):
    src = write_gguf(tmp_path / "m.gguf", layers=MIXED)
    model = umakit.load(src, backend=backend, dtype=dtype)
    config = json.loads((model.info.path / "config.json").read_text())
    assert bool(left_layers.left(config)) == left
    assert config["umakit"]["import_format"] == (2 if left else 1)
