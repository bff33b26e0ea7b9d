"""Tensor parallel on MLX across ranks started by the real launcher (mlx.launch, ring backend, localhost).

Each test starts processes: tests/support/dist_scripts/mlx_run.py for the Python API, `umakit` itself for the
CLI. Two ranks on this 2-core machine measure correctness and failure handling, not speed.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import time

import pytest

from support.dist_helpers import LAUNCH, RUN_LIMIT_S, SCRIPT, VENV_BIN, default_model_dir, launch, run_script, tiny_models
from support.tiny import make_tiny_model

pytest.importorskip("mlx.core")

pytestmark = pytest.mark.skipif(not LAUNCH.exists(), reason="mlx.launch is not installed")


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return tiny_models(tmp_path_factory.mktemp("dist"))


@pytest.mark.parametrize("mode, name", [("tensor", "llama"), ("tensor", "llama-q4"), ("tensor", "qwen3"),
                                        ("tensor", "qwen3-q8"), ("pipeline", "llama-q4"), ("pipeline", "qwen3")])
def test_two_ranks_generate_and_batch_the_single_process_tokens(models, tmp_path, mode, name):
    single = run_script(tmp_path, models[name], "none", "--batch")
    sharded = run_script(tmp_path, models[name], mode, "--batch")
    assert sharded["tokens"] == single["tokens"]
    assert sharded["batch"] == single["batch"]
    assert len(sharded["peaks"]) == 2  # both ranks ran to their end
    # Rank 0 reports its own share (tensor: half of each matrix; pipeline: half of the layers), embeddings whole.
    assert sharded["weight_bytes"] < single["weight_bytes"]
    assert any(f"{mode} parallel over 2 ranks" in w for w in sharded["warnings"])


@pytest.fixture(scope="module")
def wide(tmp_path_factory):
    return make_tiny_model("llama", tmp_path_factory.mktemp("wide") / "wide", hidden_size=256, intermediate_size=1024,
                           num_hidden_layers=6, num_attention_heads=8, num_key_value_heads=4)


@pytest.mark.parametrize("mode", ["tensor", "pipeline"])
def test_each_rank_holds_about_half_of_a_model_whose_layers_dominate(wide, tmp_path, mode):
    single = run_script(tmp_path, wide, "none", "--tokens", "4")
    sharded = run_script(tmp_path, wide, mode, "--tokens", "4")
    assert sharded["tokens"] == single["tokens"]
    assert sharded["weight_bytes"] <= 0.65 * single["weight_bytes"]
    for peak in sharded["peaks"]:  # every rank's peak, loading included
        assert peak <= 0.65 * single["peaks"][0], (peak, single["peaks"])


def test_the_default_model_over_three_ranks_decodes_its_single_process_tokens(tmp_path):
    default = default_model_dir()
    # 9 heads and 3 KV heads: two ranks cannot split it, three can.
    single = run_script(tmp_path, default, "none", "--tokens", "4")
    sharded = run_script(tmp_path, default, "tensor", "--tokens", "4", n=3)
    assert sharded["tokens"] == single["tokens"]
    assert sharded["weight_bytes"] < 0.6 * single["weight_bytes"]


def test_the_cli_under_mlx_launch_prints_once_what_one_process_prints(models):
    args = ["generate", "-m", str(models["qwen3"]), "--prompt", "Paris is", "--raw", "--temp", "0", "--max-tokens", "8",
            "--backend", "mlx", "--device", "cpu", "--json"]
    umakit = str(VENV_BIN / "umakit")
    single = subprocess.run([umakit, *args], capture_output=True, text=True, timeout=RUN_LIMIT_S)
    sharded = launch(2, umakit, *args, "--parallel", "tensor")
    assert sharded.returncode == 0, sharded.stderr
    lines = [line for line in sharded.stdout.splitlines() if line.startswith("{")]
    assert len(lines) == 1  # rank 0 alone prints
    assert json.loads(lines[0])["tokens"] == json.loads(single.stdout)["tokens"]
    link = json.loads(lines[0])["stats"]["link"]  # the link's share of a step, absent from the single run
    assert link["comm_s_per_token"] > 0 and 0 < link["share_of_step"] <= 1
    assert "link" not in json.loads(single.stdout)["stats"]


def test_an_architecture_without_the_mode_is_refused_naming_the_modes_it_has(tmp_path):
    gemma = make_tiny_model("gemma3", tmp_path / "gemma3")  # mlx-lm has no shard() for it; sliding layers
    sharded = launch(2, str(VENV_BIN / "umakit"), "generate", "-m", str(gemma), "--prompt", "hi",
                     "--backend", "mlx", "--device", "cpu", "--parallel", "tensor")
    assert "has no tensor parallel mode here; it offers none of tensor, pipeline" in sharded.stderr


def test_bench_under_mlx_launch_writes_one_record_of_the_sharded_run(models, tmp_path):
    out = tmp_path / "bench.json"
    proc = launch(2, str(VENV_BIN / "umakit"), "bench", str(models["qwen3"]), "--backend", "mlx", "--device", "cpu",
                  "--parallel", "tensor", "--prompt-tokens", "8", "--gen-tokens", "4", "--repeat", "1",
                  "--warmup", "0", "--json", str(out))
    assert proc.returncode == 0, proc.stderr[-2000:]
    record = json.loads(out.read_text())
    assert record["model"]["backend"] == "mlx" and record["summary"]["decode_tps"]["median"] > 0
    assert record["model"]["comm_s_per_token"] > 0 and 0 < record["summary"]["comm_share"]["median"] <= 1
    assert "waits on collectives (measured at load)" in proc.stderr


def test_parallel_without_a_launcher_says_how_to_start_it(models):
    from click.testing import CliRunner

    from umakit.cli.main import main

    r = CliRunner().invoke(main, ["generate", "-m", str(models["llama"]), "--prompt", "hi", "--backend", "mlx",
                                 "--device", "cpu", "--parallel", "tensor"])
    assert r.exit_code != 0 and "start the command with mlx.launch" in r.output


def test_ranks_with_different_checkpoints_are_refused_at_start_up(models, tmp_path):
    other = tmp_path / "other"
    shutil.copytree(models["llama"], other)
    config = json.loads((other / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**config, "rms_norm_eps": 1e-5}))
    out = tmp_path / "mismatch"
    out.mkdir()
    proc = launch(2, str(SCRIPT), str(out), str(models["llama"]), "tensor", "--model-rank1", str(other))
    assert "rank(s) 1 loaded a different checkpoint or umakit version than rank 0" in proc.stderr
    assert not (out / "result.json").exists()


@pytest.mark.parametrize("killed, survivor", [(1, 0), (0, 1)])
def test_a_rank_killed_mid_decode_ends_the_others_with_one_line_naming_it(models, tmp_path, killed, survivor):
    out = tmp_path / "kill"
    out.mkdir()
    t0 = time.monotonic()
    proc = launch(2, str(SCRIPT), str(out), str(models["llama"]), "tensor", "--kill-rank", str(killed),
                  "--kill-after", "3", timeout=60)
    assert time.monotonic() - t0 < 30
    assert f"rank {survivor} lost rank {killed} of the distributed run" in proc.stderr, proc.stderr[-2000:]
    assert not (out / "result.json").exists()
