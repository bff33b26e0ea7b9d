"""Device facts: published-bandwidth lookups, the measured-probe cache, overrides."""

import json
import sys
from types import SimpleNamespace

import pytest

from umakit import hardware
from umakit.hardware import local, probes
from umakit.errors import BackendUnavailableError, InvalidArgumentError
from umakit.hardware import GiB, default_working_set, detect_local, find_chip, lookup_device


@pytest.mark.parametrize("name, gbps", [
    ("Apple M1", 68.25),
    ("Apple M1 Max", 400),
    ("Apple M2 Ultra", 800),
    ("Apple M2 Pro", 200),  # not the plain M2
    ("Apple M2", 100),
    ("Apple M3 Pro", 150),
    ("Apple M3 Ultra", 819),
    ("Apple M4 Pro", 273),
    ("Apple M5", 153),
    ("M3 Max 30-core GPU", 300),
    ("M3 Max (14-core CPU, 30-core GPU)", 300),
    ("M4 Max 32-core GPU", 410),
    ("M4 Max 40-core GPU", 546),
    ("NVIDIA H100 80GB HBM3", 3350),
    ("NVIDIA H100 PCIe", 2000),
    ("NVIDIA H100 NVL", 3900),
    ("NVIDIA H200", 4800),
    ("NVIDIA GeForce RTX 3090", 936),
    ("NVIDIA GeForce RTX 3090 Ti", 1008),
    ("NVIDIA GeForce RTX 4090", 1008),
    ("NVIDIA GeForce RTX 5090", 1792),
    ("NVIDIA A100-SXM4-40GB", 1555),
    ("NVIDIA A100-SXM4-80GB", 2039),
    ("NVIDIA A100 80GB PCIe", 1935),
    ("NVIDIA A10G", 600),
    ("NVIDIA L4", 300),
    ("NVIDIA L40S", 864),
    ("Tesla T4", 320),
    ("Tesla V100-SXM2-16GB", 900),
    ("NVIDIA RTX A6000", 768),
    ("NVIDIA RTX 6000 Ada Generation", 960),
])
def test_published_bandwidth_by_name(name, gbps):
    assert find_chip(name).peak_gbps == gbps


def test_gpu_core_count_and_memory_pick_the_bin():
    assert find_chip("Apple M3 Max", gpu_cores=30).peak_gbps == 300
    assert find_chip("Apple M3 Max", gpu_cores=40).peak_gbps == 400
    assert find_chip("Apple M4 Max", gpu_cores=32).peak_gbps == 410
    assert find_chip("Apple M4 Max", gpu_cores=40).peak_gbps == 546
    # no core count: the memory configurations sold tell the bins apart
    assert find_chip("Apple M3 Max", memory_bytes=36 * GiB).peak_gbps == 300
    assert find_chip("Apple M3 Max", memory_bytes=128 * GiB).peak_gbps == 400
    assert find_chip("NVIDIA A100", memory_bytes=int(79.2 * GiB)).peak_gbps == 2039
    assert find_chip("Apple M3 Max", gpu_cores=35) is None  # no such bin: measure instead


@pytest.mark.parametrize("name", ["NVIDIA GeForce RTX 4090 Laptop GPU", "Voodoo 5", "Apple M9", "RTX 6000"])
def test_unknown_or_different_products_do_not_match(name):
    assert find_chip(name) is None


def test_reference_devices():
    m2u = lookup_device("M2 Ultra 192GB")
    assert (m2u.kind, m2u.peak_bandwidth_gbps, m2u.bandwidth_source) == ("apple", 800, "published")
    assert m2u.memory_bytes == 192 * GiB and m2u.working_set_bytes == 144 * GiB
    assert lookup_device("M4 Max 128GB").peak_bandwidth_gbps == 546
    rtx = lookup_device("RTX 4090 24GB")
    assert (rtx.kind, rtx.peak_bandwidth_gbps, rtx.memory_bytes, rtx.pcie_gen) == ("nvidia", 1008, 24 * GiB, 4)
    assert rtx.working_set_bytes is None and rtx.usable_bytes == 24 * GiB
    h100 = lookup_device("H100 80GB")
    assert (h100.peak_bandwidth_gbps, h100.memory_bytes, h100.pcie_gen) == (3350, 80 * GiB, 5)


@pytest.mark.parametrize("name, gbps, gib", [
    ("RTX 3060 12GB", 360, 12), ("RTX 3060 8GB", 240, 8), ("RTX 3070 8GB", 448, 8), ("RTX 4070 Ti 12GB", 504, 12),
    ("RTX 4080 Super 16GB", 736, 16), ("RTX 4080 16GB", 716.8, 16), ("NVIDIA GeForce RTX 3060", 360, 12),
])
def test_consumer_gpus(name, gbps, gib):
    d = lookup_device(name)
    assert (d.kind, d.peak_bandwidth_gbps, d.memory_bytes) == ("nvidia", gbps, gib * GiB)


@pytest.mark.parametrize("name, sizes", [("RTX 4090 48GB", "24GB"), ("M4 Max 96GB", "36GB, 48GB, 64GB or 128GB"),
                                         ("A100 60GB", "40GB or 80GB"), ("RTX 3070 12GB", "8GB")])
def test_memory_sizes_are_those_sold(name, sizes):
    with pytest.raises(InvalidArgumentError) as e:
        lookup_device(name)
    msg = str(e.value)
    assert "\n" not in msg and f"is sold with {sizes}, not" in msg


def test_unknown_reference_device_is_a_one_line_error_listing_names():
    with pytest.raises(InvalidArgumentError) as e:
        lookup_device("Voodoo 5 6000")
    msg = str(e.value)
    assert "\n" not in msg and "M2 Ultra" in msg and "RTX 4090" in msg and "H100 SXM" in msg


def test_default_working_set():
    assert default_working_set(16 * GiB) == 16 * GiB * 2 // 3
    assert default_working_set(64 * GiB) == 48 * GiB


def test_cpu_probe_measures_once_then_reads_the_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("UMAKIT_HOME", str(tmp_path))
    calls = []
    real_probe = probes.cpu_gbps

    def counting_probe(index=0):
        calls.append(index)
        return real_probe(size_bytes=32 << 20, repeats=2)

    monkeypatch.setattr(probes, "cpu_gbps", counting_probe)
    first = detect_local("cpu")
    assert first.kind == "cpu" and first.bandwidth_source == "measured" and first.peak_bandwidth_gbps > 0
    assert first.memory_bytes > 0 and first.working_set_bytes is None
    assert len(calls) == probes.PROBE_RUNS  # the best of several short runs
    cached = json.loads((tmp_path / "hardware.json").read_text())
    (entry,) = cached["entries"].values()
    assert entry["peak_bandwidth_gbps"] == pytest.approx(first.peak_bandwidth_gbps, abs=0.01)

    second = detect_local("cpu")
    assert len(calls) == probes.PROBE_RUNS  # read from the cache, not measured again
    assert second.peak_bandwidth_gbps == pytest.approx(first.peak_bandwidth_gbps, abs=0.01)
    assert second.bandwidth_source == "measured"

    monkeypatch.setattr(probes, "cpu_gbps", lambda index=0: 12.5)
    assert detect_local("cpu", remeasure=True).peak_bandwidth_gbps == 12.5
    assert detect_local("cpu").peak_bandwidth_gbps == 12.5


def test_corrupt_cache_is_measured_again(tmp_path, monkeypatch):
    monkeypatch.setenv("UMAKIT_HOME", str(tmp_path))
    (tmp_path / "hardware.json").write_text("{not json")
    monkeypatch.setattr(probes, "cpu_gbps", lambda index=0: 7.0)
    assert detect_local("cpu").peak_bandwidth_gbps == 7.0
    assert json.loads((tmp_path / "hardware.json").read_text())["version"] == local.CACHE_VERSION


def test_override_is_user_sourced_and_skips_the_probe(tmp_path, monkeypatch):
    monkeypatch.setenv("UMAKIT_HOME", str(tmp_path))

    def no_probe(index=0):
        raise AssertionError("the probe must not run with an override")

    monkeypatch.setattr(probes, "cpu_gbps", no_probe)
    dev = detect_local("cpu", override_gbps=123.0)
    assert (dev.peak_bandwidth_gbps, dev.bandwidth_source) == (123.0, "user")
    assert not (tmp_path / "hardware.json").exists()


def test_cpu_kv_budget_is_a_fraction_of_the_ram_available_now(monkeypatch):
    assert 0 < hardware.cpu_kv_budget() <= hardware.available_ram()
    monkeypatch.setattr(local, "available_ram", lambda: 10 * GiB)
    assert hardware.cpu_kv_budget() == int(10 * GiB * hardware.CPU_KV_FRACTION) == 5 * GiB


@pytest.mark.parametrize("kwargs", [dict(override_gbps=0), dict(override_gbps=-5), dict(device="tpu"),
                                    dict(device="cuda:x")])
def test_bad_detect_arguments(kwargs):
    with pytest.raises(InvalidArgumentError):
        detect_local(**kwargs)


def _fake_mac(monkeypatch, brand, memory, ioreg="", profiler="", working_set=None):
    outputs = {
        "machdep.cpu.brand_string": brand,
        "hw.memsize": str(memory),
        "ioreg": ioreg,
        "system_profiler": profiler,
    }

    def run(cmd):
        return next((v for k, v in outputs.items() if k in cmd), "")

    monkeypatch.setattr(local, "_is_apple_silicon", lambda: True)
    monkeypatch.setattr(local, "_run", run)
    monkeypatch.setattr(local, "_metal_working_set", lambda: working_set)


def test_apple_chip_from_sysctl_and_ioreg(monkeypatch):
    _fake_mac(monkeypatch, "Apple M3 Max\n", 48 * GiB, ioreg='  "gpu-core-count" = 30\n')
    dev = detect_local("metal")
    assert (dev.name, dev.kind, dev.gpu_cores) == ("Apple M3 Max", "apple", 30)
    assert (dev.peak_bandwidth_gbps, dev.bandwidth_source) == (300, "published")
    assert dev.memory_bytes == 48 * GiB and dev.working_set_bytes == 36 * GiB


def test_apple_core_count_from_system_profiler_and_metal_working_set(monkeypatch):
    _fake_mac(monkeypatch, "Apple M4 Max", 128 * GiB, profiler="      Total Number of Cores: 40\n",
              working_set=int(107.5 * GiB))
    dev = detect_local()
    assert dev.peak_bandwidth_gbps == 546 and dev.working_set_bytes == int(107.5 * GiB)


def test_unknown_apple_chip_is_measured_and_cached(tmp_path, monkeypatch):
    monkeypatch.setenv("UMAKIT_HOME", str(tmp_path))
    _fake_mac(monkeypatch, "Apple M9 Hyper", 64 * GiB)
    monkeypatch.setattr(probes, "apple_gbps", lambda index=0: 777.0)
    dev = detect_local("metal")
    assert (dev.peak_bandwidth_gbps, dev.bandwidth_source) == (777.0, "measured")
    monkeypatch.setattr(probes, "apple_gbps", lambda index=0: 1.0)
    assert detect_local("metal").peak_bandwidth_gbps == 777.0


def test_metal_refused_off_apple_silicon(monkeypatch):
    monkeypatch.setattr(local, "_is_apple_silicon", lambda: False)
    with pytest.raises(BackendUnavailableError):
        detect_local("metal")


def _fake_torch(monkeypatch, name, total_memory):
    props = SimpleNamespace(name=name, total_memory=total_memory)
    cuda = SimpleNamespace(is_available=lambda: True, device_count=lambda: 1,
                           get_device_properties=lambda i: props)
    monkeypatch.setitem(sys.modules, "torch", SimpleNamespace(cuda=cuda))


def test_nvidia_name_from_torch_with_measured_pcie(tmp_path, monkeypatch):
    monkeypatch.setenv("UMAKIT_HOME", str(tmp_path))
    _fake_torch(monkeypatch, "NVIDIA GeForce RTX 4090", 24 * GiB)
    monkeypatch.setattr(probes, "h2d_gbps", lambda index=0, kind="nvidia", pinned=True: 24.6 if pinned else 11.2)
    dev = detect_local("cuda")
    assert (dev.name, dev.kind, dev.peak_bandwidth_gbps, dev.bandwidth_source) == (
        "NVIDIA GeForce RTX 4090", "nvidia", 1008, "published")
    assert dev.pcie_h2d_gbps == 24.6 and dev.pcie_gen == 4 and dev.memory_bytes == 24 * GiB
    monkeypatch.setattr(probes, "h2d_gbps", lambda index=0, *args, **kw: 1.0)
    assert detect_local("cuda:0").pcie_h2d_gbps == 24.6  # cached
    assert hardware.h2d_bandwidth("cuda") == {"pinned": 24.6, "pageable": 11.2}  # both measured the first time
    with pytest.raises(InvalidArgumentError):
        detect_local("cuda:3")


def test_unknown_nvidia_gpu_is_measured(tmp_path, monkeypatch):
    monkeypatch.setenv("UMAKIT_HOME", str(tmp_path))
    _fake_torch(monkeypatch, "NVIDIA Imaginary 9000", 12 * GiB)
    monkeypatch.setattr(probes, "h2d_gbps", lambda index=0, *args, **kw: 11.0)
    monkeypatch.setattr(probes, "cuda_gbps", lambda index=0: 432.1)
    dev = detect_local("cuda")
    assert (dev.peak_bandwidth_gbps, dev.bandwidth_source, dev.pcie_gen) == (432.1, "measured", None)


@pytest.mark.cuda
def test_real_cuda_device(tmp_path, monkeypatch):
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    monkeypatch.setenv("UMAKIT_HOME", str(tmp_path))
    dev = detect_local("cuda")
    assert dev.kind == "nvidia" and dev.memory_bytes > 0 and dev.pcie_h2d_gbps > 0
    assert dev.peak_bandwidth_gbps > 0 and dev.bandwidth_source in ("published", "measured")


# -- the probe cache's policy: a fake clock and a fake measurement ---------------------------

class FakeProbe:
    """Measurements handed out in turn; counts the calls."""

    def __init__(self, *values):
        self.values, self.calls = list(values), 0

    def __call__(self):
        self.calls += 1
        return self.values.pop(0)


DAY = 24 * 3600


def _probe(path, measure, t, **kwargs):
    return probes.cached_probe(path, "host|cpu|X", "peak_bandwidth_gbps", measure, version=1, now=lambda: t,
                               sleep=lambda s: None, **kwargs)


def test_best_of_several_runs_is_kept(tmp_path):
    pauses = []
    assert probes.best_of(FakeProbe(13.0, 31.5, 19.7), runs=3, pause_s=0.1, sleep=pauses.append) == 31.5
    assert pauses == [0.1, 0.1]  # a pause between runs, none after the last
    t0 = 1_800_000_000.0
    fake = FakeProbe(*([13.0, 24.2, 20.0] * 3))
    assert _probe(tmp_path / "hw.json", fake, t0) == 24.2 and fake.calls == probes.PROBE_RUNS


def test_cached_figure_is_reused_for_a_week_then_measured_again(tmp_path):
    path, t0 = tmp_path / "hw.json", 1_800_000_000.0
    first = FakeProbe(*[20.0] * probes.PROBE_RUNS)
    assert _probe(path, first, t0) == 20.0
    never = FakeProbe()  # any call would fail: nothing left to hand out
    assert _probe(path, never, t0 + 6 * DAY) == 20.0 and never.calls == 0
    again = FakeProbe(*[18.0] * probes.PROBE_RUNS)
    assert _probe(path, again, t0 + 8 * DAY) == 18.0 and again.calls == probes.PROBE_RUNS  # stale: fresh wins
    entry = json.loads(path.read_text())["entries"]["host|cpu|X"]
    assert entry["peak_bandwidth_gbps"] == 18.0 and "peak_bandwidth_gbps_measured_at" in entry


def test_a_run_that_beats_the_cached_figure_gets_it_measured_again(tmp_path):
    # the cached probe was taken on a busy machine: 13 GB/s, while runs read 19.7
    path, t0 = tmp_path / "hw.json", 1_800_000_000.0
    _probe(path, FakeProbe(*[13.0] * probes.PROBE_RUNS), t0)
    assert _probe(path, FakeProbe(), t0 + 60, achieved_gbps=12.0) == 13.0  # below the figure: kept
    remeasured = FakeProbe(*[30.0] * probes.PROBE_RUNS)
    assert _probe(path, remeasured, t0 + 120, achieved_gbps=19.7) == 30.0 and remeasured.calls == probes.PROBE_RUNS
    # still busy when measuring again: the figure is at least what the run achieved, so never above 100% of it
    busy = FakeProbe(*[14.0] * probes.PROBE_RUNS)
    peak = _probe(path, busy, t0 + 180, achieved_gbps=31.234)
    assert peak == 31.24 and 31.234 / peak <= 1.0
    assert _probe(path, FakeProbe(), t0 + 240) == 31.24


def test_remeasure_on_demand_replaces_the_figure(tmp_path):
    path, t0 = tmp_path / "hw.json", 1_800_000_000.0
    _probe(path, FakeProbe(*[30.0] * probes.PROBE_RUNS), t0)
    assert _probe(path, FakeProbe(*[25.0] * probes.PROBE_RUNS), t0 + 1, remeasure=True) == 25.0
    (tmp_path / "bad.json").write_text("{not json")
    assert _probe(tmp_path / "bad.json", FakeProbe(*[5.0] * probes.PROBE_RUNS), t0) == 5.0


@pytest.mark.parametrize("entry, reason", [
    ({}, "absent"), ({"f": 0}, "absent"), ({"f": 10.0}, "stale"), ({"f": 10.0, "f_measured_at": "garbage"}, "stale"),
])
def test_why_measure(entry, reason):
    assert probes.why_measure(entry, "f", 1_800_000_000.0) == reason


def test_a_model_run_faster_than_the_cached_peak_measures_it_again(tiny_model, tmp_path, monkeypatch):
    """The cached figure was taken on a busy machine: a run reading more gets it measured again."""
    monkeypatch.setenv("UMAKIT_HOME", str(tmp_path))
    figure = [0.5]  # GB/s: far below what the run below reads
    monkeypatch.setattr(probes, "cpu_gbps", lambda index=0: figure[0])
    monkeypatch.setattr(probes.time, "sleep", lambda s: None)
    monkeypatch.setattr(tiny_model, "_device_info", None)  # restored afterwards: the model is shared
    assert tiny_model.device_info.peak_bandwidth_gbps == 0.5
    figure[0] = 1.0  # still busy when measured again: the run's own figure is the floor
    roofline, _ = tiny_model.measure_decode(1e5, 10)
    assert roofline.achieved_gbps > 1.0
    assert roofline.achieved_gbps <= roofline.peak_gbps and roofline.mbu <= 1.0
    assert tiny_model.device_info.peak_bandwidth_gbps >= roofline.achieved_gbps
