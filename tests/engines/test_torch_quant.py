"""The torch backend's reading of MLX's affine quantization; `mx.quantize` is the ground truth."""

import json
import shutil

import mlx.core as mx
import numpy as np
import pytest
import torch
import torch.nn.functional as F

import umakit
from umakit.backends.torch import quant
from umakit.backends.torch import crossover
from umakit.backends.torch.cpu import affine_kernel as affine
from umakit.backends.torch.quant import forms, kernels

PROMPT = [5, 17, 42, 99, 3, 250, 7, 301, 12, 64, 128, 77, 31, 200, 11]


def mlx_quantized(rows, cols, bits, group_size, seed=0):
    w = mx.random.normal((rows, cols), key=mx.random.key(seed)) * 0.05
    q, s, b = mx.quantize(w, group_size=group_size, bits=bits)
    truth = np.array(mx.dequantize(q, s, b, group_size=group_size, bits=bits))
    as_torch = [torch.from_numpy(np.array(a)) for a in (q, s, b)]
    return as_torch, truth


def layer(rows, cols, bits, group_size, seed=0):
    (q, s, b), truth = mlx_quantized(rows, cols, bits, group_size, seed)
    m = quant.QuantizedLinear(cols, rows, False, bits, group_size, device="meta")
    m.weight, m.scales, m.biases = q, s.half(), b.half()  # checkpoints store half-precision scales
    return m


@pytest.mark.parametrize("bits", [2, 3, 4, 5, 6, 8])
@pytest.mark.parametrize("group_size", [32, 64, 128])
def test_unpack_agrees_with_mlx(bits, group_size):
    (q, s, b), truth = mlx_quantized(24, 256, bits, group_size)
    ours = quant.dequantize(q, s, b, bits, group_size).numpy()
    np.testing.assert_allclose(ours, truth, rtol=0, atol=1e-6)
    assert torch.equal(quant.pack(quant.unpack(q, bits, 256), bits), q)


@pytest.mark.parametrize("bits", [4, 8])
def test_quantize_then_dequantize_is_close(bits):
    w = torch.randn(32, 128)
    packed, s, b = quant.quantize(w, bits, 32)
    err = (quant.dequantize(packed, s, b, bits, 32) - w).abs().max()
    assert err <= (w.max() - w.min()) / 2**bits


SHAPES = [(80, 96, 32), (48, 192, 64), (272, 384, 128), (16, 128, 128), (100, 64, 32), (1040, 320, 64)]


@pytest.mark.parametrize("bits", [2, 3, 4, 5, 6, 8])
@pytest.mark.parametrize("rows, cols, group_size", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_execution_forms_equal_dequantize_then_matmul(bits, rows, cols, group_size, dtype):
    if dtype == torch.float16 and not quant.Fp16Linear.available():
        pytest.skip("float16 weights with float32 math need FBGEMM (x86)")
    m = layer(rows, cols, bits, group_size)
    reference = m.dequantized(torch.float32)
    model = torch.nn.Module()
    model.layer = m
    forms.convert_model(model, torch.device("cpu"), dtype)
    run = model.layer
    if dtype == torch.bfloat16 and affine.available():
        assert isinstance(run, affine.AffineLinear)  # every width, float32 activations
    elif dtype == torch.bfloat16 and rows % 16 == 0 and bits in (4, 8):
        assert isinstance(run, quant.Int4PackLinear)  # torch's int4 kernel where umakit's is not built
    for tokens in (1, 5):
        x = torch.randn(1, tokens, cols)
        want = F.linear(x, reference)
        got = run(x)
        if isinstance(run, affine.AffineLinear) and affine.inputs() != affine.FLOAT32:
            # int8 inputs: the form's own bound is tested in test_affine_kernel.py; here, a few
            # hundredths of sum_k |w_nk x_k|
            assert (got - want).abs().max() <= 2**-5 * F.linear(x.abs(), reference.abs()).max()
        elif dtype == torch.float32 or isinstance(run, affine.AffineLinear):  # float tolerance
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        elif dtype == torch.float16:  # float16 weights (2^-11 each), float32 inputs and sums
            assert (got - want).abs().max() <= 2**-10 * want.abs().max()
        elif isinstance(run, quant.Int4PackLinear):  # bfloat16 inputs and outputs: 8 significant bits
            assert (run(x.bfloat16()).float() - want).abs().max() <= 2**-7 * want.abs().max()
        else:  # what the int4 kernels cannot take meets a quantized model's float32 activations, dequantized
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_quantized_embedding_rows_equal_the_table():
    (q, s, b), truth = mlx_quantized(50, 64, 8, 32)
    e = quant.QuantizedEmbedding(50, 64, 8, 32, device="meta")
    e.weight, e.scales, e.biases = q, s, b
    ids = torch.tensor([[3, 0, 49, 3]])
    np.testing.assert_allclose(e(ids)[0].numpy(), truth[[3, 0, 49, 3]], atol=1e-6)


# -- a quantized checkpoint, with mlx-lm's per-layer overrides --------------------
OVERRIDES = {
    "model.embed_tokens": {"group_size": 32, "bits": 8},
    "model.layers.0.self_attn.k_proj": {"group_size": 64, "bits": 8},  # fused with 4-bit q and v
    "model.layers.0.mlp.down_proj": {"group_size": 64, "bits": 8},
    "lm_head": {"group_size": 64, "bits": 4},
}
FLOAT = ("layers.1.self_attn.v_proj", "layers.1.self_attn.o_proj")  # left unquantized


@pytest.fixture(scope="module", params=["llama", "qwen2"])  # qwen2: q/k/v biases and a tied, quantized table
def quantized_dir(request, tiny_dir, tmp_path_factory):
    """A tiny model quantized with mx.quantize: 4-bit g32, with the overrides above; two layers left float."""
    src = tiny_dir(request.param)
    out = tmp_path_factory.mktemp(f"{request.param}-q4")
    for f in src.iterdir():
        if f.suffix != ".safetensors":
            shutil.copy(f, out / f.name)
    weights = mx.load(str(src / "model.safetensors"))
    arrays = {}
    for name, w in weights.items():
        module = name.removesuffix(".weight")
        spec = OVERRIDES.get(module, {"group_size": 32, "bits": 4})
        if w.ndim != 2 or module.endswith(FLOAT):  # norms, and the float layers
            arrays[name] = w
            continue
        q, s, b = mx.quantize(w, **spec)
        arrays.update({name: q, f"{module}.scales": s.astype(mx.float16), f"{module}.biases": b.astype(mx.float16)})
    mx.save_safetensors(str(out / "model.safetensors"), arrays, metadata={"format": "mlx"})
    config = json.loads((src / "config.json").read_text())
    config["quantization"] = {"group_size": 32, "bits": 4, **OVERRIDES}
    (out / "config.json").write_text(json.dumps(config))
    return out


def test_quantized_checkpoint_matches_the_mlx_backend(quantized_dir):
    ours = umakit.load(quantized_dir, backend="torch", device="cpu", dtype="float32")
    theirs = umakit.load(quantized_dir, backend="mlx", device="cpu")
    np.testing.assert_allclose(ours.logits(PROMPT), theirs.logits(PROMPT), atol=1e-4, rtol=1e-4)
    w = ours.info.weights
    assert w.quantization.startswith("4-bit g32, some layers 4/8-bit")
    assert w.params == theirs.info.weights.params


@pytest.mark.parametrize(
    "dtype, kind, tolerance",
    [("float16", "Fp16Linear", 0.005), ("bfloat16", "AffineLinear", 0.05), ("bfloat16", "Int4PackLinear", 0.05)]
)
def test_quantized_checkpoint_in_half_precision_is_close(quantized_dir, dtype, kind, tolerance, monkeypatch):
    if kind == "Fp16Linear" and not quant.Fp16Linear.available():
        pytest.skip("float16 weights with float32 math need FBGEMM (x86)")
    if kind == "AffineLinear" and not affine.available():
        pytest.skip("umakit's affine kernel is not vectorized here")
    if kind == "Int4PackLinear":  # where the affine kernel is not built
        monkeypatch.setattr(affine, "available", lambda: False)
    ours = umakit.load(quantized_dir, backend="torch", device="cpu", dtype=dtype)
    assert ours.info.dtype == dtype
    assert kind in {type(m).__name__ for m in ours.engine.model.modules()}
    theirs = umakit.load(quantized_dir, backend="mlx", device="cpu").logits(PROMPT)
    assert np.abs(ours.logits(PROMPT) - theirs).max() <= tolerance * np.abs(theirs).max()


def test_auto_on_cpu_takes_the_fastest_form_of_the_machine(quantized_dir, monkeypatch):
    """umakit's affine kernel (float32 activations) wherever it is vectorized, under AVX2 as under AVX-512;
    without it, torch's int4 kernels under AVX-512 and FBGEMM's float16 weights under AVX2."""
    exact = umakit.load(quantized_dir, backend="mlx", device="cpu").logits(PROMPT)
    built = affine.available()
    for capability, kernel in (("AVX512", built), ("AVX2", built), ("AVX512", False), ("AVX2", False)):
        monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda c=capability: c)
        monkeypatch.setattr(affine, "available", lambda k=kernel: k)
        model = umakit.load(quantized_dir, backend="torch", device="cpu")
        kinds = {type(m).__name__ for m in model.engine.model.modules()}
        if kernel:
            expected, kind, tolerance = "bfloat16", "AffineLinear", 0.05
        elif capability == "AVX512":
            expected, kind, tolerance = "bfloat16", "Int4PackLinear", 0.05
        elif quant.Fp16Linear.available():
            expected, kind, tolerance = "float16", "Fp16Linear", 0.005
        else:
            expected, kind, tolerance = "float32", "Linear", 0.005
        assert model.info.dtype == expected and kind in kinds, (capability, kernel)
        assert np.abs(model.logits(PROMPT) - exact).max() <= tolerance * np.abs(exact).max()


@pytest.mark.parametrize("quantization, expected", [
    ({"bits": 4, "group_size": 32, "model.embed_tokens": {"bits": 8, "group_size": 32}}, "bfloat16"),
    ({"bits": 8, "group_size": 64}, "bfloat16"),
    ({"bits": 4, "group_size": 64, "lm_head": {"bits": 6, "group_size": 64}}, "bfloat16"),  # a 6-bit layer
    ({"bits": 3, "group_size": 64}, "bfloat16"),
    ({"bits": 5, "group_size": 32, "model.layers.0.mlp.down_proj": {"bits": 8, "group_size": 32}}, "bfloat16"),
    (None, "auto"),  # float weights
])
def test_cpu_auto_dtype_takes_packed_kernels_for_every_width(quantization, expected, monkeypatch):
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX512")
    monkeypatch.setattr(affine, "available", lambda: True)
    assert forms.cpu_auto_dtype(quantization) == expected
    monkeypatch.setattr(affine, "available", lambda: False)  # no C++ build: torch's int4 kernels take 4 and 8 bits
    widths = {(quantization or {}).get("bits")} | {v["bits"] for v in (quantization or {}).values()
                                                   if isinstance(v, dict)}
    assert forms.cpu_auto_dtype(quantization) == ("bfloat16" if widths <= {4, 8} else "auto")
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX2")
    assert forms.cpu_auto_dtype(quantization) == "auto"  # torch's int4 kernels are ~3x slower than FBGEMM here
    monkeypatch.setattr(affine, "available", lambda: True)  # umakit's kernel, vectorized for AVX2
    assert forms.cpu_auto_dtype(quantization) == expected


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("rows, cols, group_size", [(80, 96, 32), (128, 96, 32), (192, 384, 128), (4160, 64, 32)])
def test_int4_kernels_take_float32_inputs_and_return_float32(bits, rows, cols, group_size):
    """Inputs, outputs (and, from crossover.DENSE_ROWS rows on, weights) rounded to bfloat16's 8 significant bits only."""
    m = layer(rows, cols, bits, group_size)
    m.bias = torch.randn(rows) * 0.1
    want_weight = m.dequantized(torch.float32)
    run = quant.Int4PackLinear(m, torch.device("cpu"))
    # 4160 rows: two blocks of output rows; only where torch's CPU int4 layout is the one umakit unpacks (it
    # differs by CPU: AVX-512 machines have it, AVX2 ones do not)
    assert run.dense_prefill == (rows % 64 == 0 and kernels.cpu_layout_known())
    if run.dense_prefill:  # the unpacked weight is the one the kernel reads (its scales are bfloat16 too)
        eye = torch.eye(cols, dtype=torch.bfloat16)
        seen = run.op(torch.cat([eye, eye], -1) if run.split else eye, run.packed, group_size, run.scales_and_zeros)
        torch.testing.assert_close(run.dequantized(0, rows).float(), seen.float().T, rtol=2**-7, atol=1e-6)
    for tokens in (1, 7, crossover.DENSE_ROWS + 3):
        x = torch.randn(2, tokens, cols)
        got = run(x)
        want = F.linear(x, want_weight, m.bias)
        assert got.dtype == torch.float32 and got.shape == want.shape
        assert (got - want).abs().max() <= 2**-7 * want.abs().max()
        # the same kernel as bfloat16 inputs: float32 inputs change only the rounding of the output and bias
        assert (got - run(x.bfloat16()).float()).abs().max() <= 2**-7 * want.abs().max()


@pytest.mark.skipif(not quant.Fp16Linear.available(), reason="float16 weights with float32 math need FBGEMM (x86)")
def test_background_packing_gives_the_synchronous_result_and_its_errors():
    torch.manual_seed(0)
    lin = torch.nn.Linear(96, 40)
    x = torch.randn(3, 96)
    now = torch.ops.quantized.linear_prepack_fp16(lin.weight.detach(), lin.bias.detach())
    expected = torch.ops.quantized.linear_dynamic_fp16(x, now)
    with torch.inference_mode():
        assert torch.equal(quant.Fp16Linear(lin)(x), expected)
        q = quant.QuantizedLinear(64, 16, False, 4, 32)
        q.weight.zero_(), q.scales.fill_(1.0), q.biases.zero_()
        q.scales = None  # a broken layer: the error surfaces at its first call, not lost in a thread
        with pytest.raises(AttributeError):
            quant.Fp16Linear(q)(torch.randn(1, 64))
