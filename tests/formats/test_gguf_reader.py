"""umakit's own GGUF header reader against the `gguf` package's, the chunked block decoders against one pass, and
the streamed safetensors writer an import writes through."""

import struct

import gguf
import mlx.core as mx
import numpy as np
import pytest
from gguf import GGMLQuantizationType as T
from safetensors import safe_open

from umakit.checkpoint.files import read_safetensors_header
from umakit.checkpoint.gguf import quants
from umakit.checkpoint.gguf.reader import open_gguf
from umakit.checkpoint.writer import StreamedSafetensors
from umakit.errors import CheckpointError
from support.gguf_files import EXACT_LAYERS, LOSSY_LAYERS, with_metadata, write_gguf

V = gguf.GGUFValueType
EXTRA = [  # every value type, arrays of them and non-ASCII text (gguf's writer makes no empty array)
    ("test.f64", 2.5, V.FLOAT64, None), ("test.i64", -7, V.INT64, None), ("test.u64", 1 << 40, V.UINT64, None),
    ("test.i8", -3, V.INT8, None), ("test.u16", 65535, V.UINT16, None), ("test.flag", True, V.BOOL, None),
    ("test.bools", [True, False, True], V.ARRAY, V.BOOL), ("test.floats", [0.1, -2.0], V.ARRAY, V.FLOAT32),
    ("test.i16s", [-1, 2, -3], V.ARRAY, V.INT16), ("test.words", ["ça", "日本", ""], V.ARRAY, V.STRING),
    ("test.text", "naïve → text", V.STRING, None),
]


def _with_extra(path, layers):
    return with_metadata(write_gguf(path, layers=layers), path.with_name("extra-" + path.name), typed=EXTRA)


@pytest.mark.parametrize("layers", [EXACT_LAYERS, LOSSY_LAYERS], ids=["exact", "lossy"])
def test_reader_gives_what_the_gguf_package_gives(tmp_path, layers):
    src = _with_extra(tmp_path / "m.gguf", layers)
    ours, theirs = open_gguf(src), gguf.GGUFReader(src)
    expected = {k: f.contents() for k, f in theirs.fields.items() if not k.startswith("GGUF.")}
    assert list(ours.metadata) == list(expected)
    for key, value in expected.items():
        got = ours.metadata[key]
        assert got == value and type(got) is type(value), key
        if isinstance(value, list) and value:
            assert {type(v) for v in got} == {type(v) for v in value}, key
    assert ours.metadata["test.words"] == ["ça", "日本", ""]
    assert list(ours.tensors) == [t.name for t in theirs.tensors]
    assert {t.tensor_type for t in theirs.tensors} >= {T.F32, T.Q8_0}
    for t in theirs.tensors:
        mine = ours.tensors[t.name]
        assert mine.tensor_type == t.tensor_type and mine.shape.dtype == t.shape.dtype
        assert np.array_equal(mine.shape, t.shape)
        assert (mine.n_elements, mine.n_bytes, mine.data_offset) == (t.n_elements, t.n_bytes, t.data_offset)
        assert mine.data.dtype == t.data.dtype and mine.data.shape == t.data.shape, t.name
        assert np.array_equal(mine.data.view(np.uint8), t.data.view(np.uint8))
        assert not mine.data.flags.writeable


def test_released_tensors_read_the_same(tmp_path):
    """`GGUFFile.release` only lets go of pages: a tensor read after it is the file's bytes still."""
    gf = open_gguf(write_gguf(tmp_path / "m.gguf"))
    before = {name: np.array(t.data) for name, t in gf.tensors.items()}
    gf.release(list(gf.tensors))
    for name, t in gf.tensors.items():
        assert np.array_equal(np.asarray(t.data), before[name])


def _header(*kvs: bytes, n_kv: int | None = None) -> bytes:
    return b"GGUF" + struct.pack("<IQQ", 3, 0, len(kvs) if n_kv is None else n_kv) + b"".join(kvs)


def _key(name: bytes) -> bytes:
    return struct.pack("<Q", len(name)) + name


def test_empty_arrays_and_no_tensors(tmp_path):
    arch = _key(b"general.architecture") + struct.pack("<IQ", 8, 5) + b"llama"
    src = tmp_path / "empty.gguf"
    src.write_bytes(_header(arch, _key(b"e") + struct.pack("<IIQ", 9, 5, 0), _key(b"s") + struct.pack("<IIQ", 9, 8, 0)))
    gf = open_gguf(src)
    assert gf.metadata == {"general.architecture": "llama", "e": [], "s": []} and gf.tensors == {}


@pytest.mark.parametrize("body, message", [
    (_header(_key(b"general.architecture") + struct.pack("<IQ", 8, 5) + b"\xff\xfeama"), "is not UTF-8"),
    (_header(_key(b"general.architecture") + struct.pack("<I", 99)), "unknown metadata value type 99"),
    (_header(_key(b"a") + struct.pack("<IIQ", 9, 4, 1 << 40)), "truncated"),
    (_header(_key(b"a") + struct.pack("<IIQ", 9, 8, 3) + _key(b"x")), "truncated"),
    (_header(_key(b"a") + struct.pack("<IIQ", 9, 8, 2) + _key(b"x") + struct.pack("<Q", 9) + b"ab"), "truncated"),
    (_header(_key(b"a") + struct.pack("<IIQ", 9, 8, 2) + _key(b"x") + _key(b"\xff\xfe")),
     r"a string at byte 66 is not UTF-8"),
    (_header(n_kv=2), "truncated"),
    (_header(_key(b"a") + struct.pack("<II", 4, 1), _key(b"a") + struct.pack("<II", 4, 2)), "appears twice"),
    (_header(_key(b"general.alignment") + struct.pack("<II", 4, 3)), "not a power of two"),
], ids=["utf8", "value-type", "array-past-end", "strings-past-end", "string-bytes-past-end",
                              "utf8-in-array", "kv-past-end", "duplicate", "alignment"])
def test_malformed_header_is_one_clear_error(tmp_path, body, message):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(body)
    with pytest.raises(CheckpointError, match=message):
        open_gguf(bad)


@pytest.mark.parametrize("qtype", [T.Q4_0, T.Q5_1, T.Q8_0, T.Q4_K, T.Q5_K, T.Q6_K], ids=lambda q: q.name)
def test_decoding_in_chunks_is_decoding_at_once(monkeypatch, qtype):
    """Blocks decoded a chunk at a time (and chunks that end mid-tensor) give the codes, scales and biases one
    pass gives."""
    from support.gguf_files import tensor_data

    rows, cols = 40, 512
    data = tensor_data(qtype, rows, cols, np.random.default_rng(3))
    convert = quants.to_affine16 if qtype in quants.EXACT16 else quants.to_affine
    whole = convert(data, qtype, cols)
    monkeypatch.setattr(quants, "CHUNK_BLOCKS", 7)
    parts = convert(data, qtype, cols)
    for a, b in ((whole.q, parts.q), (whole.scales, parts.scales), (whole.biases, parts.biases)):
        assert np.array_equal(a, b)


def test_symmetric8_in_chunks_is_symmetric8_at_once(monkeypatch):
    rng = np.random.default_rng(1)
    values = (rng.standard_normal((50, 256)) * rng.uniform(0, 3, (50, 1))).astype(np.float32)
    values[4] = 0
    (w, s, b), bits, err = quants.symmetric8(lambda lo, hi: values[lo:hi], *values.shape)
    monkeypatch.setattr(quants, "CHUNK_VALUES", 3 * 256)  # chunks of 3 rows, the last one short
    (w2, s2, b2), bits2, err2 = quants.symmetric8(lambda lo, hi: values[lo:hi], *values.shape)
    assert (bits, err) == (bits2, err2) and err > 0
    for x, y in ((w, w2), (s, s2), (b, b2)):
        assert np.array_equal(x, y) and x.dtype == y.dtype
    back = np.asarray(w).view(np.uint8).astype(np.float32).reshape(50, 8, 32) * s[..., None] + b[..., None]
    assert np.abs(back.reshape(50, 256) - values).max() == pytest.approx(err)


@pytest.mark.parametrize("bits", quants.MLX_BITS)
def test_pack_across_chunks(bits):
    """Rows enough for several of `pack`'s chunks: each code at bits [j * bits, (j + 1) * bits) of its row."""
    rng = np.random.default_rng(bits)
    cols = 256
    rows = 3 * ((1 << 18) // cols) + 5
    q = rng.integers(0, 1 << bits, (rows, cols), dtype=np.uint8)
    packed = quants.pack(q, bits).view(np.uint8)
    row_bits = np.unpackbits(packed, axis=1, bitorder="little").reshape(rows, cols, bits)
    assert np.array_equal((row_bits << np.arange(bits, dtype=np.uint8)).sum(axis=-1), q)
    # codes in column order, as reordering a tensor's rows leaves them, pack the same
    assert np.array_equal(quants.pack(np.asfortranarray(q), bits).view(np.uint8), packed)
    assert np.array_equal(quants.unpack(packed.view("<u4"), bits, cols), q)  # and `unpack` gives them back


def test_q6_k_in_8_bits_is_symmetric8_of_its_values(monkeypatch):
    """The 8-bit copy of a Q6_K tensor, made from its exact groups as the import holds them (codes unpacked, its
    groups' largest |value| from the codes, not the values), is `symmetric8` of the gguf package's values, bit
    for bit, in chunks of a few rows on every core."""
    from types import SimpleNamespace

    from gguf import quants as gguf_quants
    from support.gguf_files import tensor_data

    from umakit.checkpoint.gguf import tensors

    rows, cols = 40, 512
    data = tensor_data(T.Q6_K, rows, cols, np.random.default_rng(5))
    monkeypatch.setattr(quants, "CHUNK_VALUES", 3 * cols)
    held, codes = tensors.exact16(SimpleNamespace(data=data, tensor_type=T.Q6_K, shape=(cols, rows)), None)
    assert np.array_equal(quants.unpack(held["weight"], 6, cols), codes)  # as a first load finds them
    (w, s, b), bits, err = tensors.requantized16(codes, held["scales"], 6)
    values = gguf_quants.dequantize(data, T.Q6_K)
    (w2, s2, b2), bits2, err2 = quants.symmetric8(lambda lo, hi: values[lo:hi], rows, cols)
    assert (bits, err) == (bits2, err2) == (8, err) and err > 0
    for x, y in ((w, w2), (s, s2), (b, b2)):
        assert np.array_equal(x, y) and x.dtype == y.dtype


@pytest.mark.parametrize("reserve", [64, 1 << 16], ids=["outgrown", "roomy"])
def test_streamed_safetensors_read_back(tmp_path, reserve):
    """Whether its header fits the room left for it or not, every reader reads the streamed file back."""
    path = tmp_path / "w.safetensors"
    out = StreamedSafetensors(path, reserve, metadata={"format": "mlx"})
    arrays = {"a.weight": np.arange(12, dtype=np.uint32).reshape(3, 4), "b." * 40 + "odd": np.ones(3, np.float16),
              "c": np.array([0.5, -1.0], dtype=np.float32)}
    out.update(arrays)
    out["d"] = mx.array([1.5, -2.25], dtype=mx.bfloat16)
    with pytest.raises(ValueError, match="written twice"):
        out["c"] = arrays["c"]
    assert out.close() == path.stat().st_size
    assert [p.name for p in tmp_path.iterdir()] == ["w.safetensors"]
    with safe_open(str(path), "np") as f:
        assert f.metadata() == {"format": "mlx"}
        for name, a in arrays.items():
            assert np.array_equal(f.get_tensor(name), a) and f.get_tensor(name).dtype == a.dtype
    loaded = mx.load(str(path))
    assert loaded["d"].dtype == mx.bfloat16 and loaded["d"].tolist() == [1.5, -2.25]
    assert read_safetensors_header(path)["a.weight"].shape == (3, 4)


def test_an_import_holds_one_tensor_at_a_time(tmp_path, monkeypatch):
    """Each converted tensor is written as it is made and let go of: when a tensor is written, none of those
    written before the GGUF tensor it comes from is still held (so memory holds one tensor, not the model)."""
    import weakref

    from umakit.checkpoint.gguf import import_gguf

    write, written = StreamedSafetensors.__setitem__, []

    def tracked(self, name, array):
        write(self, name, array)
        module = name.rsplit(".", 1)[0]
        alive = [n for n, ref in written if ref() is not None and n.rsplit(".", 1)[0] != module]
        assert not alive, f"{alive} still held when {name} was written"
        written.append((name, weakref.ref(array)))

    monkeypatch.setattr(StreamedSafetensors, "__setitem__", tracked)
    import_gguf(write_gguf(tmp_path / "m.gguf", layers=LOSSY_LAYERS + EXACT_LAYERS), tmp_path / "out")
    assert len(written) > 40


def test_corrupt_headers_are_one_clear_error_or_read(tmp_path):
    """Any byte of a GGUF's header changed, or the file cut anywhere in it: the reader gives its metadata or one
    of umakit's errors, never a bare exception from deep inside."""
    from umakit.errors import UmakitError

    good = write_gguf(tmp_path / "m.gguf").read_bytes()
    header = min(t.data_offset for t in open_gguf(tmp_path / "m.gguf").tensors.values())  # where the data starts
    rng = np.random.default_rng(7)
    bad = tmp_path / "bad.gguf"
    for i in range(400):
        data = bytearray(good)
        if i % 4 == 0:
            data = data[:int(rng.integers(8, header))]
        else:
            at = int(rng.integers(8, header))
            data[at] = int(rng.integers(0, 256))
        bad.write_bytes(bytes(data))
        try:
            gf = open_gguf(bad)
        except UmakitError:
            continue
        for t in gf.tensors.values():
            assert t.data.nbytes == t.n_bytes


@pytest.mark.parametrize("qtype", [T.Q2_K, T.Q3_K, T.IQ4_NL, T.Q6_K], ids=lambda q: q.name)
def test_requantizing_in_chunks_is_requantizing_at_once(monkeypatch, qtype):
    """A re-quantized type's rows a chunk at a time (rows reordered, as q and k are) give the codes, scales,
    biases, their dtypes and the error one pass gives."""
    from types import SimpleNamespace

    from support.gguf_files import tensor_data
    from umakit.checkpoint.gguf import tensors

    rng = np.random.default_rng(5)
    t = SimpleNamespace(data=tensor_data(qtype, 96, 512, rng), tensor_type=qtype, shape=(512, 96))
    order = rng.permutation(96)
    whole = tensors.requantize(t, order)
    monkeypatch.setattr(quants, "CHUNK_VALUES", 700)  # a row a chunk
    parts = tensors.requantize(t, order)
    assert whole[1:] == parts[1:]
    for a, b in zip(whole[0], parts[0]):
        a, b = np.array(a), np.array(b)
        assert a.dtype == b.dtype and np.array_equal(a, b)
