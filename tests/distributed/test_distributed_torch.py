"""Tensor parallel on the torch engine across ranks started by torchrun (gloo on this CPU)."""

from __future__ import annotations

import time

import pytest

from support.dist_helpers import SCRIPT, TORCHRUN, default_model_dir, run_script, tiny_models, torchrun

pytest.importorskip("torch")

pytestmark = pytest.mark.skipif(not TORCHRUN.exists(), reason="torchrun is not installed")


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return tiny_models(tmp_path_factory.mktemp("dist_torch"))


@pytest.mark.parametrize("name", ["llama", "llama-q4", "qwen3"])
def test_two_torch_ranks_generate_and_batch_the_single_process_tokens(models, tmp_path, name):
    # float32: split matmuls add in another order, and half-precision kernels would round that apart
    single = run_script(tmp_path, models[name], "none", "--batch", "--backend", "torch", "--dtype", "float32")
    sharded = run_script(tmp_path, models[name], "tensor", "--batch", "--backend", "torch", "--dtype", "float32",
                         launcher=torchrun)
    assert sharded["tokens"] == single["tokens"]
    assert sharded["batch"] == single["batch"]
    assert len(sharded["peaks"]) == 2
    assert sharded["weight_bytes"] < single["weight_bytes"]  # the MLX-affine layers split, scales included


def test_the_default_model_over_three_torch_ranks_decodes_its_single_process_tokens(tmp_path):
    default = default_model_dir()  # 9 heads and 3 KV heads: three ranks split it, two cannot
    single = run_script(tmp_path, default, "none", "--tokens", "4", "--backend", "torch", "--dtype", "float32")
    sharded = run_script(tmp_path, default, "tensor", "--tokens", "4", "--backend", "torch", "--dtype", "float32",
                         n=3, launcher=torchrun)
    assert sharded["tokens"] == single["tokens"]
    assert sharded["weight_bytes"] < 0.6 * single["weight_bytes"]


def test_pipeline_on_torch_is_refused_naming_the_mode_it_has(models, tmp_path):
    out = tmp_path / "pp"
    out.mkdir()
    proc = torchrun(2, str(SCRIPT), str(out), str(models["llama"]), "pipeline", "--backend", "torch")
    assert "the torch backend offers tensor parallel only" in proc.stderr
    assert not (out / "result.json").exists()


def test_a_torch_rank_killed_mid_decode_stops_rank_0_naming_it(models, tmp_path):
    out = tmp_path / "kill"
    out.mkdir()
    t0 = time.monotonic()
    proc = torchrun(2, str(SCRIPT), str(out), str(models["llama"]), "tensor", "--backend", "torch",
                    "--kill-rank", "1", "--kill-after", "3", timeout=60)
    assert time.monotonic() - t0 < 30
    assert "rank 0 lost rank 1 of the distributed run" in proc.stderr, proc.stderr[-2000:]
    assert not (out / "result.json").exists()
