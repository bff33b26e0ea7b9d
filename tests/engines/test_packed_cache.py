"""The CPU packing kept between loads (torch engine, load/packed.py), of umakit's affine planes and of torch's
int4 form: read back exactly, never stale."""

import os

import numpy as np
import pytest
import torch
from safetensors import safe_open

import umakit
from umakit.backends.torch.load import packed as packed_cache
from umakit.backends.torch import quant
from umakit.backends.torch.cpu import affine_kernel as affine
from umakit.quantize import quantize

from support.tiny import make_tiny_model

PROMPT = "It is a truth universally acknowledged"


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    src = make_tiny_model("qwen2", tmp_path_factory.mktemp("qwen2"))  # a tied, 8-bit table: two nibble planes
    out = tmp_path_factory.mktemp("qwen2-q4") / "q"
    quantize(src, out, bits=4, group_size=32)
    return out


@pytest.fixture
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("UMAKIT_HOME", str(tmp_path / "home"))
    return tmp_path / "home" / "packed"


@pytest.fixture(params=["affine", "int4"])
def form(request, monkeypatch):
    """The CPU form the quantized layers take: umakit's affine kernel, or torch's int4 one where that is not built."""
    if request.param == "affine" and not affine.available():
        pytest.skip("umakit's affine kernel is not built here")
    if request.param == "int4":
        monkeypatch.setattr(affine, "available", lambda: False)
    return affine.AffineLinear if request.param == "affine" else quant.Int4PackLinear


@pytest.fixture
def repacks(form, monkeypatch):
    """How many layers were repacked since the test began."""
    calls = []
    if form is affine.AffineLinear:
        real_planes = affine.planes
        monkeypatch.setattr(affine, "planes", lambda m: calls.append(1) or real_planes(m))
        return calls
    real = quant.Int4PackLinear._repack
    monkeypatch.setattr(quant.Int4PackLinear, "_repack", lambda self, m, d: calls.append(1) or real(self, m, d))
    return calls


class Packs(torch.nn.Module):
    """A layer with a packing: its buffers."""

    def __init__(self, **buffers):
        super().__init__()
        for name, t in buffers.items():
            self.register_buffer(name, t)

    def packing(self):
        return dict(self.named_buffers())


def mapped_from(t, file) -> bool:
    """Whether ``t``'s data lies in this process's map of ``file``."""
    for line in open("/proc/self/maps"):
        span, *rest = line.split()
        if rest and rest[-1] == str(file):
            lo, hi = (int(x, 16) for x in span.split("-"))
            if lo <= t.data_ptr() < hi:
                return True
    return False


def test_the_load_that_packs_keeps_no_second_copy(checkpoint, home, form, repacks):
    """Once the first load has written the packing, its layers read the file's map, as a later load's do: the
    packing it made is not held in memory beside the file's pages."""
    model = load(checkpoint)
    assert len(repacks) > 0
    [file] = packings(home)
    layers = [m for m in model.engine.model.modules() if isinstance(m, form)]
    assert layers and all(mapped_from(t, file) for m in layers for t in m.packing().values())
    assert len(model.logits(ids(PROMPT))) > 0


@pytest.mark.parametrize("how", ["a-layer-a-batch", "header-outgrown", "abandoned"])
def test_a_first_packing_written_as_it_is_made(checkpoint, home, tmp_path, form, monkeypatch, how):
    """The first load writes each layer's packing as it makes it (load/packing_stream.py): read back from the map
    a layer at a time, or, where the header outgrows its room or the stream is given up, written whole after; in
    every case the logits are those of a load that keeps no packing, a later load reads the file back without
    repacking, and no temporary file is left."""
    from umakit.backends.torch.load import packing_stream

    monkeypatch.setenv("UMAKIT_HOME", str(tmp_path / "blocked-file"))
    (tmp_path / "blocked-file").write_text("not a directory")
    unkept = load(checkpoint).logits(ids(PROMPT))  # no packing kept: repacked in memory
    monkeypatch.setenv("UMAKIT_HOME", str(home.parent))
    monkeypatch.setattr(packing_stream, "BATCH", 1)
    if how == "header-outgrown":
        monkeypatch.setattr(packing_stream, "ROOM", 0)
        monkeypatch.setattr(packing_stream, "ROOM_PER_LAYER", 0)
    if how == "abandoned":
        add = packing_stream.PackingStream.add
        monkeypatch.setattr(packing_stream.PackingStream, "add", lambda self, path, m: self.abort(
            OSError(28, "No space left on device")) if len(self.added) == 2 else add(self, path, m))
    finish, finished = packing_stream.PackingStream.finish, []
    monkeypatch.setattr(packing_stream.PackingStream, "finish", lambda self: finished.append(finish(self)) or
                        finished[-1])
    started = []

    def start_writeback(fd, offset, length):
        os.fstat(fd)  # still open: every call ends before the file is synced and closed
        started.append((offset, length))

    monkeypatch.setattr(packing_stream, "start_writeback", start_writeback)
    first = load(checkpoint)
    assert finished == {"a-layer-a-batch": [True], "header-outgrown": [False], "abandoned": []}[how]
    [file] = packings(home)
    if how == "a-layer-a-batch":  # each batch's pages started for the disk as written: the data, end to end
        assert len(started) > 1 and all(a + n == b for (a, n), (b, _) in zip(started, started[1:]))
        assert started[-1][0] + started[-1][1] == file.stat().st_size
    layers = [m for m in first.engine.model.modules() if isinstance(m, form)]
    assert layers and all(mapped_from(t, file) for m in layers for t in m.packing().values())
    np.testing.assert_array_equal(first.logits(ids(PROMPT)), unkept)
    monkeypatch.setattr(affine, "planes", lambda m: pytest.fail("repacked"))
    monkeypatch.setattr(quant.Int4PackLinear, "_repack", lambda *a: pytest.fail("repacked"))
    np.testing.assert_array_equal(load(checkpoint).logits(ids(PROMPT)), unkept)


def ids(text):
    return list(range(3, 3 + len(text.split())))


def packings(home):
    """The packings kept."""
    return list(home.iterdir())


def load(path):
    return umakit.load(path, backend="torch", device="cpu", dtype="bfloat16")


def test_a_second_load_reads_the_packing_back_exactly(checkpoint, home, repacks):
    first = load(checkpoint)
    made = len(repacks)
    assert made > 0 and len(packings(home)) == 1
    second = load(checkpoint)
    assert len(repacks) == made  # nothing repacked
    np.testing.assert_array_equal(second.logits(ids(PROMPT)), first.logits(ids(PROMPT)))


def test_a_first_packing_reports_its_progress(checkpoint, home, form, repacks):
    """A load that packs tells its progress as its layers are packed (reading a map takes no time), a later load
    as its tensors are read; in bytes of the checkpoint's tensors either way."""
    total = umakit.checkpoint.open_checkpoint(checkpoint).nbytes
    for first in (True, False):
        seen = []
        umakit.load(checkpoint, backend="torch", device="cpu", dtype="bfloat16",
                    progress=lambda done, all_: seen.append((done, all_, len(repacks))))
        done, packed = [d for d, _, _ in seen], [n for _, _, n in seen]
        assert len(seen) > 3 and done == sorted(done) and 0 < done[-1] <= total and {t for _, t, _ in seen} == {total}
        if first:  # each report after a layer packed
            assert packed[0] > 0 and len(set(packed)) == len(packed)
        else:
            assert set(packed) == {packed[0]}  # nothing packed


def test_the_stored_packing_is_mapped_at_the_kernels_alignment(checkpoint, home, form):
    """Read in place from the file's map, at the 64-byte boundary the int4 kernel runs 15-20% faster at."""
    load(checkpoint)
    (cache,) = packings(home)
    with safe_open(cache, framework="pt") as f:
        assert all(f.get_tensor(k).data_ptr() % packed_cache.ALIGNMENT == 0 for k in f.keys())
    layers = [m for m in load(checkpoint).engine.model.modules() if isinstance(m, form)]
    assert layers and all(t.data_ptr() % packed_cache.ALIGNMENT == 0 for m in layers for t in m.packing().values())


def test_a_changed_checkpoint_is_repacked_and_its_old_packing_removed(checkpoint, home, repacks, tmp_path):
    load(checkpoint)
    before = set(home.iterdir())
    assert len(before) == 1
    weights = next(checkpoint.glob("*.safetensors"))
    stat = weights.stat()
    os.utime(weights, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
    made = len(repacks)
    load(checkpoint)
    after = set(home.iterdir())
    assert len(repacks) > made and len(after) == 1 and not after & before


def test_a_damaged_packing_is_ignored_and_rewritten(checkpoint, home, repacks):
    want = load(checkpoint).logits(ids(PROMPT))
    (cache,) = packings(home)
    cache.write_bytes(cache.read_bytes()[:1000])  # cut short, as a full disk might have left it
    made = len(repacks)
    np.testing.assert_array_equal(load(checkpoint).logits(ids(PROMPT)), want)
    assert len(repacks) > made and cache.stat().st_size > 1000
    made = len(repacks)
    load(checkpoint)
    assert len(repacks) == made


def test_a_new_packing_format_or_torch_reads_elsewhere(checkpoint, home, monkeypatch):
    files = list(checkpoint.iterdir())
    first = packed_cache.PackedCache.for_checkpoint(checkpoint, files).path
    monkeypatch.setattr(packed_cache, "FORMAT_VERSION", packed_cache.FORMAT_VERSION + 1)
    assert packed_cache.PackedCache.for_checkpoint(checkpoint, files).path != first
    monkeypatch.setattr(packed_cache.torch, "__version__", "0.0.0")
    assert packed_cache.PackedCache.for_checkpoint(checkpoint, files).path != first


def test_an_unusable_home_only_costs_the_repack(checkpoint, tmp_path, monkeypatch, repacks):
    blocked = tmp_path / "file"
    blocked.write_text("not a directory")
    monkeypatch.setenv("UMAKIT_HOME", str(blocked))
    model = load(checkpoint)
    assert len(repacks) > 0 and len(model.logits(ids(PROMPT))) > 0


def test_a_layer_packed_otherwise_from_the_same_files_is_written_again(tmp_path):
    """The cache is keyed by the checkpoint's files; a load that packs a layer otherwise from the same files (a
    new reading of them: an import's exact groups of 16 in place of its 8-bit copy) writes its packing again
    rather than keep the stale one, which would never fit and be repacked on every load."""
    import torch

    cache = packed_cache.PackedCache(tmp_path / "p.safetensors")
    cache.store({"lm_head": Packs(codes0=torch.zeros(8, 64, dtype=torch.uint8))})
    cache = packed_cache.PackedCache(tmp_path / "p.safetensors")
    cache.store({"lm_head": Packs(codes0=torch.ones(8, 48, dtype=torch.uint8))})
    assert tuple(packed_cache.PackedCache(tmp_path / "p.safetensors").get("lm_head")["codes0"].shape) == (8, 48)
    before = (tmp_path / "p.safetensors").stat().st_mtime_ns
    packed_cache.PackedCache(tmp_path / "p.safetensors").store({"lm_head": Packs(codes0=torch.ones(8, 48,
                                                                                              dtype=torch.uint8))})
    assert (tmp_path / "p.safetensors").stat().st_mtime_ns == before  # held already: not written again


def test_a_layer_gets_its_own_names_only(tmp_path):
    """`get` gives a layer's names and not those of a layer nested in it or named with it as a prefix (one lookup
    a layer: a mixture's thousands of experts each scanned every name before)."""
    import torch

    names = ["layers.1.codes0", "layers.1.sb0", "layers.10.codes0", "layers.1.forms.0.codes0", "layers.codes0"]
    layers: dict = {}
    for k in names:
        path, _, name = k.rpartition(".")
        layers.setdefault(path, Packs()).register_buffer(name, torch.zeros(8, 8, dtype=torch.uint8))
    packed_cache.PackedCache(tmp_path / "p.safetensors").store(layers)
    cache = packed_cache.PackedCache(tmp_path / "p.safetensors")
    assert sorted(cache.get("layers.1")) == ["codes0", "sb0"]
    assert list(cache.get("layers.1.forms.0")) == ["codes0"] and list(cache.get("layers")) == ["codes0"]
    assert cache.get("layers.2") == {}


def test_starting_the_writeback_is_best_effort(tmp_path):
    """Linux's sync_file_range on a file being written; on a closed descriptor (or off Linux) nothing happens:
    the final fsync does the work and reports any failure."""
    from umakit.core.fsutil import start_writeback

    path = tmp_path / "f.bin"
    with open(path, "wb") as f:
        f.write(b"x" * (1 << 20))
        f.flush()
        start_writeback(f.fileno(), 0, 1 << 20)
        fd = f.fileno()
    start_writeback(fd, 0, 1 << 20)  # closed now
    assert path.read_bytes() == b"x" * (1 << 20)
