"""Bad checkpoints fail with one clear, named error and leave nothing behind."""

import json
import shutil
import struct

import pytest

import umakit
from umakit.errors import CheckpointError, ConfigError, ModelNotFoundError, TokenizerError, UnsupportedModelError


@pytest.fixture
def ckpt(tiny_dir, tmp_path):
    """A private copy of the tiny llama, free to damage."""
    return shutil.copytree(tiny_dir("llama"), tmp_path / "m")


def load(path):
    return umakit.load(path, backend="mlx")


def test_missing_directory(tmp_path):
    with pytest.raises(ModelNotFoundError, match="model not found: .*nope"):
        load(tmp_path / "nope")


def test_missing_config(ckpt):
    (ckpt / "config.json").unlink()
    with pytest.raises(ConfigError, match="has no config.json"):
        load(ckpt)


def test_config_not_json(ckpt):
    (ckpt / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        load(ckpt)


def test_config_without_model_type(ckpt):
    cfg = json.loads((ckpt / "config.json").read_text())
    del cfg["model_type"]
    (ckpt / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match="lacks required field.*model_type"):
        load(ckpt)


def test_unsupported_model_type_lists_supported(ckpt):
    cfg = json.loads((ckpt / "config.json").read_text())
    cfg["model_type"] = "frobnicator"
    (ckpt / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UnsupportedModelError, match=r"'frobnicator' is not supported.*llama.*qwen3"):
        load(ckpt)


def test_no_weights(ckpt):
    (ckpt / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match="no \\*.safetensors"):
        load(ckpt)


def test_truncated_safetensors_names_tensor(ckpt):
    f = ckpt / "model.safetensors"
    data = f.read_bytes()
    f.write_bytes(data[: len(data) - 1000])
    with pytest.raises(CheckpointError, match=r"model.safetensors is truncated: tensor \S+ needs bytes"):
        load(ckpt)


def test_corrupt_header(ckpt):
    f = ckpt / "model.safetensors"
    data = f.read_bytes()
    n = struct.unpack("<Q", data[:8])[0]
    f.write_bytes(data[:8] + b"#" * n + data[8 + n:])
    with pytest.raises(CheckpointError, match="corrupt safetensors header"):
        load(ckpt)


def test_not_a_safetensors_file(ckpt):
    (ckpt / "model.safetensors").write_bytes(b"hello")
    with pytest.raises(CheckpointError, match="truncated or not a safetensors file"):
        load(ckpt)


def _rewrite(ckpt, edit):
    from safetensors.numpy import load_file, save_file

    tensors = load_file(ckpt / "model.safetensors")
    edit(tensors)
    save_file(tensors, ckpt / "model.safetensors", metadata={"format": "pt"})


def test_missing_tensor_is_named(ckpt):
    _rewrite(ckpt, lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(CheckpointError, match="missing tensor model.layers.1.mlp.up_proj.weight"):
        load(ckpt)


def test_wrong_shape_is_named(ckpt):
    def edit(t):
        t["model.norm.weight"] = t["model.norm.weight"][:10].copy()

    _rewrite(ckpt, edit)
    with pytest.raises(CheckpointError, match=r"tensor model.norm.weight has shape \[10\] but the config implies \[64\]"):
        load(ckpt)


def test_missing_shard(ckpt):
    index = {"weight_map": {"model.norm.weight": "model-00002-of-00002.safetensors"}}
    (ckpt / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match="missing: model-00002-of-00002.safetensors"):
        load(ckpt)


def test_sharded_checkpoint_loads(ckpt, tiny_model):
    from safetensors.numpy import load_file, save_file

    tensors = load_file(ckpt / "model.safetensors")
    (ckpt / "model.safetensors").unlink()
    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    for file, keys in shards.items():
        save_file({k: tensors[k] for k in keys}, ckpt / file, metadata={"format": "pt"})
    index = {"weight_map": {k: f for f, keys in shards.items() for k in keys}}
    (ckpt / "model.safetensors.index.json").write_text(json.dumps(index))
    model = load(ckpt)
    assert (model.logits([1, 2, 3]) == tiny_model.logits([1, 2, 3])).all()


def test_bf16_checkpoint_computes_in_float32_on_cpu(ckpt):
    import numpy as np
    from safetensors.torch import load_file, save_file

    tensors = {k: v.bfloat16() for k, v in load_file(ckpt / "model.safetensors").items()}
    save_file(tensors, ckpt / "model.safetensors", metadata={"format": "pt"})
    model = umakit.load(ckpt, backend="mlx", device="cpu")  # "auto" on a Mac's default device is bfloat16
    assert model.info.dtype == "float32"
    assert model.info.weights.total_bytes == 4 * model.info.weights.params
    assert np.isfinite(model.logits([1, 2, 3])).all()


def test_missing_tokenizer(ckpt):
    (ckpt / "tokenizer.json").unlink()
    with pytest.raises(TokenizerError, match="has no tokenizer.json"):
        load(ckpt)


def test_broken_tokenizer(ckpt):
    (ckpt / "tokenizer.json").write_text("{}")
    with pytest.raises(TokenizerError, match="cannot load .*tokenizer.json"):
        load(ckpt)


def test_hub_id_offline_without_cache(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    with pytest.raises(ModelNotFoundError, match="not in the local Hugging Face cache and HF_HUB_OFFLINE is set"):
        load("someone/some-model")


def test_unknown_backend(tiny_dir):
    from umakit.errors import InvalidArgumentError

    with pytest.raises(InvalidArgumentError, match="unknown backend 'tpu'"):
        umakit.load(tiny_dir("llama"), backend="tpu")


@pytest.mark.parametrize("backend", ["mlx", "torch"])
def test_progress_reports_bytes_loaded(tiny_dir, backend):
    seen = []
    umakit.load(tiny_dir("llama"), backend=backend, progress=lambda done, total: seen.append((done, total)))
    total = umakit.checkpoint_size(tiny_dir("llama"))
    done = [d for d, _ in seen]
    assert done == sorted(done) and seen[-1][1] <= total and seen[-1][0] == seen[-1][1]
    assert seen[-1][1] > 0.99 * total  # everything but the file headers


def _set_config(ckpt, **fields):
    cfg = json.loads((ckpt / "config.json").read_text())
    cfg.update(fields)
    (ckpt / "config.json").write_text(json.dumps(cfg))


def _set_dtype(ckpt, name, dtype):
    """Rewrite one tensor's dtype in the header; I32 has F32's size, so the data still fits exactly."""
    f = ckpt / "model.safetensors"
    data = f.read_bytes()
    n = struct.unpack("<Q", data[:8])[0]
    header = json.loads(data[8:8 + n])
    header[name]["dtype"] = dtype
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    f.write_bytes(struct.pack("<Q", len(raw)) + raw + data[8 + n:])


BROKEN = {
    "negative context": (lambda c: _set_config(c, max_position_embeddings=-1), ConfigError,
                         "max_position_embeddings must be a positive integer, got -1"),
    "number as a string": (lambda c: _set_config(c, hidden_size="64"), ConfigError,
                           'hidden_size must be a positive integer, got "64"'),
    "float layer count": (lambda c: _set_config(c, num_hidden_layers=2.5), ConfigError,
                          "num_hidden_layers must be a positive integer, got 2.5"),
    "rope theta NaN": (lambda c: _set_config(c, rope_theta=float("nan")), ConfigError,
                       "rope_theta must be a positive number, got NaN"),
    "kv heads do not divide heads": (lambda c: _set_config(c, num_key_value_heads=3), ConfigError,
                                     r"num_attention_heads \(4\) must be a multiple of num_key_value_heads \(3\)"),
    "dtype disagrees with data": (lambda c: _set_dtype(c, "model.layers.0.mlp.up_proj.weight", "I32"), CheckpointError,
                                  "tensor model.layers.0.mlp.up_proj.weight is I32 but must be a float tensor"),
}


@pytest.mark.parametrize("case", sorted(BROKEN))
def test_both_engines_report_a_broken_checkpoint_alike(ckpt, case):
    damage, kind, message = BROKEN[case]
    damage(ckpt)
    seen = []
    for backend in ("mlx", "torch"):
        with pytest.raises(kind, match=message) as e:
            umakit.load(ckpt, backend=backend)
        seen.append(str(e.value))
    assert seen[0] == seen[1]


def test_the_engine_checks_a_checkpoint_it_is_handed(ckpt):
    """An engine given a `Checkpoint` directly (not through `umakit.load`) runs the same validation."""
    from umakit.backends.mlx.engine import MLXEngine
    from umakit.checkpoint.files import Checkpoint, open_checkpoint

    good = open_checkpoint(ckpt)
    bad = Checkpoint(good.path, {**good.config, "vocab_size": 0}, good.files, good.tensors)
    with pytest.raises(ConfigError, match="vocab_size must be a positive integer, got 0"):
        MLXEngine.from_checkpoint(bad, device="cpu")
