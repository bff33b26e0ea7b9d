"""umakit's CPU affine kernel (cpu/affine_kernel.py, csrc/affine_mm.cpp) against dequantize-then-matmul in float32.

Tolerance, per form of the inputs:
- float32 inputs: the kernel multiplies the checkpoint's own codes, scales and biases in float32, in another
  order than a GEMM does, so the two agree to float32's rounding of sums of a few hundred products (1e-5 of the
  largest output here). Scales and biases are float16 in the kernel's planes: exact for these layers, whose
  scales are float16 as MLX checkpoints store them.
- int8 inputs (where the library is built with AVX512-VNNI): x in blocks of 32, each scaled to +-127 and
  rounded (llama.cpp's Q8_0), so input k is off by at most max|x| of its block / 254, and an output by at most
  sum_k |scale_nk * (code_nk - 2^(bits-1))| * that (the codes centred; the biases meet exact sums of x);
  products and sums are exact in int32.
- int8 inputs in two passes (the CPU default with AVX512-VNNI): the remainder of that rounding, at most max|x|
  / 254, rounded the same way again, so input k is off by at most max|x| of its block / (254 * 254), and an
  output by at most the same sum times that.
- a GEMM's rows (from `dense_rows()` on): float32, or, where the kernel's GEMMs are bfloat16 (`gemm_form()`),
  x and the weights rounded to bfloat16 (2^-9 relative each), products summed in float32, each output rounded
  to bfloat16: off by at most sum_k |x_k w_nk| * 2 * 2^-9 plus 2^-9 of the output (checked at twice that).
"""

import contextlib

import pytest
import torch
import torch.nn.functional as F

from umakit.backends.torch import crossover
from umakit.backends.torch.cpu import affine_kernel as affine, build
from umakit.backends.torch.quant import layout

pytestmark = pytest.mark.skipif(not build.ensure(), reason="the C++ library cannot be built here")

RELATIVE = 1e-5
DENSE = crossover.AFFINE_DENSE_ROWS  # float32 inputs take GEMMs from here (int8 ones never do)


FORMS = {"float32": (affine.FLOAT32, 0), "int8": (affine.INT8, affine.INT8_LOOPS), "int8x2": (affine.INT8X2, affine.INT8_LOOPS)}


@pytest.fixture(params=sorted(FORMS), autouse=True)
def inputs(request, monkeypatch):
    """Every test runs on every form of the inputs the kernel is built for here."""
    form, feature = FORMS[request.param]
    if feature and not torch.ops.umakit.affine_features() & feature:
        pytest.skip(f"the library is not built for {request.param} inputs here")
    monkeypatch.setattr(affine, "inputs", lambda: form)
    return form


@contextlib.contextmanager
def onednn_turned(enabled: bool):
    """torch's oneDNN on or off (not `torch.backends.mkldnn.flags`, which also turns TF32 on)."""
    before = torch.backends.mkldnn.enabled
    torch.backends.mkldnn.enabled = enabled
    try:
        yield
    finally:
        torch.backends.mkldnn.enabled = before


def layer(rows: int, cols: int, bits: int, group: int, seed: int = 0, bias: bool = False) -> layout.QuantizedLinear:
    g = torch.Generator().manual_seed(seed)
    packed, s, b = layout.quantize(torch.randn(rows, cols, generator=g) * 0.05, bits, group)
    m = layout.QuantizedLinear(cols, rows, bias, bits, group, device="meta")
    m.weight, m.scales, m.biases = packed, s.half(), b.half()
    m.bias = torch.randn(rows, generator=g) if bias else None
    return m


def assert_close(got: torch.Tensor, want: torch.Tensor, x: torch.Tensor, parts: list, exact: bool = False) -> None:
    """Within the tolerance of the inputs' form (see the module's docstring); ``exact``: float32 whatever the form
    (a GEMM's rows)."""
    form = affine.FLOAT32 if exact else affine.inputs()
    if exact and affine.gemm_form() & affine.DENSE_BF16:
        weights = torch.cat([m.dequantized(torch.float32) for m in parts])
        bound = F.linear(x.abs(), weights.abs()) * 2 ** -8 + want.abs() * 2 ** -8
        assert ((got - want).abs() <= 2 * bound).all()
        return
    if form in (affine.INT8, affine.INT8X2):
        codes = torch.cat([layout.dequantize(m.weight, m.scales, m.scales * -(2 ** (m.bits - 1)), m.bits,
                                             m.group_size) for m in parts])  # scale * (code - 2^(bits-1))
        block = x.abs().unflatten(-1, (-1, 32)).amax(-1, keepdim=True).expand(*x.shape[:-1], -1, 32).flatten(-2)
        bound = F.linear(block, codes.abs()) / (254 if form == affine.INT8 else 254 * 254)
        assert ((got - want).abs() <= bound * 1.001 + RELATIVE * want.abs().max()).all()
        return
    worst = (got - want).abs().max() / want.abs().max()
    assert worst <= RELATIVE, f"off by {worst:.3g} of the largest output"


@pytest.mark.parametrize("bits", [2, 3, 4, 5, 6, 8])
@pytest.mark.parametrize("group", [32, 64, 128])
def test_tiles_hold_the_checkpoints_codes_exactly(bits, group):
    m = layer(40, 384, bits, group)
    codes, sb = affine.planes(m)
    assert codes.shape == (40, 384 * bits // 8)  # bits bits a weight, nothing more
    assert sb.shape == (5, 384 // group, 2, 8)
    assert torch.equal(dequantize(codes, sb, bits, group, 40), m.dequantized(torch.float32))
    picked = torch.tensor([39, 0, 17, 17])  # a tied table's lookups: any rows, any order
    assert torch.equal(torch.ops.umakit.affine_dequantize(codes, sb, bits, group, picked),
                       m.dequantized(torch.float32)[picked])


def dequantize(codes: torch.Tensor, sb: torch.Tensor, bits: int, group: int, rows: int) -> torch.Tensor:
    return torch.ops.umakit.affine_dequantize(codes, sb, bits, group, torch.arange(rows))


@pytest.mark.parametrize("bits", [4, 6])
def test_a_layer_of_rows_not_a_multiple_of_8_is_padded_and_cut_back(bits):
    """A vocabulary of 50257 rows, say: the last tile's rows past the layer are zeros, its outputs dropped."""
    m = layer(43, 256, bits, 64, bias=True)
    codes, sb = affine.planes(m)
    assert codes.shape == (48, 256 * bits // 8) and sb.shape == (6, 4, 2, 8)
    assert torch.equal(dequantize(codes, sb, bits, 64, 48)[:43], m.dequantized(torch.float32))
    assert not dequantize(codes, sb, bits, 64, 48)[43:].any()
    run = affine.AffineLinear([m])
    assert run.padded
    for rows in (1, 5, DENSE):
        x = torch.randn(rows, 256)
        assert_close(run(x), F.linear(x, m.dequantized(torch.float32), m.bias), x, [m],
                     exact=rows >= affine.dense_rows())


@pytest.mark.parametrize("bits", [2, 3, 4, 5, 6, 8])
@pytest.mark.parametrize("group", [32, 64, 128])
@pytest.mark.parametrize("rows", [1, 3, 4, 7, DENSE + 5])  # tiles of 4, remainders, GEMM
def test_the_kernel_equals_dequantize_then_matmul(bits, group, rows):
    m = layer(72, 256, bits, group, bias=True)
    run = affine.AffineLinear([m])
    x = torch.randn(2, rows, 256)
    assert_close(run(x), F.linear(x, m.dequantized(torch.float32), m.bias), x, [m],
                 exact=rows >= affine.dense_rows())


@pytest.mark.parametrize("bits", [3, 4, 5, 8])
def test_each_row_gets_the_bits_it_gets_alone(bits):
    """What lets a batch's rows and a verification's tokens reproduce their single decode steps."""
    run = affine.AffineLinear([layer(96, 512, bits, 64)])
    x = torch.randn(min(DENSE, affine.dense_rows()) - 1, 512)
    together = run(x)
    for i in (0, 3, 4, len(x) - 1):
        assert torch.equal(run(x[i:i + 1])[0], together[i])


def test_parts_of_different_widths_are_one_projection():
    """A GGUF's q/k/v at 5, 8 and 6 bits (groups apart too): one call, the concatenation of the three."""
    parts = [layer(64, 256, 5, 32, seed=1, bias=True), layer(32, 256, 8, 32, seed=2),
             layer(32, 256, 6, 64, seed=3, bias=True)]
    run = affine.AffineLinear(parts)
    x = torch.randn(3, 256)
    want = torch.cat([F.linear(x, m.dequantized(torch.float32), m.bias) for m in parts], dim=-1)
    assert run(x).shape == (3, 128)
    assert_close(run(x), want, x, parts)


def test_a_stored_packing_is_used_only_when_it_fits():
    m = layer(48, 256, 5, 32)
    fresh = affine.AffineLinear([m])
    stored = {k: v.clone() for k, v in fresh.packing().items()}
    stored["codes0"][0, 0] ^= 1  # marked: taken as stored, not repacked
    assert torch.equal(affine.AffineLinear([m], stored).codes0, stored["codes0"])
    wrong = {"codes0": stored["codes0"][:, :-4], "sb0": stored["sb0"]}
    assert torch.equal(affine.AffineLinear([m], wrong).codes0, fresh.codes0)


def test_bad_shapes_are_refused_with_a_reason():
    m = layer(16, 128, 4, 32)
    codes, sb = affine.planes(m)
    with pytest.raises(RuntimeError, match="bits must be"):
        torch.ops.umakit.affine_mm(torch.randn(1, 128), [codes], [sb], [7], [32], 1 << 30, affine.inputs())
    with pytest.raises(RuntimeError, match="codes must be"):
        torch.ops.umakit.affine_mm(torch.randn(1, 96), [codes], [sb], [4], [32], 1 << 30, affine.inputs())


def symmetric_layer(rows: int, cols: int, bits: int, group: int) -> layout.QuantizedLinear:
    """A GGUF-style symmetric layer (Q4_0, Q5_0, Q8_0): w = scale * (code - 2^(bits-1))."""
    g = torch.Generator().manual_seed(7)
    w = (torch.randn(rows, cols, generator=g) * 0.05).view(rows, cols // group, group)
    half = 2 ** (bits - 1)
    scales = (w.abs().amax(-1) / (half - 1)).half()
    q = (w / scales.float()[..., None]).round().clamp(-half, half - 1) + half
    m = layout.QuantizedLinear(cols, rows, False, bits, group, device="meta")
    m.weight, m.scales = layout.pack(q.view(rows, cols).to(torch.uint8), bits), scales
    m.biases = scales * -half
    return m


@pytest.mark.parametrize("bits", [4, 5, 8])
def test_symmetric_layers_keep_their_scales_alone(bits):
    """Half the scale bytes of a Q5_0 or Q8_0 layer; the biases recomputed exactly."""
    m = symmetric_layer(64, 256, bits, 32)
    codes, sb = affine.planes(m)
    assert sb.shape == (8, 8, 1, 8)
    assert torch.equal(dequantize(codes, sb, bits, 32, 64), m.dequantized(torch.float32))
    x = torch.randn(3, 256)
    assert_close(affine.AffineLinear([m])(x), F.linear(x, m.dequantized(torch.float32)), x, [m])
    asymmetric = layer(64, 256, bits, 32)
    assert not affine.symmetric(asymmetric.scales, asymmetric.biases, bits)  # min-max groups keep both


@pytest.mark.parametrize("bits", [2, 3, 4, 5, 6, 8])
@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_the_largest_codes_times_the_largest_inputs_do_not_saturate(bits, sign):
    """Every code at 2^bits - 1 and every input at its block's maximum: the int8 loops' sums of products are at
    their largest (without VNNI, the int16 sums vpmaddubsw and the loop's runs of chunks make)."""
    rows, cols = 16, 256
    m = layout.QuantizedLinear(cols, rows, False, bits, 32, device="meta")
    m.weight = layout.pack(torch.full((rows, cols), 2 ** bits - 1, dtype=torch.uint8), bits)
    m.scales = torch.full((rows, cols // 32), 0.01).half()
    m.biases = torch.full((rows, cols // 32), -0.02).half()
    x = torch.full((3, cols), sign)
    got = affine.AffineLinear([m])(x)
    assert_close(got, F.linear(x, m.dequantized(torch.float32)), x, [m])


@pytest.mark.parametrize("rows", [1, 7, 130])
def test_the_float32_gemm_is_torchs_within_float32_rounding(rows):
    """csrc/gemm.cpp: oneDNN's GEMM where it runs here, torch's own with torch's oneDNN turned off."""
    x, w = torch.randn(rows, 320), torch.randn(72, 320)
    exact = (x.double() @ w.double().t()).float()
    for onednn in (True, False):
        torch.testing.assert_close(torch.ops.umakit.gemm_f32(x, w, onednn), exact, rtol=1e-5, atol=1e-4)
    assert torch.equal(torch.ops.umakit.gemm_f32(x, w, False), torch.mm(x, w.t()))
    with onednn_turned(False):
        assert not affine.onednn() and not affine.gemm_form() & (affine.DENSE_ONEDNN | affine.DENSE_BF16)
        assert torch.equal(torch.ops.umakit.gemm_f32(x, w, True), torch.mm(x, w.t()))
        if affine.inputs() == affine.INT8X2:
            assert affine.dense_rows() == crossover.AFFINE_INT8X2_DENSE_ROWS


def test_a_long_prefill_on_either_gemm_equals_dequantize_then_matmul():
    m = layer(72, 256, 5, 64, bias=True)
    run, x = affine.AffineLinear([m]), torch.randn(max(DENSE, crossover.AFFINE_INT8X2_DENSE_ROWS) + 5, 256)
    expected = F.linear(x, m.dequantized(torch.float32), m.bias)
    for enabled in (True, False):
        with onednn_turned(enabled):
            assert_close(run(x), expected, x, [m], exact=len(x) >= affine.dense_rows())


def test_umakit_prefill_gemm_float32_keeps_a_long_prefill_in_float32(monkeypatch):
    m = layer(72, 256, 4, 64)
    run, x = affine.AffineLinear([m]), torch.randn(crossover.AFFINE_INT8X2_DENSE_ROWS + 5, 256)
    expected = F.linear(x, m.dequantized(torch.float32))
    monkeypatch.setenv(affine.PREFILL_VARIABLE, "float32")
    assert affine.prefill_gemm() == "float32" and not affine.gemm_form() & affine.DENSE_BF16
    in_float32 = run(x)
    assert_close(in_float32, expected, x, [m], exact=len(x) >= affine.dense_rows())
    monkeypatch.delenv(affine.PREFILL_VARIABLE)
    if affine.gemm_form() & affine.DENSE_BF16:  # this CPU multiplies bfloat16 natively: the default differs
        assert not torch.equal(run(x), in_float32)


@pytest.mark.parametrize("bits, group, rows", [(4, 32, 72), (5, 64, 40), (6, 32, 8), (8, 128, 136), (3, 32, 24)])
def test_amx_tiles_multiply_a_slice_as_dequantize_then_matmul(monkeypatch, bits, group, rows):
    """csrc/amx.cpp: the weights and x rounded to bfloat16 once, float32 sums and outputs (never rounded to
    bfloat16, as oneDNN's are), for slices whose rows and outputs are no multiples of the tiles' 16 and 32."""
    if not affine.gemm_form() & affine.DENSE_AMX:
        pytest.skip("the bfloat16 GEMMs do not run on AMX tiles here (no AMX, or not the two-pass form)")
    m = layer(rows, 384, bits, group)  # no bias: a float32 bias added would hide bfloat16 outputs
    run, weights = affine.AffineLinear([m]), m.dequantized(torch.float32)
    for n in (crossover.AFFINE_INT8X2_BF16_DENSE_ROWS, 17, 33, 100, 255):
        x = torch.randn(n, 384)
        expected, got = F.linear(x, weights), run(x)
        bound = F.linear(x.abs(), weights.abs()) * 2 ** -8 + 1e-6
        assert ((got - expected).abs() <= bound).all(), n
        assert (got.view(torch.int32) & 0xFFFF).any()  # float32 outputs: not oneDNN's widened bfloat16
    monkeypatch.setenv(affine.PREFILL_VARIABLE, "bfloat16-onednn")
    assert affine.gemm_form() & affine.DENSE_BF16 and not affine.gemm_form() & affine.DENSE_AMX
    on_onednn = run(x)
    assert_close(on_onednn, expected, x, [m], exact=True)
    assert not (on_onednn.view(torch.int32) & 0xFFFF).any()  # oneDNN's: widened bfloat16, which that check tells
    assert ((got - expected).abs().sum() < (on_onednn - expected).abs().sum())  # no output rounding


def test_an_unknown_umakit_prefill_gemm_is_refused_by_name(monkeypatch):
    from umakit.errors import ConfigError

    monkeypatch.setenv(affine.PREFILL_VARIABLE, "float16")
    with pytest.raises(ConfigError, match="UMAKIT_PREFILL_GEMM='float16'"):
        affine.prefill_gemm()


def k_quant_layer(rows: int, cols: int, bits: int, group: int, seed: int = 0) -> layout.QuantizedLinear:
    """A GGUF K-quant's layer as the import holds it: per super-block of 256 weights a float16 factor d (and
    dmin), per group a code, the scale d * sc (float32, exact). Groups of 32: Q4_K/Q5_K's 6-bit sc and m, biases
    -dmin * m; of 16: Q6_K's int8 sc, symmetric (bias -2^(bits-1) * scale), its largest |sc| 128."""
    g = torch.Generator().manual_seed(seed)
    supers, per = cols // 256, 256 // group
    d = (torch.rand(rows, supers, 1, generator=g) * 0.01 + 1e-4).half().float()
    if group == 16:
        sc = torch.randint(-127, 128, (rows, supers, per), generator=g).float()
        sc[..., 0] = -128
        scales, biases = (d * sc).view(rows, -1), None
    else:
        sc = torch.randint(0, 64, (rows, supers, per), generator=g).float()
        sc[..., 1] = 63
        m = torch.randint(0, 64, (rows, supers, per), generator=g).float()
        dmin = (torch.rand(rows, supers, 1, generator=g) * 0.01).half().float()
        scales, biases = (d * sc).view(rows, -1), -(dmin * m).view(rows, -1)
    if biases is None:
        biases = scales * -(2 ** (bits - 1))
    q = torch.randint(0, 2 ** bits, (rows, cols), generator=g, dtype=torch.uint8)
    layer = layout.QuantizedLinear(cols, rows, False, bits, group, dtype=torch.float32, device="meta")
    layer.weight, layer.scales, layer.biases = layout.pack(q, bits), scales, biases
    return layer


@pytest.mark.parametrize("bits,group", [(4, 32), (5, 32), (6, 16), (3, 16)])
def test_k_quant_scales_are_held_as_codes_exactly(bits, group):
    """A byte a scale and a float16 factor a super-block: Q4_K's 4.625 bits a weight, Q6_K's 6.5625."""
    m = k_quant_layer(40, 512, bits, group)
    codes, sb = affine.planes(m)
    planes = 1 if group == 16 else 2
    assert sb.dtype == torch.uint8 and sb.shape == (5, 2, planes * (16 + 8 * 256 // group))
    assert (codes.numel() + sb.numel()) * 8 / (40 * 512) == bits + planes * (8 + 16 / (256 // group)) / group
    assert torch.equal(dequantize(codes, sb, bits, group, 40), m.dequantized(torch.float32))
    run = affine.AffineLinear([m])
    for rows in (1, 3, 6, DENSE + 3):
        x = torch.randn(rows, 512)
        assert_close(run(x), F.linear(x, m.dequantized(torch.float32)), x, [m], exact=rows >= affine.dense_rows())


def test_k_quant_scales_found_past_the_first_code_tried():
    """Each block tries first the code the block before it took; blocks whose largest code is another (either
    sign, a new one each) are still held exactly, not sent to float16."""
    rows, cols, group = 48, 512, 16  # 96 super-blocks: the last 32 each of their own largest code
    m = k_quant_layer(rows, cols, 6, group, seed=3)
    blocks = m.scales.view(-1, 256 // group)
    g = torch.Generator().manual_seed(4)
    for b in range(64, len(blocks)):
        largest = int(torch.randint(1, 100, (), generator=g))
        codes = torch.randint(-largest, largest + 1, (256 // group,), generator=g).float()
        codes[0] = largest if b % 2 else -largest
        d = float(torch.rand((), generator=g) * 0.01 + 1e-4)
        blocks[b] = torch.tensor(d, dtype=torch.float16).float() * codes
    m.biases = m.scales * -32
    codes, sb = affine.planes(m)
    assert sb.dtype == torch.uint8
    assert torch.equal(dequantize(codes, sb, 6, group, rows), m.dequantized(torch.float32))


def test_scales_that_are_not_a_k_quants_keep_float16():
    """An MLX quantization's min-max scales are no factor times int8 codes: the float16 form, as before."""
    assert affine.planes(layer(40, 512, 4, 32))[1].dtype == torch.float16
    m = k_quant_layer(40, 512, 4, 32)
    m.scales = m.scales.clone()
    m.scales[3, 5] += 1e-7  # one scale no longer a product: the whole layer keeps float16
    assert affine.planes(m)[1].dtype == torch.float16


@pytest.mark.parametrize("bits", [3, 6, 8])
def test_groups_of_16_in_float16(bits):
    m = layer(24, 256, bits, 16)
    codes, sb = affine.planes(m)
    assert sb.shape == (3, 16, 2, 8)
    assert torch.equal(dequantize(codes, sb, bits, 16, 24), m.dequantized(torch.float32))
    run = affine.AffineLinear([m])
    for rows in (1, 5, DENSE + 1):
        x = torch.randn(rows, 256)
        assert_close(run(x), F.linear(x, m.dequantized(torch.float32)), x, [m], exact=rows >= affine.dense_rows())


def test_coded_and_float16_parts_are_one_projection():
    """A Q4_K_M's q/k/v: Q4_K, Q4_K and Q6_K parts (coded, groups of 32 and 16) beside a float16 one."""
    parts = [k_quant_layer(64, 512, 4, 32, seed=1), k_quant_layer(32, 512, 6, 16, seed=2), layer(32, 512, 5, 32)]
    run = affine.AffineLinear(parts)
    x = torch.randn(3, 512)
    want = torch.cat([F.linear(x, m.dequantized(torch.float32)) for m in parts], dim=-1)
    assert_close(run(x), want, x, parts)


def test_a_stored_coded_packing_is_used_only_when_it_fits():
    m = k_quant_layer(48, 512, 6, 16)
    fresh = affine.AffineLinear([m])
    stored = {k: v.clone() for k, v in fresh.packing().items()}
    assert stored["sb0"].dtype == torch.uint8
    stored["sb0"][0, 0, 20] ^= 1  # marked: taken as stored, not repacked
    assert torch.equal(affine.AffineLinear([m], stored).sb0, stored["sb0"])
    wrong = {"codes0": stored["codes0"], "sb0": stored["sb0"][:, :1]}  # one super-block of two
    assert torch.equal(affine.AffineLinear([m], wrong).sb0, fresh.sb0)


def test_a_super_block_whose_largest_code_is_not_63_is_still_found():
    """An importance-weighted K-quant may leave a block's largest 6-bit code below 63: searched with every code."""
    m = k_quant_layer(40, 512, 4, 32)
    scales = m.scales.view(40, 2, 8).clone()
    d = torch.tensor(0.003, dtype=torch.float16).float()
    scales[7, 1] = d * torch.tensor([1, 37, 5, 0, 12, 30, 2, 9.0])  # its largest code 37
    m.scales = scales.view(40, -1)
    codes, sb = affine.planes(m)
    assert sb.dtype == torch.uint8
    assert torch.equal(dequantize(codes, sb, 4, 32, 40), m.dequantized(torch.float32))


@pytest.mark.parametrize("listed, given", [
    (set(), []),
    ({"avx512_vnni"}, ["-mavx512vnni"]),
    ({"avx512_vnni", "avx512_bf16", "amx_tile", "amx_bf16"},
     ["-mavx512vnni", "-mavx512bf16", "-mamx-tile", "-mamx-bf16"]),
    ({"amx_tile"}, []),  # the tiles without their bfloat16 products: no AMX build
])
def test_the_build_is_given_only_the_instructions_this_cpu_lists(monkeypatch, listed, given):
    """The compiler may use what its flags allow anywhere in the library: a flag for an instruction this CPU lacks
    would build a library that dies of an illegal instruction."""
    monkeypatch.setattr(build, "_cpu_flags", lambda: listed)
    monkeypatch.setattr(build.torch.backends.cpu, "get_cpu_capability", lambda: "AVX512")
    monkeypatch.setattr(build.platform, "machine", lambda: "x86_64")
    extra = [f for f in build.flags() if f not in (*build.FLAGS, *build._AVX2_FLAGS, *build._AVX512_FLAGS)]
    assert extra == given
    monkeypatch.setattr(build.torch.backends.cpu, "get_cpu_capability", lambda: "AVX2")
    assert not {f for f in build.flags() if "512" in f or "amx" in f}


def test_a_layer_left_unread_is_packed_from_its_source_alone():
    """A layer a load left unread (meta, its tensors made by `source` when packed: load/gguf_layers.py) packs as
    the same layer read does, joined to others or tied as a head alike; one with no source is refused."""
    parts = [layer(24, 256, 4, 32, seed=1), layer(8, 256, 4, 32, seed=2)]

    def unread(m):
        ghost = layout.QuantizedLinear(m.in_features, m.out_features, False, m.bits, m.group_size, device="meta")
        ghost.source = lambda: (m.weight, m.scales, m.biases)
        return ghost

    x = torch.randn(3, 256)
    want = affine.AffineLinear(parts)(x)
    assert torch.equal(affine.AffineLinear([unread(m) for m in parts])(x), want)
    fused = layout.concat([unread(m) for m in parts])  # stacked, as a joiner does where the parts do not concatenate
    assert fused.weight.is_meta and torch.equal(affine.AffineLinear([fused])(x), want)
    table = layout.QuantizedEmbedding(24, 256, 4, 32, device="meta")
    table.source = parts[0].tensors
    assert torch.equal(affine.AffineLinear([table.as_linear()])(x), affine.AffineLinear(parts[:1])(x))
    with pytest.raises(affine.Unpacked, match="no codes here"):
        affine.AffineLinear([layout.QuantizedLinear(256, 8, False, 4, 32, device="meta")])
    # its codes given in tiles already are taken before its source (which then is never called)
    tiled = unread(parts[1])
    tiled.source = None
    tiled.tiled = lambda: (torch.ops.umakit.affine_planes(parts[1].weight, 4), parts[1].scales, parts[1].biases)
    assert torch.equal(affine.AffineLinear([tiled])(x), affine.AffineLinear(parts[1:])(x))
