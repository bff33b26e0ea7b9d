"""SmolLM3 GGUFs: llama.cpp stores them in Llama's layout (its converter subclasses Llama's, Q and K permuted the
same way) and hard-codes their NoPE step, every fourth layer's attention taking no RoPE (``n_no_rope_layer_step``
4, no metadata key). transformers' GGUF loader does not read the architecture, so the oracles are the same file
read as Llama (which tests/formats/test_gguf_import.py holds to transformers' loader) and transformers' own
SmolLM3 model holding the imported weights."""

import json

import numpy as np
import pytest
import torch

import umakit
from umakit.checkpoint.gguf import import_gguf
from support.gguf_files import EXACT_LAYERS, IDS, stored_values, write_gguf

transformers = pytest.importorskip("transformers")


def test_smollm3_imports_as_llama_with_every_fourth_layer_without_rope(tmp_path):
    layers = EXACT_LAYERS * 2  # four layers: the fourth takes no RoPE
    src = write_gguf(tmp_path / "smollm3.gguf", "smollm3", layers=layers)
    import_gguf(src, tmp_path / "smollm3")
    config = json.loads((tmp_path / "smollm3" / "config.json").read_text())
    assert config["model_type"] == "smollm3" and config["architectures"] == ["SmolLM3ForCausalLM"]
    assert config["no_rope_layers"] == [1, 1, 1, 0]  # llama.cpp: RoPE where (layer + 1) % 4 != 0

    # the same tensors (same seed, same layers) written as Llama: the import holds the same weights
    import_gguf(write_gguf(tmp_path / "llama.gguf", "llama", layers=layers), tmp_path / "llama")
    ours, as_llama = stored_values(tmp_path / "smollm3"), stored_values(tmp_path / "llama")
    assert ours.keys() == as_llama.keys()
    assert all(np.array_equal(ours[k], as_llama[k]) for k in ours)

    # transformers' SmolLM3 holding those weights is what the torch engine runs on the import
    hf_config = transformers.SmolLM3Config(**{k: v for k, v in config.items() if k not in ("quantization", "umakit")},
                                           pad_token_id=None)  # its default, 128004, is past the tiny vocabulary
    ref = transformers.SmolLM3ForCausalLM(hf_config).eval()
    missing, unexpected = ref.load_state_dict({k: torch.from_numpy(v) for k, v in ours.items()}, strict=False)
    assert not unexpected and all(k == "lm_head.weight" for k in missing)  # tied to the table
    ref.tie_weights()
    with torch.no_grad():
        want = ref(torch.tensor([IDS])).logits[0].numpy()
    assert umakit.load(tmp_path / "smollm3", device="cpu").info.backend == "torch"  # the default engine takes it
    for backend in ("torch", "mlx"):
        got = umakit.load(tmp_path / "smollm3", backend=backend, dtype="float32").logits(IDS)
        np.testing.assert_allclose(got, want, atol=1e-4 * np.abs(want).max(), rtol=0, err_msg=backend)
    llama = umakit.load(tmp_path / "llama", backend="torch", dtype="float32").logits(IDS)
    assert not np.allclose(llama, want, atol=1e-3 * np.abs(want).max())  # the NoPE layer is not Llama's
