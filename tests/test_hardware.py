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
    assert len(calls) == 1
    cached = json.loads((tmp_path / "hardware.json").read_text())
    (entry,) = cached["entries"].values()
    assert entry["peak_bandwidth_gbps"] == pytest.approx(first.peak_bandwidth_gbps, abs=0.01)

    second = detect_local("cpu")
    assert len(calls) == 1  # read from the cache, not measured again
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
