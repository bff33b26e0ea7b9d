"""`umakit.load(..., quantize=...)`: quantized in memory, nothing written."""

import numpy as np
import pytest

import umakit
from umakit.errors import InvalidArgumentError


def test_quantize_on_load_stays_close_to_float(tiny_dir, tiny_model):
    path = tiny_dir("llama")
    before = sorted(p.name for p in path.iterdir())
    q8 = umakit.load(path, backend="mlx", quantize={"bits": 8, "group_size": 32})
    assert q8.info.weights.quantization.startswith("8-bit g32")
    assert q8.info.weights.total_bytes < 0.5 * tiny_model.info.weights.total_bytes
    ids = [5, 17, 42, 99, 3, 250]
    diff = np.abs(q8.logits(ids) - tiny_model.logits(ids)).max()
    assert 0 < diff < 0.05
    assert sorted(p.name for p in path.iterdir()) == before  # no files written


def test_quantize_on_load_refuses_quantized_checkpoint(tiny_dir, tmp_path):
    from umakit.quantize import quantize

    dst = tmp_path / "q4"
    quantize(tiny_dir("llama"), dst, bits=4, group_size=32)
    with pytest.raises(InvalidArgumentError, match="already quantized .*needs a float checkpoint"):
        umakit.load(dst, backend="mlx", quantize=8)
