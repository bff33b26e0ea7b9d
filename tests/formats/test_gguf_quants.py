"""Block-level proof: every GGUF type umakit converts dequantizes, through MLX,
to what the `gguf` package's own dequantization gives for the same bytes."""

import mlx.core as mx
import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as T
from gguf import quants as gguf_quants

from umakit.checkpoint.gguf import quants

ROWS, COLS = 8, 512
# Types the gguf package can quantize: real quantizer output, as llama.cpp would write it.
QUANTIZABLE = [T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0]
# Byte offset and magnitude of each float16 super-scale in a block; other bytes are random.
FP16_FIELDS = {
    T.Q4_0: ((0, 0.01),), T.Q4_1: ((0, 0.01), (2, 0.1)), T.Q5_0: ((0, 0.01),), T.Q5_1: ((0, 0.01), (2, 0.1)),
    T.Q8_0: ((0, 0.001),), T.Q4_K: ((0, 1e-4), (2, 1e-4)), T.Q5_K: ((0, 5e-5), (2, 5e-5)),
    T.Q2_K: ((80, 2e-3), (82, 2e-3)), T.Q3_K: ((108, 5e-4),), T.Q6_K: ((208, 2e-5),), T.IQ4_NL: ((0, 5e-4),),
}


def random_blocks(qtype, rows, cols, rng, sign=True):
    """Raw blocks with random codes and sub-scales and sane float16 super-scales."""
    block, size = GGML_QUANT_SIZES[qtype]
    blocks = rng.integers(0, 256, (rows * cols // block, size), dtype=np.uint8)
    for offset, scale in FP16_FIELDS[qtype]:
        d = rng.uniform(0.1, 1.0, len(blocks)) * scale * (rng.choice([-1, 1], len(blocks)) if sign else 1)
        blocks[:, offset : offset + 2] = d.astype(np.float16).view(np.uint8).reshape(-1, 2)
    return blocks.reshape(rows, -1)


def mlx_values(w, scales, biases, bits):
    """What MLX computes from the stored arrays, in float32."""
    out = mx.dequantize(
        mx.array(w), mx.array(scales).astype(mx.float32), mx.array(biases).astype(mx.float32),
        group_size=quants.GROUP_SIZE, bits=bits,
    )
    return np.array(out)


def convert(data, qtype):
    aff = quants.to_affine(data, qtype, COLS)
    dtype = quants.pick_dtype(aff.scales, aff.biases)
    return quants.pack(aff.q, aff.bits), aff.scales.astype(dtype), aff.biases.astype(dtype), aff.bits


def assert_same_values(got, want):
    """Equal as float32 values; the only bit patterns allowed to differ are +0 and -0."""
    assert got.dtype == want.dtype == np.float32 and got.shape == want.shape
    assert np.array_equal(got, want), f"max abs diff {np.abs(got - want).max()}"
    differ = got.view(np.uint32) != want.view(np.uint32)
    assert (want[differ] == 0).all()


@pytest.mark.parametrize("qtype", QUANTIZABLE, ids=lambda t: t.name)
def test_quantizer_output_converts_exactly(qtype):
    rng = np.random.default_rng(int(qtype))
    x = rng.normal(0, 0.05, (ROWS, COLS)).astype(np.float32)
    x[0, :32] = 0.0  # an all-zero group (d == 0)
    data = gguf_quants.quantize(x, qtype)
    w, scales, biases, bits = convert(data, qtype)
    assert scales.dtype == np.float16  # d, -8d, m, -128d are all float16 values
    assert_same_values(mlx_values(w, scales, biases, bits), gguf_quants.dequantize(data, qtype))


@pytest.mark.parametrize("qtype", list(quants.EXACT), ids=lambda t: t.name)
def test_random_blocks_convert_exactly(qtype):
    rng = np.random.default_rng(100 + int(qtype))
    data = random_blocks(qtype, ROWS, COLS, rng)
    w, scales, biases, bits = convert(data, qtype)
    assert bits == {T.Q8_0: 8, T.Q5_0: 5, T.Q5_1: 5, T.Q5_K: 5}.get(qtype, 4)
    assert w.dtype == np.uint32 and w.shape == (ROWS, COLS * bits // 32)
    assert scales.shape == biases.shape == (ROWS, COLS // 32)
    assert_same_values(mlx_values(w, scales, biases, bits), gguf_quants.dequantize(data, qtype))


@pytest.mark.parametrize("qtype", [T.Q4_K, T.Q5_K], ids=lambda t: t.name)
def test_k_quant_scales_need_float32(qtype):
    """d * sc is exact in float32 but generally not in float16: storing float16 would lose it."""
    data = random_blocks(qtype, ROWS, COLS, np.random.default_rng(7), sign=False)
    aff = quants.to_affine(data, qtype, COLS)
    assert quants.pick_dtype(aff.scales, aff.biases) == np.float32
    rounded = mlx_values(quants.pack(aff.q, aff.bits), aff.scales.astype(np.float16), aff.biases.astype(np.float16),
                         aff.bits)
    assert not np.array_equal(rounded, gguf_quants.dequantize(data, qtype))


def test_row_permutation_keeps_groups_exact():
    data = random_blocks(T.Q4_K, ROWS, COLS, np.random.default_rng(3))
    order = np.random.default_rng(4).permutation(ROWS)
    aff = quants.to_affine(data, T.Q4_K, COLS).take_rows(order)
    got = mlx_values(quants.pack(aff.q, aff.bits), aff.scales, aff.biases, aff.bits)
    assert_same_values(got, gguf_quants.dequantize(data, T.Q4_K)[order])


@pytest.mark.parametrize("bits", quants.MLX_BITS)
def test_pack_matches_mlx_quantize(bits):
    """mx.quantize's own packing is the ground truth for the word layout."""
    rng = np.random.default_rng(bits)
    w = mx.array(rng.normal(size=(6, 256)).astype(np.float32))
    packed, scales, biases = mx.quantize(w, group_size=32, bits=bits)
    values = np.array(mx.dequantize(packed, scales, biases, group_size=32, bits=bits)).reshape(6, 8, 32)
    codes = np.rint((values - np.array(biases)[..., None]) / np.array(scales)[..., None]).astype(np.uint8)
    assert np.array_equal(quants.pack(codes.reshape(6, 256), bits), np.array(packed))


@pytest.mark.parametrize("qtype, bits", [(T.Q6_K, 8), (T.Q3_K, 4), (T.Q2_K, 3), (T.IQ4_NL, 5)],
                         ids=lambda v: getattr(v, "name", str(v)))
def test_lossy_types_pick_a_wide_enough_width(qtype, bits):
    assert qtype not in quants.EXACT
    assert quants.lossy_bits(qtype) == bits
    assert quants.can_dequantize(qtype)


def test_types_the_gguf_package_cannot_read_are_detected():
    assert not quants.can_dequantize(T.Q8_1)
    assert not quants.can_dequantize(T.Q8_K)
