"""Roofline arithmetic: KV cache sizes, quantized bits per weight, decode ceilings."""

import pytest

from umakit.core.affine import bits_per_weight
from umakit.errors import InvalidArgumentError
from umakit.plan.roofline import decode_roofline, kv_bytes_per_token, offload_ceiling_tps

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


def test_measure_decode_reads_the_rest_from_vram_and_never_a_negative_amount():
    from types import SimpleNamespace

    from umakit.plan.roofline import measure_decode

    dev = SimpleNamespace(peak_bandwidth_gbps=100.0, name="gpu", bandwidth_source="published", pcie_h2d_gbps=10.0)
    r, o = measure_decode(1e9, 4e8, 1e3, 1000, 2.0, dev, placement="experts", hit_rate=0.25)
    assert r.bytes_per_token == 1e9 + 1e6
    assert o.ceiling_tps == pytest.approx(offload_ceiling_tps(6e8 + 1e6, 4e8, 100.0, 10.0))
    assert (o.placement, o.hit_rate, o.streamed_bytes, o.achieved_pcie_gbps) == ("experts", 0.25, 4e8, 0.8)
    # a batch's union of experts streamed against one token's weight bytes: only the KV cache is left in VRAM
    _, o = measure_decode(1e9, 3e9, 1e3, 1000, None, dev)
    assert o.ceiling_tps == pytest.approx(offload_ceiling_tps(1e6, 3e9, 100.0, 10.0))
    # nothing streamed but an expert cache kept: its hits are still reported; no cache, no offload figures
    assert measure_decode(1e9, 0, 1e3, 10, 1.0, dev, hit_rate=1.0)[1].hit_rate == 1.0
    assert measure_decode(1e9, 0, 1e3, 10, 1.0, dev)[1] is None


def test_a_sharded_run_reports_the_link_share_of_each_step():
    from umakit.cli.format import stats_line
    from umakit.generate.stream import GenerationStats
    from umakit.hardware import DeviceInfo
    from umakit.plan.roofline import measure_decode

    dev = DeviceInfo(name="test", kind="cpu", memory_bytes=0, peak_bandwidth_gbps=100.0, bandwidth_source="user")
    r, _ = measure_decode(1e9, 0, 0, 0, 20.0, dev, comm_s_per_token=0.01)  # 20 steps/s, 10 ms each on the link
    assert r.comm_share == pytest.approx(0.2)
    stats = GenerationStats(decode_tps=20.0, generated_tokens=3, roofline=r)
    assert stats.to_dict()["link"] == {"comm_s_per_token": 0.01, "share_of_step": pytest.approx(0.2)}
    assert "link 10.00 ms/token (20% of a step)" in stats_line(stats)
    plain, _ = measure_decode(1e9, 0, 0, 0, 20.0, dev)
    assert plain.comm_share == 0 and "link" not in GenerationStats(roofline=plain).to_dict()
