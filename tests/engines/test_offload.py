"""Offload: the layer planner's arithmetic, and the streaming engine on CPU against the resident one."""

import json

import numpy as np
import pytest
from click.testing import CliRunner

import umakit.cli.main
import umakit
from support.markers import requires_default_model
from support.tiny import make_tiny_model
from umakit import hardware
from umakit.hardware import probes as hw_probes
from umakit.errors import InvalidArgumentError
from umakit.plan.placement import RING_SLOTS, parse_size, plan_layers

LAYERS = 5  # more layers than ring slots, and not a multiple of them: the ring wraps mid-pass
TOKENS = [1, 17, 33, 2, 99, 5, 64, 7, 8, 120, 3]


# -- planner ---------------------------------------------------------------------------
@pytest.mark.parametrize("text, expected", [
    ("24GB", 24 * 2**30), ("23.5 GiB", int(23.5 * 2**30)), ("512MB", 512 * 2**20), ("512mib", 512 * 2**20),
    ("1000", 1000), (2048, 2048),
])
def test_sizes_read_as_bytes(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize("text", ["24XB", "GB", "-3GB", "0", "", "1.2.3GB"])
def test_unreadable_sizes_are_refused(text):
    with pytest.raises(InvalidArgumentError):
        parse_size(text)


def test_gpu_layers_keeps_the_first_layers():
    layers = [100, 100, 100, 100, 120]
    p = plan_layers(layers, 50, gpu_layers=2)
    assert (p.resident_layers, p.offloaded_layers) == ((0, 1), (2, 3, 4))
    assert (p.resident_bytes, p.streamed_bytes) == (250, 320)
    assert p.ring_bytes == 3 * 120  # three slots of the largest streamed layer
    assert plan_layers(layers, 50, gpu_layers=99).offloaded_layers == ()  # more than there are: all resident
    assert plan_layers(layers, 50, gpu_layers=99).ring_bytes == 0
    assert plan_layers(layers, 50, gpu_layers=4).ring_bytes == 120  # one streamed layer needs one slot
    assert plan_layers(layers, 50, gpu_layers=0).resident_bytes == 50


def test_budget_keeps_as_many_layers_as_fit_next_to_the_ring_and_reserve():
    layers = [100] * 10
    fixed, reserve = 200, 300
    for keep in range(0, 7):
        budget = fixed + reserve + keep * 100 + RING_SLOTS * 100
        assert plan_layers(layers, fixed, vram_budget=budget, reserved_bytes=reserve).gpu_layers == keep
        if keep:
            assert plan_layers(layers, fixed, vram_budget=budget - 1, reserved_bytes=reserve).gpu_layers == keep - 1
    # everything fits: no ring at all
    whole = plan_layers(layers, fixed, vram_budget=fixed + reserve + 1000, reserved_bytes=reserve)
    assert whole.gpu_layers == 10 and whole.ring_bytes == 0 and whole.vram_bytes == fixed + reserve + 1000
    # one byte short of everything: streaming 1-3 layers saves nothing (each needs its own slot), so 6 stay
    assert plan_layers(layers, fixed, vram_budget=fixed + reserve + 999, reserved_bytes=reserve).gpu_layers == 6


def test_a_budget_below_the_resident_minimum_is_a_clear_error():
    with pytest.raises(InvalidArgumentError, match="cannot hold even the resident minimum"):
        plan_layers([100] * 10, 200, vram_budget=200 + 300 + 3 * 100 - 1, reserved_bytes=300)
    with pytest.raises(InvalidArgumentError, match="one of them"):
        plan_layers([100], 0, gpu_layers=1, vram_budget=10**9)
    with pytest.raises(InvalidArgumentError, match="one of them"):
        plan_layers([100], 0)
    with pytest.raises(InvalidArgumentError, match="0 or more"):
        plan_layers([100], 0, gpu_layers=-1)


# -- the engine on CPU -------------------------------------------------------------------
@pytest.fixture(scope="module", params=["llama", "qwen3"])
def deep_dir(request, tmp_path_factory):
    return make_tiny_model(request.param, tmp_path_factory.mktemp(f"{request.param}-deep"), num_hidden_layers=LAYERS)


@pytest.fixture(scope="module")
def resident(deep_dir):
    return umakit.load(deep_dir, backend="torch", device="cpu", dtype="float32")


def test_any_number_of_offloaded_layers_gives_the_resident_logits_and_tokens(deep_dir, resident):
    expected_logits = resident.logits(TOKENS)
    expected = resident.generate("a b c", raw=True, temperature=0, max_tokens=24)
    for n in range(LAYERS + 1):
        m = umakit.load(deep_dir, backend="torch", device="cpu", dtype="float32", gpu_layers=n)
        assert m.engine.offload.gpu_layers == n
        np.testing.assert_array_equal(m.logits(TOKENS), expected_logits)  # prefill: many tokens per pass
        got = m.generate("a b c", raw=True, temperature=0, max_tokens=24)  # decode: one token per pass
        assert got.tokens == expected.tokens, f"{n} resident layers"


def test_each_decode_step_copies_the_streamed_layers_once(deep_dir):
    m = umakit.load(deep_dir, backend="torch", device="cpu", dtype="float32", gpu_layers=1)
    streamer = m.engine.model.streamer
    assert len(streamer.slots) == RING_SLOTS and streamer.order == [1, 2, 3, 4]
    per_pass = streamer.streamed_bytes
    assert per_pass == m.engine.offload.streamed_bytes == m.info.weights.streamed_bytes_per_token
    m.logits(TOKENS)
    # the first pass also fills the ring with the next pass's first layers, ahead of time
    assert streamer.copied_bytes == per_pass + sum(streamer.layer_bytes[:RING_SLOTS])
    assert [j for j, _ in streamer.queue] == [0, 1, 2]
    before = streamer.copied_bytes
    m.logits(TOKENS)  # from then on, each pass copies every streamed layer exactly once
    assert streamer.copied_bytes - before == per_pass
    cache = m.make_cache()
    tokens = m.engine.generate_tokens(TOKENS, cache, umakit.SamplingParams(temperature=0), seed=0)
    next(tokens)
    start = streamer.copied_bytes
    for _ in range(6):
        next(tokens)
    assert streamer.copied_bytes - start == 6 * per_pass


def test_weights_are_accounted_once_whether_resident_or_streamed(deep_dir, resident):
    m = umakit.load(deep_dir, backend="torch", device="cpu", dtype="float32", gpu_layers=2)
    w, r = m.info.weights, resident.info.weights
    assert w.total_bytes == r.total_bytes and w.by_category == r.by_category
    o = m.engine.offload
    layer = (w.total_bytes - o.fixed_bytes) / LAYERS  # the blocks are all alike
    assert o.resident_bytes == o.fixed_bytes + 2 * layer
    assert o.resident_bytes + sum(m.engine.model.streamer.bytes_by_category.values()) == w.total_bytes
    assert o.streamed_bytes >= w.total_bytes - o.resident_bytes  # the host copies are 64-byte aligned


def test_batches_with_offloaded_layers_equal_the_resident_batches(deep_dir, resident):
    prompts = ["a b c", "the quick brown fox", "x"]
    expected = [r.tokens for r in resident.generate_batch(prompts, raw=True, temperature=0, max_tokens=12)]
    m = umakit.load(deep_dir, backend="torch", device="cpu", dtype="float32", gpu_layers=2)
    got = [r.tokens for r in m.generate_batch(prompts, raw=True, temperature=0, max_tokens=12)]
    assert got == expected


def test_quantized_checkpoint_streams_in_float_and_keeps_its_tokens(deep_dir, tmp_path):
    from umakit.quantize import quantize

    q = tmp_path / "q8"
    quantize(deep_dir, q, bits=8, group_size=32)
    base = umakit.load(q, backend="torch", device="cpu", dtype="float16")  # float16 weights, float32 math
    m = umakit.load(q, backend="torch", device="cpu", dtype="float16", gpu_layers=2)
    assert m.info.dtype == base.info.dtype
    kinds = {type(mod).__name__ for mod in m.engine.model.model.layers[4].modules()}
    assert "Fp16Linear" not in kinds  # FBGEMM's packed weights are not tensors: streamed layers run as float32
    np.testing.assert_allclose(m.logits(TOKENS), base.logits(TOKENS), atol=5e-3, rtol=5e-3)
    assert (m.generate("a b c", raw=True, temperature=0, max_tokens=16).tokens
            == base.generate("a b c", raw=True, temperature=0, max_tokens=16).tokens)


def test_budget_on_the_engine_and_its_errors(deep_dir):
    m = umakit.load(deep_dir, backend="torch", device="cpu", dtype="float32", vram_budget="1GB")
    assert m.engine.offload.gpu_layers == LAYERS and m.engine.model.streamer is None
    with pytest.raises(InvalidArgumentError, match="resident minimum"):
        umakit.load(deep_dir, backend="torch", device="cpu", dtype="float32", vram_budget="10KB")
    with pytest.raises(InvalidArgumentError, match="does not support --gpu-layers and --vram-budget"):
        umakit.load(deep_dir, backend="mlx", gpu_layers=1)
    # "auto" picks the engine that can offload
    assert umakit.load(deep_dir, gpu_layers=1, dtype="float32").info.backend == "torch"


def test_the_engine_reserves_kv_as_plan_counts_it(deep_dir):
    from umakit.backends.torch.load.loader import CUDA_CACHE_TOKENS
    from umakit.plan.placement import reserve_tokens, reserved_bytes
    from umakit.plan.shapes import KV_RESERVE_TOKENS

    m = umakit.load(deep_dir, backend="torch", device="cpu", dtype="float32", gpu_layers=1)
    assert CUDA_CACHE_TOKENS == KV_RESERVE_TOKENS  # one constant: the cache a GPU starts with is what is reserved
    assert m.engine.offload.reserved_bytes == reserved_bytes(m.engine.config, reserve_tokens(m.engine.config)) > 0


def test_stats_report_the_streamed_bytes_against_the_offload_ceiling(deep_dir, monkeypatch, tmp_path):
    monkeypatch.setenv("UMAKIT_HOME", str(tmp_path))  # a machine that has not been measured yet
    probes = []
    monkeypatch.setattr(hw_probes, "h2d_gbps", lambda index=0, kind="cpu", pinned=True: probes.append(kind) or 8.0)
    assert hardware.h2d_bandwidth("cpu") == {"pinned": 8.0, "pageable": 8.0}  # nothing is pinned without CUDA
    cached = hardware.h2d_bandwidth("cpu")
    assert cached == {"pinned": 8.0, "pageable": 8.0} and probes == ["cpu"] * hw_probes.PROBE_RUNS  # best of runs, once
    m = umakit.load(deep_dir, backend="torch", device="cpu", dtype="float32", gpu_layers=1, peak_bandwidth=20.0)
    s = m.generate("a b c", raw=True, temperature=0, max_tokens=12).stats
    streamed = m.info.weights.streamed_bytes_per_token
    assert s.pcie_bytes_per_token == streamed > 0 and s.pcie_peak_gbps == 8.0
    assert s.pcie_gbps == pytest.approx(streamed * s.decode_tps / 1e9)
    resident = s.bytes_per_token - streamed
    assert s.offload_ceiling_tps == pytest.approx(1 / (resident / 20e9 + streamed / 8e9))
    assert s.overlap_efficiency == pytest.approx(s.decode_tps / s.offload_ceiling_tps)
    plain = umakit.load(deep_dir, backend="torch", device="cpu", dtype="float32", peak_bandwidth=20.0)
    assert plain.generate("a", raw=True, temperature=0, max_tokens=4).stats.pcie_bytes_per_token == 0


def test_cli_offload_flags_and_their_errors(deep_dir):
    runner = CliRunner()
    ok = runner.invoke(umakit.cli.main.main, ["generate", "-m", str(deep_dir), "-p", "a b c", "--raw", "--temp", "0",
                                      "--max-tokens", "6", "--gpu-layers", "2", "--dtype", "float32"])
    assert ok.exit_code == 0, ok.output
    assert "streamed" in ok.output and "offload ceiling" in ok.output
    for args, message in ((["--vram-budget", "2KB"], "resident minimum"), (["--vram-budget", "lots"], "as a size"),
                          (["--backend", "mlx", "--gpu-layers", "1"], "does not support --gpu-layers and --vram-budget")):
        bad = runner.invoke(umakit.cli.main.main, ["generate", "-m", str(deep_dir), "-p", "hi", *args])
        assert bad.exit_code != 0 and message in bad.output and "Traceback" not in bad.output


@pytest.mark.slow
@requires_default_model
def test_default_model_with_most_layers_streamed_matches_resident():
    prompt = "What is the capital of France?"
    base = umakit.load(backend="torch", device="cpu", dtype="float32")
    m = umakit.load(backend="torch", device="cpu", dtype="float32", gpu_layers=4)
    assert len(m.engine.offload.offloaded_layers) == 26
    assert m.generate(prompt, temperature=0, max_tokens=12).tokens == base.generate(prompt, temperature=0,
                                                                                      max_tokens=12).tokens


# -- bench --offload-sweep ------------------------------------------------------------------
@pytest.mark.parametrize("layers, steps, expected", [
    (30, 5, [30, 22, 15, 8, 0]), (5, 3, [5, 3, 0]), (2, 5, [2, 1, 0]), (1, 2, [1, 0]),
])
def test_sweep_steps_run_from_all_resident_to_all_streamed(layers, steps, expected):
    from umakit.bench import sweep_gpu_layers

    assert sweep_gpu_layers(layers, steps) == expected


@pytest.fixture(scope="module")
def llama_deep(tmp_path_factory):
    return make_tiny_model("llama", tmp_path_factory.mktemp("llama-sweep"), num_hidden_layers=LAYERS)


def test_offload_sweep_writes_json_and_plot(llama_deep, tmp_path):
    pytest.importorskip("matplotlib")
    from umakit.bench import modelled_sweep

    out, png = tmp_path / "sweep.json", tmp_path / "sweep.png"
    r = CliRunner().invoke(umakit.cli.main.main, [
        "bench", str(llama_deep), "--offload-sweep", "--sweep-steps", "3", "--prompt-tokens", "8", "--gen-tokens", "4",
        "--repeat", "1", "--warmup", "0", "--dtype", "float32", "--json", str(out), "--plot", str(png)])
    assert r.exit_code == 0, r.output
    assert "offload sweep" in r.output and "| 100% | 0/5 |" in r.output
    record = json.loads(out.read_text())
    points = record["offload_sweep"]
    assert [p["gpu_layers"] for p in points] == [5, 3, 0]
    streamed = [p["streamed_bytes_per_token"] for p in points]
    assert streamed[0] == 0 < streamed[1] < streamed[2]
    assert streamed[2] * 2 == pytest.approx(streamed[1] * 5, rel=0.01)  # alike layers: 5 streamed vs 2
    link, peak = record["machine"]["pcie_h2d_gbps"], record["machine"]["peak_bandwidth_gbps"]
    for p in points:
        assert p["achieved_gbps"] == pytest.approx(p["bytes_per_token"] * p["decode_tps"] / 1e9)
    for p in points[1:]:
        resident = p["bytes_per_token"] - p["streamed_bytes_per_token"]
        assert p["ceiling_tps"] == pytest.approx(1 / (resident / (peak * 1e9) + p["streamed_bytes_per_token"] / (link * 1e9)),
                                                 rel=1e-6)
        assert p["efficiency"] == pytest.approx(p["decode_tps"] / p["ceiling_tps"])
        assert p["pcie_gbps"] == pytest.approx(p["streamed_bytes_per_token"] * p["decode_tps"] / 1e9)
    xs, ys = modelled_sweep(record)
    assert len(xs) == LAYERS + 1 and ys[0] == pytest.approx(points[0]["ceiling_tps"])
    assert ys[-1] == pytest.approx(points[-1]["ceiling_tps"], rel=1e-6)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bench_with_offloaded_layers_is_labelled_pcie_by_compare(llama_deep, tmp_path):
    from umakit.bench.compare import limiting_link

    out = tmp_path / "b.json"
    r = CliRunner().invoke(umakit.cli.main.main, [
        "bench", str(llama_deep), "--gpu-layers", "2", "--prompt-tokens", "8", "--gen-tokens", "4", "--repeat", "1",
        "--warmup", "0", "--dtype", "float32", "--json", str(out)])
    assert r.exit_code == 0, r.output
    record = json.loads(out.read_text())
    assert record["offload"]["gpu_layers"] == 2 and record["offload"]["streamed_bytes_per_token"] > 0
    assert record["summary"]["pcie_gbps"]["median"] > 0 and record["machine"]["pcie_h2d_gbps"] > 0
    assert limiting_link(record) == "PCIe"


def test_offload_sweep_refuses_what_it_cannot_do(llama_deep):
    runner = CliRunner()
    both = runner.invoke(umakit.cli.main.main, ["bench", str(llama_deep), "--offload-sweep", "--gpu-layers", "1"])
    assert both.exit_code != 0 and "drop --gpu-layers" in both.output
    mlx = runner.invoke(umakit.cli.main.main, ["bench", str(llama_deep), "--offload-sweep", "--backend", "mlx"])
    assert mlx.exit_code != 0 and "does not support --gpu-layers and --vram-budget" in mlx.output and "Traceback" not in mlx.output


def test_a_model_too_big_for_free_vram_is_refused_with_the_flag_that_streams_it(deep_dir):
    from umakit.backends.torch.load.loader import check_fits, plan_offload
    from umakit.backends.torch.model.llama import ModelArgs
    from umakit.checkpoint.files import open_checkpoint

    import torch

    ckpt = open_checkpoint(deep_dir)
    args = ModelArgs.from_config(ckpt.config)
    shapes = {k: t.shape for k, t in ckpt.tensors.items()}
    whole = plan_offload(args, ckpt.config, shapes, torch.float32, LAYERS, None)
    need = whole.resident_bytes + whole.reserved_bytes
    check_fits(args, ckpt.config, shapes, torch.float32, need)  # fits exactly: no error
    layer = (whole.resident_bytes - whole.fixed_bytes) // LAYERS
    for free in (need - 1, need - layer - 1):  # the ring's slots cost layers too: 1 and then 0 stay resident
        split = plan_offload(args, ckpt.config, shapes, torch.float32, None, free)
        assert split.gpu_layers < LAYERS
        with pytest.raises(InvalidArgumentError, match=f"--gpu-layers {split.gpu_layers} "):
            check_fits(args, ckpt.config, shapes, torch.float32, free)
    with pytest.raises(InvalidArgumentError, match="more quantized model"):
        check_fits(args, ckpt.config, shapes, torch.float32, whole.reserved_bytes)
