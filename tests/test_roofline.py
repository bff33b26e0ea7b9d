"""Roofline arithmetic: KV cache sizes, quantized bits per weight, decode ceilings."""

import pytest

from umakit.affine import bits_per_weight
from umakit.errors import InvalidArgumentError
from umakit.roofline import decode_roofline, kv_bytes_per_token, offload_ceiling_tps

GiB = 1 << 30
LLAMA2_7B = dict(num_layers=32, num_kv_heads=32, head_dim=128)


def test_llama2_7b_kv_cache_worked_examples():
    per_token = kv_bytes_per_token(**LLAMA2_7B)  # fp16
    assert per_token == 2 * 32 * 32 * 128 * 2 == 512 * 1024
    assert per_token * 8192 == 4 * GiB
    assert per_token * 32768 == 16 * GiB
    assert per_token * 32768 * 4 == 64 * GiB


def test_kv_16_bits_means_unquantized():
    assert kv_bytes_per_token(**LLAMA2_7B, kv_bits=16) == kv_bytes_per_token(**LLAMA2_7B)
    assert kv_bytes_per_token(**LLAMA2_7B, dtype_bytes=4) == 2 * kv_bytes_per_token(**LLAMA2_7B)


@pytest.mark.parametrize("bits, per_head", [(8, 128 + 2 * 2 * 2), (4, 64 + 2 * 2 * 2)])
def test_quantized_kv_adds_scale_and_bias_per_group(bits, per_head):
    # head_dim 128 at group 64: two groups, each with a 2-byte scale and a 2-byte bias.
    assert kv_bytes_per_token(**LLAMA2_7B, kv_bits=bits) == 2 * 32 * 32 * per_head
    assert kv_bytes_per_token(**LLAMA2_7B, kv_bits=bits, group_size=32) == 2 * 32 * 32 * (per_head + 8)


def test_quantized_bits_per_weight():
    assert bits_per_weight(4, 64) == 4.5
    assert bits_per_weight(8, 64) == 8.5
    assert bits_per_weight(4, 32) == 5.0
    assert bits_per_weight(4, 128, scale_bytes=4) == 4.5
    with pytest.raises(InvalidArgumentError):
        bits_per_weight(4, 0)


@pytest.mark.parametrize("kwargs", [dict(kv_bits=7), dict(kv_bits=2), dict(kv_bits=0), dict(num_layers=0),
                                    dict(group_size=0, kv_bits=4)])
def test_kv_rejects_bad_arguments(kwargs):
    with pytest.raises(InvalidArgumentError):
        kv_bytes_per_token(**{**LLAMA2_7B, **kwargs})


def test_decode_roofline_numbers():
    r = decode_roofline(1e9, 1e5, 10_000, 40.0, 100.0, "dev", "published")
    assert r.bytes_per_token == 2e9
    assert r.ceiling_tps == pytest.approx(50.0)
    assert r.achieved_gbps == pytest.approx(80.0)
    assert r.mbu == pytest.approx(0.8)
    assert (r.device_name, r.bandwidth_source, r.peak_gbps) == ("dev", "published", 100.0)


def test_decode_roofline_ceiling_only():
    r = decode_roofline(2e9, 0, 0, None, 100.0, "dev", "user")
    assert r.ceiling_tps == pytest.approx(50.0)
    assert r.achieved_gbps is None and r.mbu is None


@pytest.mark.parametrize("args", [(1e9, 0, 0, 1.0, 0.0), (0, 0, 0, 1.0, 100.0), (-1, 0, 0, 1.0, 100.0)])
def test_decode_roofline_rejects_bad_input(args):
    with pytest.raises(InvalidArgumentError):
        decode_roofline(*args, "dev", "published")


def test_offload_ceiling():
    # 10 GB from VRAM at 1000 GB/s (10 ms) + 1 GB over PCIe at 25 GB/s (40 ms) -> 20 steps/s
    assert offload_ceiling_tps(10e9, 1e9, 1000, 25) == pytest.approx(20.0)
    # nothing streamed: the plain roofline
    assert offload_ceiling_tps(10e9, 0, 1000, 25) == pytest.approx(100.0)
    with pytest.raises(InvalidArgumentError):
        offload_ceiling_tps(1e9, 1e9, 1000, 0)
