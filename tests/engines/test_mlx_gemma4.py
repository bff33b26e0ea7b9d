"""gemma4 checkpoints saved by transformers, on the MLX engine (mlx-lm's gemma4_text): the configs transformers v5
writes name the global layers' head size and count in ``per_layer_config`` only, which umakit's config reading
gives mlx-lm as ``global_head_dim`` and ``num_global_key_value_heads`` (checkpoint/config.py); logits and greedy
tokens against transformers for the three tiny checkpoints the torch engine's tests use."""

from __future__ import annotations

import numpy as np
import pytest

import umakit
from engines.test_torch_gemma4 import MOE, PROMPT, VARIANTS, greedy, make
from support.oracle import greedy_reference, ref_logits, reference

pytest.importorskip("mlx.core")
pytest.importorskip("transformers")


@pytest.mark.parametrize("variant", ["defaults", "every-feature", "mixture"])
def test_gemma4_on_mlx_is_transformers(variant, tmp_path):
    extra = {**VARIANTS["every-feature"], **MOE} if variant == "mixture" else VARIANTS[variant]
    path = make(tmp_path / variant, **extra)
    model = umakit.load(path, backend="mlx", dtype="float32")
    ref = reference(path)
    want = ref_logits(ref, PROMPT)
    np.testing.assert_allclose(model.logits(PROMPT), want, atol=1e-5 * np.abs(want).max(), rtol=0)
    assert greedy(model, PROMPT, 8) == greedy_reference(ref, PROMPT, 8)
