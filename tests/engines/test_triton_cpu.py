"""The Triton dequantize-matvec, run by Triton's interpreter on CPU tensors against dequantize-then-matmul.

The interpreter is chosen by TRITON_INTERPRET=1 when triton is first imported
(its own library functions are jitted then), and other tests import triton
earlier (transformers does), so the kernels run in one child process started
with the variable set; it saves every case's output and the tests here compare.
The autotuner times configs on a GPU, so the child launches the raw kernel at
fixed configs, among them every config the autotuner may pick on CUDA.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton", reason="the Triton kernel tests need triton (Linux x86_64: pip install -e '.[test]')")

from umakit.backends.torch import quant
from umakit.backends.torch.quant import forms
from umakit.backends.torch.cuda import matvec  # noqa: E402

N, K = 97, 384  # N: not a multiple of any BLOCK_N; K: of every group size but not of BLOCK_K 256 or 512
BITS = (2, 3, 4, 5, 6, 8)
GROUPS = (32, 64, 128)
HALF = (torch.float16, torch.bfloat16)
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def layer(bits: int, group: int, dtype=torch.float32, rows: int = N, cols: int = K, bias: bool = False, seed=0):
    g = torch.Generator().manual_seed(seed)
    packed, s, b = quant.quantize(torch.randn(rows, cols, generator=g) * 0.05, bits, group)
    m = quant.QuantizedLinear(cols, rows, bias, bits, group, device="meta")
    m.weight, m.scales, m.biases = packed, s.to(dtype), b.to(dtype)
    if bias:
        m.bias = torch.randn(rows, generator=g).to(dtype)
    return m


def kernel(m: quant.QuantizedLinear, x: torch.Tensor, block_n: int, block_k: int) -> torch.Tensor:
    return matvec.affine_matvec(x, m.weight.view(torch.int32), m.scales, m.biases, m.bits, m.group_size,
                                 block_n, block_k)


def run_cases() -> dict:
    """Every case's (output, dequantize-then-matmul reference); runs in the interpreted child."""
    assert os.environ.get("TRITON_INTERPRET") == "1"
    torch.set_num_threads(1)
    out = {}
    for bits in BITS:
        for group in GROUPS:
            m = layer(bits, group)
            x = torch.randn(K, generator=torch.Generator().manual_seed(1))
            want = m.dequantized(torch.float32) @ x
            for block_n, block_k, _ in matvec.TUNING_CONFIGS:
                out[f"tuning-{bits}-{group}-{block_n}x{block_k}"] = kernel(m, x, block_n, block_k), want
        for dtype in HALF:
            m = layer(bits, 64, dtype)
            x = torch.randn(K, generator=torch.Generator().manual_seed(1)).to(dtype)
            out[f"half-{bits}-{dtype}"] = kernel(m, x, *matvec.FIXED_BLOCKS), m.dequantized(torch.float32) @ x.float()
    m = layer(4, 32, rows=5, cols=96)
    x = torch.randn(96)
    out["wide-block"] = kernel(m, x, 16, 512), m.dequantized(torch.float32) @ x
    for name, dtype in DTYPES.items():
        m = layer(8, 64, dtype, bias=True)
        run = matvec.TritonAffineLinear(m, dtype)
        for tokens in (1, 7):
            x = torch.randn(1, tokens, K).to(dtype)  # (B, T, K)
            w, b = m.dequantized(torch.float32), m.bias.float()
            size = F.linear(x.float().abs(), w.abs()) + b.abs()  # sum_k |w_nk x_k| + |b_n|
            out[f"module-{name}-{tokens}"] = run(x), F.linear(x.float(), w, b), size
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    path = tmp_path_factory.mktemp("triton") / "results.pt"
    here = Path(__file__).parent
    code = f"import sys, torch; sys.path.insert(0, {str(here)!r}); import test_triton_cpu as t; " \
           f"torch.save(t.run_cases(), {str(path)!r})"
    p = subprocess.run([sys.executable, "-c", code], env={**os.environ, "TRITON_INTERPRET": "1"},
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    return torch.load(path)


def assert_matches(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype, size: torch.Tensor | None = None,
                   roundings: int = 1) -> None:
    """float32: within 1e-5 of max |y|; half types: within ``roundings`` units in the last place of ``size``
    (|y| unless given), in the output dtype."""
    assert got.dtype == dtype and got.shape == want.shape
    got, want = got.float(), want.float()
    size = want.abs() if size is None else size
    if dtype == torch.float32:
        assert (got - want).abs().max() <= 1e-5 * size.max()
    else:  # accumulation is float32 on both sides: only the rounding of y to ``dtype`` differs
        ulp = roundings * torch.finfo(dtype).eps * size + 1e-5 * size.max()
        assert ((got - want).abs() <= ulp).all(), ((got - want).abs() / ulp).max()


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("group", GROUPS)
def test_every_tuning_config_equals_dequantize_then_matmul(results, bits, group):
    """N and K tails: 97 rows are no multiple of any BLOCK_N, 384 columns of neither BLOCK_K 256 nor 512."""
    for block_n, block_k, _ in matvec.TUNING_CONFIGS:
        assert_matches(*results[f"tuning-{bits}-{group}-{block_n}x{block_k}"], torch.float32)


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("dtype", HALF)
def test_half_inputs_and_scales_accumulate_in_float32(results, bits, dtype):
    assert_matches(*results[f"half-{bits}-{dtype}"], dtype)


def test_a_block_wider_than_the_layer_masks_its_tails(results):
    assert_matches(*results["wide-block"], torch.float32)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens", [1, 7])
def test_linear_layer_one_token_fused_and_many_dequantized(results, dtype, tokens):
    """One row runs the kernel (interpreted, at `FIXED_BLOCKS`); more rows dequantize and call F.linear.
    In half types more rows round the weights to the compute dtype, so the bound is on sum_k |w_nk x_k| + |b_n|,
    and y is rounded twice (before the bias is added and after)."""
    got, want, size = results[f"module-{dtype}-{tokens}"]
    assert_matches(got, want, DTYPES[dtype], size, roundings=2)


@pytest.mark.parametrize("bits, dtype, kind", [
    (4, torch.bfloat16, "Int4PackLinear"),  # tinygemm wherever it applies
    (4, torch.float16, "TritonAffineLinear"),
    (8, torch.bfloat16, "TritonAffineLinear"),
    (2, torch.float32, "TritonAffineLinear"),
    (5, torch.bfloat16, "TritonAffineLinear"),  # a GGUF's Q5_0/Q5_K layers
    (6, torch.float16, "TritonAffineLinear"),
    (3, torch.bfloat16, "TritonAffineLinear"),
])
def test_cuda_forms_chosen_with_triton_installed(bits, dtype, kind):
    m = layer(bits, 64, torch.float16, rows=96, cols=256)
    assert type(forms.cuda_linear(m, dtype)).__name__ == kind
