"""Wired memory on Metal, one policy everywhere: the limit, its nesting and restore (with fake Metal
calls), the entry points that hold it, the batch KV budget and the Mac memory figures, on CPU."""

from __future__ import annotations

import contextlib
import threading
from pathlib import Path

import mlx.core as mx
import pytest

import umakit
from umakit import hardware
from umakit.backends.mlx import batch_decoder as mlx_batch
from umakit.backends.mlx import wiring
from umakit.bench.measure import BenchSettings, run_bench
from umakit.hardware import GiB, DeviceInfo, local
from umakit.serve.scheduler import Scheduler, SchedulerSettings

MiB = 1 << 20


class FakeMetal:
    """Stands in for set_wired_limit, the working set, synchronize and clear_cache."""

    def __init__(self, working_set: int = 10**9, sync_error: Exception | None = None):
        self.limit, self.working_set, self.sync_error = 7, working_set, sync_error
        self.sets, self.syncs, self.clears = [], 0, 0

    def calls(self):
        return self.set_limit, lambda: self.working_set, self.synchronize, self.clear

    def set_limit(self, n: int) -> int:
        old, self.limit = self.limit, n
        self.sets.append(n)
        return old

    def synchronize(self):
        self.syncs += 1
        if self.sync_error is not None:
            raise self.sync_error

    def clear(self):
        self.clears += 1


def test_the_limit_is_the_weights_with_a_margin_capped_by_the_working_set():
    fake = FakeMetal()
    with wiring.Wiring(fake.calls).hold(1000):
        assert fake.limit == int(1000 * wiring.WIRE_MARGIN) == 1050
        assert fake.clears == 1  # freed buffers go back before wiring
    assert fake.limit == 7 and fake.syncs == 1
    capped = FakeMetal(working_set=1020)
    with wiring.Wiring(capped.calls).hold(1000):
        assert capped.limit == 1020


def test_only_the_outermost_hold_sets_and_restores():
    fake = FakeMetal()
    w = wiring.Wiring(fake.calls)
    with w.hold(1000):
        with w.hold(5000):
            assert fake.sets == [1050] and w.depth == 2
        assert fake.limit == 1050 and fake.syncs == 0  # the inner exit leaves the outer's limit alone
    assert fake.sets == [1050, 7] and w.depth == 0 and fake.syncs == 1


def test_holds_from_two_threads_count_as_one():
    fake = FakeMetal()
    w = wiring.Wiring(fake.calls)
    held, release = threading.Event(), threading.Event()

    def worker():
        with w.hold(1000):
            held.set()
            release.wait(10)

    t = threading.Thread(target=worker)
    t.start()
    assert held.wait(10)
    with w.hold(1000):
        assert w.depth == 2
    assert fake.limit == 1050
    release.set()
    t.join(10)
    assert fake.sets == [1050, 7] and w.depth == 0


def test_the_limit_is_restored_when_the_body_raises():
    fake = FakeMetal()
    w = wiring.Wiring(fake.calls)
    with pytest.raises(ValueError):
        with w.hold(1000):
            raise ValueError("boom")
    assert fake.limit == 7 and w.depth == 0


def test_the_limit_is_restored_when_synchronize_raises():
    fake = FakeMetal(sync_error=RuntimeError("GPU error"))
    w = wiring.Wiring(fake.calls)
    with pytest.raises(RuntimeError, match="GPU error"):
        with w.hold(1000):
            pass
    assert fake.limit == 7 and w.depth == 0
    fake.sync_error = None
    with w.hold(2000):  # the count is not left behind: the next hold wires again
        assert fake.limit == 2100


@pytest.mark.parametrize("value, off", [("", False), ("0", False), ("1", True), ("yes", True)])
def test_umakit_no_wire(monkeypatch, value, off):
    monkeypatch.setenv(wiring.NO_WIRE_ENV, value)
    assert wiring.wiring_disabled() is off


@pytest.fixture
def metal_engine(tiny_model, monkeypatch):
    """The tiny model's engine taken for a Metal one, with fake Metal calls behind the wiring."""
    fake = FakeMetal()
    monkeypatch.setattr(wiring, "WIRING", wiring.Wiring(fake.calls))
    monkeypatch.setattr(tiny_model.engine, "device", "metal")
    monkeypatch.delenv(wiring.NO_WIRE_ENV, raising=False)
    return tiny_model.engine, fake


def test_the_engine_wires_its_weights_on_metal_and_not_with_umakit_no_wire(metal_engine, monkeypatch):
    engine, fake = metal_engine
    weights = engine.weight_info().total_bytes
    with engine.wired(), engine.wired():  # the CLI's hold around the library's
        assert fake.sets == [int(weights * wiring.WIRE_MARGIN)]
    assert fake.limit == 7
    monkeypatch.setenv(wiring.NO_WIRE_ENV, "1")
    fake.sets.clear()
    with engine.wired():
        pass
    assert fake.sets == []
    monkeypatch.delenv(wiring.NO_WIRE_ENV)
    monkeypatch.setattr(engine, "device", "cpu")
    with engine.wired():
        pass
    assert fake.sets == []  # nothing to wire on a CPU


class WiredSpy:
    """Counts how deep the engine's wiring is held while work runs."""

    def __init__(self):
        self.depth, self.seen = 0, []

    @contextlib.contextmanager
    def __call__(self):
        self.depth += 1
        try:
            yield
        finally:
            self.depth -= 1


@pytest.fixture
def spy(tiny_model, monkeypatch):
    engine, spy = tiny_model.engine, WiredSpy()
    monkeypatch.setattr(engine, "wired", spy)
    real_tokens, real_decoder = engine.generate_tokens, engine.batch_decoder

    def generate_tokens(*a, **k):
        for t in real_tokens(*a, **k):
            spy.seen.append(spy.depth)
            yield t

    def batch_decoder(kv_bits=None, lookup=None, mixed=None):
        decoder = real_decoder(kv_bits, lookup, mixed)
        real_step = decoder.step
        decoder.step = lambda *slice: spy.seen.append(spy.depth) or real_step(*slice)
        return decoder

    monkeypatch.setattr(engine, "generate_tokens", generate_tokens)
    monkeypatch.setattr(engine, "batch_decoder", batch_decoder)
    return spy


def test_generate_and_stream_hold_the_wiring_while_decoding(tiny_model, spy):
    tiny_model.generate("The quick brown fox", raw=True, max_tokens=4, temperature=0)
    assert spy.seen and set(spy.seen) == {1} and spy.depth == 0
    chunks = tiny_model.stream("Paris is", raw=True, max_tokens=8, temperature=0)
    assert spy.depth == 0  # nothing is held before the first chunk is asked for
    next(chunks)
    assert spy.depth == 1
    chunks.close()  # a stream left early lets go too
    assert spy.depth == 0
    ids = tiny_model.encode("Paris", raw=True)
    list(tiny_model.stream_tokens(ids, tiny_model.make_cache(), max_tokens=3))
    assert spy.depth == 0


def test_generate_batch_holds_the_wiring(tiny_model, spy):
    run = tiny_model.generate_batch(["The quick", "Paris is"], max_tokens=3, temperature=0)
    assert len(run) == 2 and spy.seen and set(spy.seen) == {1} and spy.depth == 0


def test_stream_batch_holds_the_wiring_while_it_is_read(tiny_model, spy):
    stream = tiny_model.stream_batch(["The quick", "Paris is"], max_tokens=3, temperature=0)
    assert spy.depth == 0  # nothing is held before the first result is asked for
    results = iter(stream)
    next(results)
    assert spy.depth == 1
    rest = list(results)
    assert len(rest) == 1 and spy.depth == 0


def test_bench_measures_under_the_wiring_generate_uses(tiny_model, spy):
    run_bench(tiny_model, BenchSettings(prompt_tokens=8, gen_tokens=4, repeat=1, warmup=0))
    assert spy.seen and set(spy.seen) == {1} and spy.depth == 0


def test_the_servers_worker_holds_the_wiring_while_it_runs(tiny_model, spy):
    s = Scheduler(tiny_model, SchedulerSettings())
    s.start()
    try:
        assert s.healthy and spy.depth == 1
    finally:
        s.stop()
    assert spy.depth == 0


def test_the_batch_kv_budget_on_metal_leaves_headroom(metal_engine, monkeypatch):
    engine, _ = metal_engine
    weights = engine.weight_info().total_bytes
    decoder = engine.batch_decoder()
    monkeypatch.setattr(mlx_batch, "metal_working_set", lambda: weights + 10 * GiB)
    assert decoder.kv_budget_bytes() == int(10 * GiB * mlx_batch.METAL_KV_FRACTION) < 10 * GiB
    monkeypatch.setattr(mlx_batch, "metal_working_set", lambda: weights // 2)
    assert decoder.kv_budget_bytes() == 0


def test_device_info_prefers_mx_device_info_of_the_gpu(monkeypatch):
    asked = []
    monkeypatch.setattr(mx, "device_info", lambda d=None: asked.append(d) or {"max_recommended_working_set_size": 5})
    monkeypatch.setattr(mx.metal, "device_info", lambda: pytest.fail("the deprecated call was used"))
    assert hardware.metal_working_set() == 5 and asked == [mx.gpu]
    assert local._metal_working_set() == 5
    monkeypatch.delattr(mx, "device_info")  # an MLX from before 0.30.4
    monkeypatch.setattr(mx.metal, "device_info", lambda: {"max_recommended_working_set_size": 9})
    assert hardware.metal_working_set() == 9


def test_only_the_helper_calls_mlx_device_info():
    root = Path(umakit.__file__).parent
    callers = sorted(str(p.relative_to(root)) for p in root.rglob("*.py")
                     if "device_info()" in p.read_text(encoding="utf-8") or "device_info(mx." in p.read_text(
                         encoding="utf-8"))
    assert callers == ["hardware/metal.py"]


def test_the_wired_limit_advice_stays_below_ram():
    assert hardware.wired_limit_advice_mb(40 * GiB, 64 * GiB) == int(40 * GiB * local.WIRED_ADVICE_MARGIN / MiB)
    capped = hardware.wired_limit_advice_mb(52 * GiB, 64 * GiB)  # 1.2x would be 62.4 GiB of 64
    assert capped == int((64 - 6.4) * GiB / MiB)
    assert hardware.wired_limit_advice_mb(60 * GiB, 64 * GiB) is None  # no setting below RAM holds them
    assert hardware.wired_limit_advice_mb(11 * GiB, 16 * GiB) == 12 * 1024  # 4 GiB kept for macOS


def _fake_apple(monkeypatch, memory, working_set):
    dev = DeviceInfo("Apple M2 Max", "apple", 400.0, "published", memory, working_set)
    monkeypatch.setattr(local, "detect_local", lambda device: dev)


def test_the_memory_warning_on_a_mac_advises_a_limit_below_ram_or_quantizing(monkeypatch):
    _fake_apple(monkeypatch, 64 * GiB, 48 * GiB)
    (warning,) = hardware.memory_warnings(47 * GiB, "metal")
    mb = int(warning.split("iogpu.wired_limit_mb=")[1].split("`")[0])
    assert mb * MiB < 64 * GiB and mb * MiB > 47 * GiB
    (warning,) = hardware.memory_warnings(62 * GiB, "metal")
    assert "iogpu" not in warning and "umakit quantize --bits 4" in warning
    assert hardware.memory_warnings(10 * GiB, "metal") == []


VM_STAT = """Mach Virtual Memory Statistics: (page size of 16384 bytes)
Pages free:                               12000.
Pages active:                            500000.
Pages inactive:                          300000.
Pages speculative:                         8000.
Pages throttled:                              0.
Pages wired down:                        400000.
Pages purgeable:                          20000.
"Translation faults":                1234567890.
Pages copy-on-write:                   12345678.
File-backed pages:                       250000.
Anonymous pages:                         558000.
Pages stored in compressor:              100000.
Pages occupied by compressor:             30000.
"""


def test_available_ram_on_macos_reads_vm_stat(monkeypatch):
    assert hardware.vm_stat_available(VM_STAT) == (12000 + 8000 + 300000) * 16384
    assert hardware.vm_stat_available("") is None
    monkeypatch.setattr(local.sys, "platform", "darwin")
    monkeypatch.setattr(local, "_run", lambda cmd: VM_STAT if cmd == ["vm_stat"] else "")
    real_open = open

    def no_proc(path, *a, **k):  # macOS has no /proc
        if str(path).startswith("/proc"):
            raise FileNotFoundError(path)
        return real_open(path, *a, **k)

    monkeypatch.setattr("builtins.open", no_proc)
    assert hardware.available_ram() == (12000 + 8000 + 300000) * 16384
