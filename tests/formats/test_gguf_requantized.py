"""A GGUF's Q6_K layers in the cache's import (a first run's): held exactly in groups of 16, their 8-bit copies for
MLX's groups made by the first load that reads them (`checkpoint/gguf/requantized.py`), whole or not at all, the
same bytes `umakit import` writes, and never made by a load that reads the exact groups."""

import json
import os
import shutil
import subprocess

import mlx.core as mx
import numpy as np
import pytest
from gguf import GGMLQuantizationType as T

import umakit
from support.gguf_files import EXACT_LAYERS, IDS, hf_forward, write_gguf
from umakit.backends.torch.cpu import affine_kernel as affine
from umakit.checkpoint.files import open_checkpoint
from umakit.checkpoint.gguf import import_gguf, left_layers, requantized, tensors
from umakit.checkpoint.gguf.finished import REQUANTIZED_FILE
from umakit.errors import CheckpointError

Q6K_LAYERS = [dict(EXACT_LAYERS[0], attn_v=T.Q6_K, ffn_down=T.Q6_K), EXACT_LAYERS[1]]


@pytest.fixture
def imported(tmp_path, monkeypatch):
    from umakit import backends

    monkeypatch.setattr(backends, "is_apple_silicon", lambda: False)
    monkeypatch.setattr(backends, "_cuda_available", lambda: False)
    monkeypatch.setenv("UMAKIT_HOME", str(tmp_path / "home"))
    src = write_gguf(tmp_path / "q6k.gguf", "llama", layers=Q6K_LAYERS, tied=False, output=T.Q6_K)
    return src, umakit.resolve_model(src, defer_copies=True)


@pytest.mark.skipif(not affine.available(), reason="umakit's CPU kernel is not built here")
def test_the_copies_are_made_by_the_first_load_that_reads_them_and_only_then(imported):
    src, out = imported
    copies = out / REQUANTIZED_FILE
    kernel = umakit.load(out)  # the CPU default: the exact groups on umakit's kernel
    assert kernel.info.backend == "torch" and not copies.exists()
    heard = []
    float32 = umakit.load(out, dtype="float32", import_progress=lambda done, total: heard.append((done, total)))
    assert copies.is_file() and heard and heard[-1][0] == heard[-1][1] > 0  # the import's bar hears it
    assert [d for d, _ in heard] == sorted(d for d, _ in heard)
    mlx = umakit.load(out, backend="mlx", dtype="float32")  # finds them made: nothing heard again
    ref = hf_forward(src, IDS)
    for model, tolerance in ((float32, 0.02), (mlx, 0.02), (kernel, 0.04)):  # 8-bit copies: an eighth of a step
        ours = model.logits(IDS)
        assert np.abs(ours - ref).max() <= tolerance * np.abs(ref).max(), model.info.backend
    assert float32.generate("x", max_tokens=6, temperature=0, raw=True).tokens == \
        mlx.generate("x", max_tokens=6, temperature=0, raw=True).tokens


def test_a_failed_or_interrupted_making_leaves_nothing(imported, monkeypatch):
    _, out = imported
    (out / "exact" / "groups16.safetensors").rename(out / "exact" / "moved")
    with pytest.raises(CheckpointError, match="lacks the exact groups its config names"):
        open_checkpoint(out).complete()
    (out / "exact" / "moved").rename(out / "exact" / "groups16.safetensors")
    real, calls = tensors.requantized16, []

    def second_fails(*args):
        calls.append(1)
        if len(calls) == 2:
            raise OSError(28, "No space left on device")
        return real(*args)

    monkeypatch.setattr(tensors, "requantized16", second_fails)
    with pytest.raises(OSError, match="No space left on device"):
        open_checkpoint(out).complete()
    assert sorted(os.listdir(out / "exact")) == ["groups16.safetensors"]
    calls.clear()
    monkeypatch.setattr(tensors, "requantized16", lambda *a: (_ for _ in ()).throw(KeyboardInterrupt()))
    with pytest.raises(KeyboardInterrupt):
        open_checkpoint(out).complete()
    assert sorted(os.listdir(out / "exact")) == ["groups16.safetensors"]
    monkeypatch.setattr(tensors, "requantized16", real)
    done = open_checkpoint(out).complete()
    assert done.files == [out / "model.safetensors", out / REQUANTIZED_FILE]
    assert done.complete() is done


def test_the_copies_are_those_umakit_import_writes_into_the_weights(imported, tmp_path):
    """`umakit import` writes a directory mlx-lm serves as it is: the copies in model.safetensors, nothing left
    to make; a first run's import makes the same bytes on first use."""
    src, out = imported
    import_gguf(src, tmp_path / "exported")
    exported = open_checkpoint(tmp_path / "exported")
    assert exported.complete() is exported and not (tmp_path / "exported" / REQUANTIZED_FILE).exists()
    made = mx.load(str(requantized.write(out, json.loads((out / "config.json").read_text()))))
    written = mx.load(str(tmp_path / "exported" / "model.safetensors"))
    assert made and all(np.array_equal(np.array(a), np.array(written[k])) and a.dtype == written[k].dtype
                        for k, a in made.items())
    umakit.load(tmp_path / "exported", backend="mlx", dtype="float32").generate("x", max_tokens=2, raw=True)
    assert not (tmp_path / "exported" / REQUANTIZED_FILE).exists()


@pytest.mark.parametrize("backend, dtype, deferred", [("auto", "auto", True), ("torch", "float32", False),
                                                      ("mlx", "float32", False), ("transformers", "auto", False)])
def test_a_first_run_leaves_the_copies_out_only_where_its_engine_reads_the_exact_groups(tmp_path, monkeypatch,
                                                                                        backend, dtype, deferred):
    """The import a GGUF's first use makes leaves them out for the torch engine on a CPU (the default there: the
    Q6_K layers themselves are left in the GGUF, `gguf.left_layers`); for an engine that reads them it writes them at
    once, as `umakit import` does, since that load would make them."""
    from umakit import backends

    if deferred and not affine.available():
        pytest.skip("umakit's CPU kernel is not built here: the default load makes the copies")
    monkeypatch.setattr(backends, "is_apple_silicon", lambda: False)
    monkeypatch.setattr(backends, "_cuda_available", lambda: False)
    monkeypatch.setenv("UMAKIT_HOME", str(tmp_path / "home"))
    src = write_gguf(tmp_path / "q6k.gguf", "llama", layers=Q6K_LAYERS, tied=False, output=T.Q6_K)
    model = umakit.load(src, backend=backend, dtype=dtype)
    config = json.loads((model.info.path / "config.json").read_text())
    q6k = {m for m, e in left_layers.left(config).items() if e["type"] == "Q6_K"}
    assert ("exact_groups" not in config["umakit"] and len(q6k) == 3) == deferred
    assert deferred or "requantized" not in config["umakit"]["exact_groups"]
    assert not (model.info.path / REQUANTIZED_FILE).exists()  # made by neither: written at import, or not needed


def test_the_import_asks_about_its_own_architecture(tmp_path, monkeypatch):
    """`defer_copies` as a test of the model type: the engine that loads it is chosen by it (the transformers
    engine, for the families without compact code, makes the copies at once)."""
    monkeypatch.setenv("UMAKIT_HOME", str(tmp_path / "home"))
    src = write_gguf(tmp_path / "q6k.gguf", "qwen2", layers=Q6K_LAYERS, tied=False, output=T.Q6_K)
    asked = []
    out = umakit.resolve_model(src, defer_copies=lambda model_type: asked.append(model_type) or False)
    assert asked == ["qwen2"]
    assert "requantized" not in json.loads((out / "config.json").read_text())["umakit"]["exact_groups"]


@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("mount"), reason="needs a tmpfs mount (root, as in CI)")
def test_a_full_disk_while_making_them_is_one_clear_error_and_leaves_nothing(tmp_path, monkeypatch):
    """On a real full filesystem: the import fits, the copies do not; the load that needs them fails with the
    disk's reason, and the import is as it was (no part of the copies, no temporary folder)."""
    from umakit.errors import WriteError

    src = write_gguf(tmp_path / "q6k.gguf", "llama", layers=Q6K_LAYERS, tied=False, output=T.Q6_K)
    monkeypatch.setenv("UMAKIT_HOME", str(tmp_path / "sized"))
    sized = umakit.resolve_model(src, defer_copies=True)
    need = sum(f.stat().st_size for f in sized.rglob("*") if f.is_file())
    copies = requantized.write(sized, json.loads((sized / "config.json").read_text())).stat().st_size
    home = tmp_path / "home"
    home.mkdir()
    size = need + copies // 2 + (1 << 16)  # room for the import and its folders, not for the copies
    if subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(home)]).returncode:
        pytest.skip("tmpfs could not be mounted here")
    try:
        monkeypatch.setenv("UMAKIT_HOME", str(home))
        out = umakit.resolve_model(src, defer_copies=True)
        with pytest.raises(WriteError, match="No space left on device") as e:
            umakit.load(src, backend="mlx", dtype="float32")
        assert str(e.value).startswith(f"cannot write {out / REQUANTIZED_FILE}: No space left on device")
        assert sorted(os.listdir(out / "exact")) == ["groups16.safetensors"]
        assert not (out / REQUANTIZED_FILE).exists()
    finally:
        subprocess.run(["umount", str(home)])


@pytest.mark.skipif(not affine.available(), reason="umakit's CPU kernel is not built here")
def test_a_scaled_table_held_exactly_loads_on_the_transformers_engine(tmp_path, monkeypatch):
    """Gemma's table (scaled by sqrt(hidden)), Q6_K and tied: the transformers engine reads its 8-bit copy, which
    transformers fills (it once overwrote it with the exact groups and failed), as the float32 torch engine does."""
    monkeypatch.setenv("UMAKIT_HOME", str(tmp_path / "home"))
    src = write_gguf(tmp_path / "g.gguf", "gemma3", layers=EXACT_LAYERS * 3, tied=True, embed=T.Q6_K)
    ours = umakit.load(src, backend="transformers").logits(IDS)
    ref = umakit.load(src, backend="torch", dtype="float32").logits(IDS)
    tolerance = {affine.FLOAT32: 2e-3, affine.INT8: 0.04, affine.INT8X2: 2e-3}[affine.inputs()]
    assert np.abs(ours - ref).max() <= tolerance * np.abs(ref).max()
