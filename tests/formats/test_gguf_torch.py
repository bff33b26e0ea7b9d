"""Every architecture of the GGUF import list runs on the default engine (torch on this CPU), as transformers
runs the same GGUF file."""

import numpy as np
import pytest

import umakit
from support.gguf_files import EXACT_LAYERS, IDS, hf_forward, write_gguf
from gguf import GGMLQuantizationType as T
from umakit.checkpoint.gguf import import_gguf
from umakit.checkpoint.gguf.arch import SPECS


@pytest.mark.parametrize("arch", sorted(SPECS))
def test_imported_gguf_runs_on_the_default_engine(arch, tmp_path, monkeypatch):
    from umakit import backends

    monkeypatch.setattr(backends, "is_apple_silicon", lambda: False)
    monkeypatch.setattr(backends, "_cuda_available", lambda: False)
    layers = EXACT_LAYERS * (3 if arch == "gemma3" else 1)  # gemma3: 5 sliding layers and a global one
    src = write_gguf(tmp_path / f"{arch}.gguf", arch, layers=layers, tied=arch != "llama", output=T.Q4_K)
    import_gguf(src, tmp_path / "out")
    model = umakit.load(tmp_path / "out", dtype="float32")
    assert (model.info.backend, model.info.device) == ("torch", "cpu")
    ours, ref = model.logits(IDS), hf_forward(src, IDS)
    assert np.abs(ours - ref).max() < 1e-4 * max(1.0, np.abs(ref).max()), np.abs(ours - ref).max()
