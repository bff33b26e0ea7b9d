"""`umakit bench`: the measurement loop, records, comparison and plot."""

import json

import numpy as np
import pytest
from click.testing import CliRunner

import umakit
from umakit.cli.main import main
from umakit.bench import BenchSettings, ceiling_curve, load_record, run_bench
from umakit.errors import InvalidArgumentError
from umakit.hardware import DeviceInfo

DEVICE = DeviceInfo("Test chip", "cpu", 100.0, "user", 8 << 30)


class OnTestChip(umakit.Model):
    """The tiny model with fixed device facts: no probe, and a machine name of its own."""

    device_info = DEVICE


@pytest.fixture(scope="module")
def on_test_chip(tiny_model):
    return OnTestChip(tiny_model.engine, tiny_model.tokenizer, tiny_model.info)


@pytest.fixture(scope="module")
def record(on_test_chip):
    settings = BenchSettings(prompt_tokens=16, gen_tokens=6, repeat=3, warmup=1, contexts=(8, 64))
    return run_bench(on_test_chip, settings).to_dict()


def test_record_holds_runs_summary_and_roofline(record, tiny_model):
    assert len(record["runs"]) == 3
    w = tiny_model.info.weights
    for run in record["runs"]:
        assert run["decode_tps"] > 0 and run["ttft_s"] > 0
        # bytes per token = weights read + KV cache at the mid-run context (16 prompt + 6 // 2)
        assert run["bytes_per_token"] == w.bytes_per_token + tiny_model.engine.kv_bytes_per_token() * (16 + 3)
        assert run["achieved_gbps"] == pytest.approx(run["bytes_per_token"] * run["decode_tps"] / 1e9)
        assert run["mbu"] == pytest.approx(run["achieved_gbps"] / 100.0)
    s = record["summary"]["decode_tps"]
    assert s["min"] <= s["median"] <= s["max"]
    assert [p["context"] for p in record["contexts"]] == [8, 64]
    # the KV term grows with context, so the ceiling falls
    assert record["contexts"][0]["ceiling_tps"] > record["contexts"][1]["ceiling_tps"]
    assert record["machine"]["bandwidth_source"] == "user" and record["model"]["backend"] == "mlx"
    assert record["model"]["name"] == tiny_model.info.name and not record["synthetic"] and record["offload"] is None
    assert {"python", "mlx"} <= set(record["versions"])


def test_ceiling_curve(record):
    m = record["model"]
    assert ceiling_curve(record, [0]) == [pytest.approx(100e9 / m["bytes_per_token"])]


def test_cli_run_compare_and_plot(tiny_dir, tmp_path, record):
    pytest.importorskip("matplotlib")
    out = tmp_path / "r.json"
    r = CliRunner().invoke(main, ["bench", str(tiny_dir("llama")), "--prompt-tokens", "8", "--gen-tokens", "4",
                                  "--repeat", "2", "--warmup", "0", "--json", str(out), "--peak-bandwidth", "50"])
    assert r.exit_code == 0, r.output
    assert "decode tok/s" in r.stdout and "50 GB/s (user)" in r.stdout
    other = tmp_path / "other.json"
    other.write_text(json.dumps(record))
    png = tmp_path / "plot.png"
    r = CliRunner().invoke(main, ["bench", "--compare", str(out), "--compare", str(other), "--plot", str(png)])
    assert r.exit_code == 0, r.output
    assert "Test chip" in r.stdout and "decode @ 64 ctx" in r.stdout
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bad_record_is_a_clear_error(tmp_path):
    bad = tmp_path / "x.json"
    bad.write_text("{}")
    with pytest.raises(InvalidArgumentError, match="not a umakit bench record"):
        load_record(bad)


def test_synthetic_model_has_the_real_shapes(tiny_model):
    from mlx.utils import tree_flatten

    from umakit.api import load_synthetic

    synthetic = load_synthetic(tiny_model.engine.config, backend="mlx")
    real = {k: v.shape for k, v in tree_flatten(tiny_model.engine.model.parameters())}
    fake = dict(tree_flatten(synthetic.engine.model.parameters()))
    assert {k: v.shape for k, v in fake.items()} == real
    assert all(np.abs(np.array(fake[k])).sum() > 0 for k in fake)  # never all zeros
    assert synthetic.info.path is None and synthetic.tokenizer is None


def test_synthetic_preset_matches_the_real_default_model_size():
    from umakit.api import load_synthetic

    model = load_synthetic("smollm2-135m", backend="mlx", bits=8)
    assert model.info.weights.params == 134_515_008  # SmolLM2-135M's parameter count
    assert model.info.name == "smollm2-135m"


def test_batched_bench_reports_aggregate_throughput(on_test_chip):
    settings = BenchSettings(prompt_tokens=8, gen_tokens=5, repeat=1, warmup=0, batch=3)
    rec = run_bench(on_test_chip, settings).to_dict()
    run = rec["runs"][0]
    w = on_test_chip.info.weights
    # one step reads the weights once and every row's cache
    assert run["bytes_per_token"] == w.bytes_per_token + on_test_chip.engine.kv_bytes_per_token() * 3 * (8 + 2)
    # the weights are read once per step: GB/s counts steps (aggregate tok/s / rows), not tokens
    assert run["achieved_gbps"] == pytest.approx(run["bytes_per_token"] * run["decode_tps"] / 3 / 1e9)
    assert run["decode_tps"] > 0 and rec["settings"]["batch"] == 3


def test_settings_name_the_engine_features_they_need():
    from umakit.backends.base import BATCH, QUANTIZED_KV

    assert BenchSettings().needs == frozenset()
    assert BenchSettings(kv_bits=8).needs == {QUANTIZED_KV} and BenchSettings(batch=2).needs == {BATCH}
    with pytest.raises(InvalidArgumentError, match="--batch with --kv-bits"):
        BenchSettings(kv_bits=8, batch=2)


@pytest.mark.parametrize("backend", ["mlx", "torch"])
def test_cli_bench_of_a_synthetic_preset_on_each_engine(backend, tmp_path):
    out = tmp_path / "s.json"
    r = CliRunner().invoke(main, ["bench", "--synthetic", "smollm2-135m", "--backend", backend,
                                           "--prompt-tokens", "4", "--gen-tokens", "2", "--repeat", "1",
                                           "--warmup", "0", "--json", str(out)])
    assert r.exit_code == 0, r.output
    record = json.loads(out.read_text())
    assert record["synthetic"] and record["model"]["backend"] == backend and record["offload"] is None
