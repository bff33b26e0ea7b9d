"""What a mixture-of-experts run reports: the bytes a decode token reads (only the experts it is routed to),
and, streaming routed experts from host memory, the expert bytes copied per token and the device cache's
hit rate (umakit/plan/placement.py StreamCounters -> roofline.OffloadStats -> GenerationStats -> the stats line)."""

import pytest

import umakit
from umakit import backends, hardware
from umakit.backends import common
from umakit.cli.format import stats_line
from umakit.errors import UnsupportedModelError
from umakit.hardware import probes as hw_probes
from umakit.plan.placement import ROUTED_EXPERTS, StreamCounters, reserved_bytes

PER_TOKEN, EXPERTS = 2, 4  # tests/support/tiny.py's MoE configs


@pytest.fixture
def measured_link(monkeypatch, tmp_path):
    """A machine whose host copies run at 8 GB/s (no probe runs)."""
    monkeypatch.setenv("UMAKIT_HOME", str(tmp_path))
    monkeypatch.setattr(hw_probes, "h2d_gbps", lambda index=0, kind="cpu", pinned=True: 8.0)
    assert hardware.h2d_bandwidth("cpu")["pinned"] == 8.0


def per_expert_bytes(m, layer: int) -> int:
    switch = m.engine.model.model.layers[layer]._modules[m.engine.args.ffn_name].switch_mlp
    return sum(p.weight[0].nbytes for p in (switch.gate_proj, switch.up_proj, switch.down_proj))


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe"])
def test_moe_offload_stats_report_the_expert_bytes_copied_per_token(tiny_dir, measured_link, family):
    m = umakit.load(tiny_dir(family), backend="torch", device="cpu", dtype="float32", gpu_layers=1,
                    peak_bandwidth=20.0)
    one = per_expert_bytes(m, 1)
    s = m.generate("a b c", raw=True, temperature=0, max_tokens=8).stats
    assert s.offload.placement == ROUTED_EXPERTS and s.decode_tps > 0
    # no device cache: every decode step copies the 2 experts it picked in the one streamed layer, as planned
    assert s.pcie_bytes_per_token == PER_TOKEN * one == m.engine.offload.streamed_bytes
    assert s.offload.hit_rate is None and s.to_dict()["expert_offload"] == {
        "streamed_bytes_per_token": PER_TOKEN * one, "cache_hit_rate": None}
    resident = s.bytes_per_token - s.pcie_bytes_per_token
    assert resident > 0 and s.offload_ceiling_tps == pytest.approx(1 / (resident / 20e9 + s.pcie_bytes_per_token / 8e9))
    line = stats_line(s)
    assert "streamed experts " in line and "expert cache hits" not in line

    m.engine.experts_streamer.cached = EXPERTS  # torch's own knob: keep every expert once seen
    s = m.generate("a b c", raw=True, temperature=0, max_tokens=8).stats
    hit = s.offload.hit_rate
    assert 0 < hit <= 1 and s.expert_hit_rate == hit and s.to_dict()["expert_offload"]["cache_hit_rate"] == hit
    # each step asks for 2 experts per projection; the misses are what crossed the link
    assert s.pcie_bytes_per_token == pytest.approx(PER_TOKEN * one * (1 - hit))
    assert f"expert cache hits {100 * hit:.0f}%" in stats_line(s)


def test_stream_counters_measure_a_stretch_of_decoding():
    c = StreamCounters()
    c.copied_bytes, c.lookups, c.hits = 100, 4, 1
    start = c.snapshot()
    c.copied_bytes, c.lookups, c.hits = 400, 10, 5
    run = c.since(start, 3)
    assert run.bytes_per_token == 100 and run.hit_rate == pytest.approx(4 / 6)
    assert start.copied_bytes == 100 and c.hit_rate == 0.5
    assert StreamCounters(copied_bytes=9).since(StreamCounters(), 1).hit_rate is None  # no cache asked


@pytest.mark.parametrize("backend", ["torch", "mlx"])
def test_bytes_per_token_counts_only_the_routed_experts_a_token_reads(tiny_dir, backend):
    m = umakit.load(tiny_dir("mixtral"), backend=backend, device="cpu", dtype="float32")
    w = m.info.weights
    params = m.engine.export_weights() if backend == "mlx" else None
    if params is None:
        routed = sum(t.nbytes for name, t in m.engine.model.named_parameters() if common.is_routed_expert(name))
    else:
        routed = sum(a.nbytes for name, a in params.items() if common.is_routed_expert(name))
    assert routed > w.total_bytes / 2  # the tiny config's experts dominate its weights
    embed = w.by_category["embedding"]
    dense_read = w.total_bytes - routed - embed + embed // m.engine.config["vocab_size"]  # untied head
    assert w.bytes_per_token == dense_read + round(routed * PER_TOKEN / EXPERTS)
    assert w.total_bytes == sum(w.by_category.values())  # resident bytes still count every expert


def test_offloaded_moe_reads_what_the_resident_model_reads(tiny_dir, measured_link):
    path = tiny_dir("mixtral")
    resident = umakit.load(path, backend="torch", device="cpu", dtype="float32")
    streamed = umakit.load(path, backend="torch", device="cpu", dtype="float32", gpu_layers=0)
    assert streamed.info.weights.bytes_per_token == resident.info.weights.bytes_per_token
    assert streamed.info.weights.total_bytes == resident.info.weights.total_bytes
    r, o = streamed.measure_decode(10.0, 16)
    # every sparse layer streams its picked experts: all of a token's expert reads cross the link
    assert o.streamed_bytes == streamed.info.weights.streamed_bytes_per_token < r.bytes_per_token
    assert streamed.engine.offload.reserved_bytes == reserved_bytes(streamed.engine.config)


def test_routed_share_reads_each_familys_expert_counts():
    assert common.routed_share({"num_local_experts": 8, "num_experts_per_tok": 2}) == 0.25
    assert common.routed_share({"text_config": {"num_experts": 128, "num_experts_per_tok": 8}}) == 1 / 16
    assert common.routed_share({"n_routed_experts": 256, "num_experts_per_tok": 8}) == 1 / 32
    assert common.routed_share({"hidden_size": 64}) == 1.0


def test_load_synthetic_picks_an_engine_that_runs_the_architecture(monkeypatch, tiny_dir):
    from umakit.checkpoint.files import read_config

    config = read_config(tiny_dir("mixtral"))
    assert umakit.load_synthetic(config, device="cpu").info.backend == "torch"

    def runs_nothing(name):
        spec = backends.ENGINES[name]
        monkeypatch.setitem(backends.ENGINES, name, type(spec)(**{**spec.__dict__, "architectures": (),
                                                                  "finds_architecture": None}))

    for name in ("torch", "mlx"):  # neither compact engine runs it: transformers' classes do
        runs_nothing(name)
    assert umakit.load_synthetic(config, device="cpu").info.backend == "transformers"
    runs_nothing("transformers")  # no engine runs it: "auto" says so before building anything
    with pytest.raises(UnsupportedModelError, match="'mixtral' is not supported by any engine"):
        umakit.load_synthetic(config, device="cpu")


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe"])
def test_plan_predicts_the_engines_moe_split(tiny_dir, family):
    """`umakit plan` at the engine's KV reserve makes the torch engine's split, byte for byte (16-bit weights)."""
    from umakit.plan import planner as P
    from umakit.checkpoint.files import read_config
    from umakit.hardware import lookup_device

    path = tiny_dir(family)
    config = read_config(path)

    def engine(**kw):
        return umakit.load(path, backend="torch", device="cpu", dtype="bfloat16", **kw).engine.offload

    whole, one = engine(gpu_layers=2), engine(gpu_layers=1)
    base = whole.fixed_bytes + whole.reserved_bytes  # every dense part and the reserve
    seen = set()
    for budget in range(base + 2 * one.streamed_bytes, base + whole.resident_bytes, whole.resident_bytes // 8):
        e = engine(vram_budget=budget)
        p = P.plan_model(config, context=P.reserve_tokens(config), devices=[lookup_device("RTX 4090 24GB")],
                         vram_budget=budget)
        (d,) = p.devices
        if d.fits:  # the plan's total holds it whole: so does the engine
            assert e.gpu_layers == 2
            continue
        o = d.offload
        assert (o.placement, o.layers_resident, o.streamed_bytes) == (ROUTED_EXPERTS, e.gpu_layers, e.streamed_bytes)
        assert o.engines == ("torch",)
        seen.add(e.gpu_layers)
    assert seen == {0, 1}
