"""umakit's CPU kernel for affine-quantized layers (csrc/affine_mm.cpp): every width from 2 to 8 bits, group sizes
16 (a GGUF's Q6_K, load/exact.py), 32, 64 and 128, one call for a projection whose parts differ in width.

torch's int4 kernels hold 4 bits only (8 as two nibble planes, at twice the reads and work), and a layer of any
other width ran dequantized (float16 or float32: 3-6x the bytes of its codes), so one 5-bit tensor sent a
whole GGUF to float16. This kernel reads each layer's own codes, ``bits`` bits a weight, with the rows in tiles
of 8 that accumulate side by side in one register (csrc/affine.h), plus a float16 scale and bias per group (the
scale alone for a symmetric layer), or, for a GGUF's K-quants, their int8 codes and float16 factors
(cpu/scale_codes.py). Its outputs, activations and sums are float32; its inputs are multiplied in
int8 blocks (`inputs`). quant/forms.py gives it every quantized CPU layer where it is vectorized: AVX2 with FMA
and F16C, or AVX-512 (`available`).
"""

from __future__ import annotations

import functools
import os

import torch
import torch.nn.functional as F
from torch import nn

from umakit.backends.torch import crossover
from umakit.backends.torch.cpu import build, scale_codes
from umakit.backends.torch.quant.layout import QuantizedLinear
from umakit.errors import CheckpointError, ConfigError

KERNEL_BITS = (2, 3, 4, 5, 6, 8)
BLOCK = 32  # weights of a row in a block of the tiles
ROWS = 8  # rows in a tile


def available() -> bool:
    """Whether the kernel is built here, vectorized: torch found AVX2 or AVX-512, the C++ library loads
    (cpu/build.py), and it was compiled with its vector loops."""
    return (torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512") and build.ensure()
            and bool(features() & VECTOR))


FLOAT32, INT8, INT8X2 = 0, 2, 3  # the forms the kernel multiplies x in (csrc/affine.h)
AVX512, VECTOR, VNNI, INT8_LOOPS, AMX = 1, 2, 4, 8, 16  # the library's features (csrc/affine.h `affine_features`)


@functools.cache
def features() -> int:
    """What the library was compiled with, asked once (call after `build.ensure()`)."""
    return int(torch.ops.umakit.affine_features())


@functools.cache
def inputs() -> int:
    """The form the kernel multiplies x in (asked of the library once, not on every call; csrc/affine.h): where it
    has int8 loops, int8 blocks of 32 in two passes, the value and then what rounding left of it; else float32.
    One pass (llama.cpp's Q8_0 activations) turned the built-in model's "The capital of France is Paris." into a
    run-on list of French words, as it does in llama.cpp; two keep its float32 answers (docs/quantization.md)."""
    return INT8X2 if features() & INT8_LOOPS else FLOAT32


# or'ed into the form: a long prefill's GEMMs in bfloat16, or float32 on oneDNN; the bfloat16 ones on AMX tiles
DENSE_BF16, DENSE_ONEDNN, DENSE_AMX = 16, 32, 64
# "float32" keeps a long prefill's GEMMs in float32 where bfloat16 is the default; "bfloat16-onednn" keeps the
# bfloat16 ones on oneDNN where AMX tiles would take them
PREFILL_VARIABLE = "UMAKIT_PREFILL_GEMM"
PREFILL_GEMMS = ("bfloat16", "float32", "bfloat16-onednn")


def dense_rows() -> int:
    """Input rows from which a layer dequantizes blocks of weights for GEMMs (crossover.py, per form and GEMM)."""
    form = inputs()
    if form == FLOAT32:
        return crossover.AFFINE_DENSE_ROWS
    if form == INT8:
        return crossover.AFFINE_INT8_DENSE_ROWS
    if not onednn():
        return crossover.AFFINE_INT8X2_DENSE_ROWS
    return crossover.AFFINE_INT8X2_BF16_DENSE_ROWS if prefill_gemm() == "bfloat16" else \
        crossover.AFFINE_INT8X2_ONEDNN_DENSE_ROWS


def _dense_rows_now() -> int:
    return crossover.ALONE if crossover.alone() else dense_rows()


def prefill_gemm() -> str:
    """The dtype of a long prefill's GEMMs: "bfloat16" where the CPU multiplies it natively (AVX512-BF16 or AMX)
    on oneDNN and `PREFILL_VARIABLE` does not ask for float32, else "float32". The weights and inputs are rounded
    to bfloat16 (2^-9 relative), the products summed in float32, each output rounded to bfloat16 once; the
    activations between layers, the residual stream, attention and every decode step stay float32. Measured on
    the built-in model (docs/performance.md): +0.05% perplexity on 8,192 Austen tokens; the next token after 100
    windows of 33-90 tokens matched the float32 engine's in all, a mean KL of 1.3e-4 from its distribution."""
    return _prefill_gemm(os.environ.get(PREFILL_VARIABLE, ""), torch.backends.mkldnn.enabled)


@functools.cache
def _prefill_gemm(asked: str, onednn_on: bool) -> str:
    if asked and asked not in PREFILL_GEMMS:
        raise ConfigError(f"{PREFILL_VARIABLE}={asked!r} is not one of {', '.join(PREFILL_GEMMS)}")
    checks = ("_is_avx512_bf16_supported", "_is_amx_tile_supported")
    native = any(getattr(torch.cpu, f, lambda: False)() for f in checks)
    return "bfloat16" if asked != "float32" and native and onednn_on and _onednn_runs() else "float32"


def gemm_form() -> int:
    """`inputs()`, with `DENSE_ONEDNN` where the GEMMs take oneDNN and `DENSE_BF16` where a long prefill's GEMMs
    are bfloat16 (the two-pass form's, whose CPUs have oneDNN's bfloat16 GEMMs; the others' crossovers were
    measured in float32)."""
    form = inputs()
    if not onednn():
        return form
    if form != INT8X2 or prefill_gemm() != "bfloat16":
        return form | DENSE_ONEDNN
    return form | DENSE_ONEDNN | DENSE_BF16 | (DENSE_AMX if gemm_tiles() else 0)


def gemm_tiles() -> bool:
    """Whether a prompt's bfloat16 GEMMs below 256 rows (a server's slices) run on AMX tiles (csrc/amx.cpp):
    where the library was built with them and Linux grants their state, unless `PREFILL_VARIABLE` asks for
    "bfloat16-onednn". The tiles multiply the slabs of weights as they are dequantized, where oneDNN repacks each
    slab first, and write float32 outputs (docs/performance.md, "Prompt slices on AMX tiles")."""
    return prefill_gemm() == "bfloat16" and os.environ.get(PREFILL_VARIABLE, "") != "bfloat16-onednn" \
        and bool(features() & AMX)


def onednn() -> bool:
    """Whether the GEMMs run on oneDNN here (csrc/gemm.cpp): where torch runs its AVX-512 kernels (so that
    ATEN_CPU_CAPABILITY=avx2 shows what an AVX2 CPU gets) and oneDNN passes its own checks;
    ``torch.backends.mkldnn.enabled`` is read on every call."""
    return torch.backends.mkldnn.enabled and _onednn_runs()


@functools.cache
def _onednn_runs() -> bool:
    return torch.backends.cpu.get_cpu_capability() == "AVX512" and bool(torch.ops.umakit.gemm_onednn())


def supports(m: QuantizedLinear) -> bool:
    return m.bits in KERNEL_BITS and m.in_features % BLOCK == 0 and (m.group_size % BLOCK == 0 or m.group_size == 16)


def concatenates(parts: list[QuantizedLinear]) -> bool:
    """Whether the kernel takes ``parts`` as one call: every part of a multiple of 8 rows, so none is padded."""
    return all(m.out_features % ROWS == 0 for m in parts)


def symmetric(scales: torch.Tensor, biases: torch.Tensor, bits: int) -> bool:
    """Whether every bias is -2^(bits-1) times its scale (a GGUF's Q4_0, Q5_0 and Q8_0 blocks): then the kernel
    reads the scales alone and recomputes the biases, exactly."""
    return torch.equal(biases.float(), scales.float() * -(2 ** (bits - 1)))


class Unpacked(CheckpointError):
    """A layer that a load left unread (its codes left in a GGUF, load/gguf_layers.py) and no kept packing holds."""


def planes(m: QuantizedLinear) -> tuple[torch.Tensor, torch.Tensor]:
    """``m``'s codes in the kernel's tiles, (rows, in * bits / 8) uint8, and its float16 scales and biases,
    (rows / 8, groups, 2, 8), or its scales alone, (rows / 8, groups, 1, 8), where it is `symmetric`; or, where
    they are a K-quant's, the same as int8 codes and float16 factors (`scale_codes.coded`); rows is
    ``m.out_features`` rounded up to a multiple of 8, the rows added all zero."""
    rows = _padded_rows(m)
    if m.weight.is_meta and m.tiled is not None:  # a GGUF's blocks, decoded into tiles (load/gguf_layers.py)
        codes, scales, biases = m.tiled()
    else:
        weight, scales, biases = m.tensors()
        if weight.is_meta:
            raise Unpacked(f"a layer of {m.out_features} x {m.in_features} has no codes here and no kept packing")
        weight = weight.contiguous()
        if rows > m.out_features:
            weight = torch.cat([weight, weight.new_zeros(rows - m.out_features, weight.shape[1])])
        codes = torch.ops.umakit.affine_planes(weight, m.bits)
    kept = [scales] if symmetric(scales, biases, m.bits) else [scales, biases]
    coded = scale_codes.coded(kept, m.group_size, rows)  # a K-quant's: a byte a scale
    if coded is not None:
        return codes, coded
    return codes, torch.stack([_tiled(t.to(torch.float16), rows) for t in kept], dim=2).contiguous()


def _padded_rows(m: QuantizedLinear) -> int:
    """``m``'s rows rounded up to a whole tile."""
    return -(-m.out_features // ROWS) * ROWS


def _tiled(t: torch.Tensor, rows: int) -> torch.Tensor:
    """(out, groups) -> (rows / 8, groups, 8), zero past ``out``."""
    padded = torch.cat([t, t.new_zeros(rows - t.shape[0], t.shape[1])])
    return padded.view(rows // ROWS, ROWS, t.shape[1]).transpose(1, 2)


class AffineLinear(nn.Module):
    """One or more `QuantizedLinear` parts of one input width on umakit's kernel, their outputs concatenated
    (a q/k/v projection whose parts a GGUF stores at 5, 6 and 8 bits is still one call). Every part but a lone
    one has a multiple of 8 rows (`concatenates`); a lone one is padded to it and its outputs cut back."""

    def __init__(self, parts: list[QuantizedLinear], prepacked: dict | None = None):
        """``prepacked``: the planes an earlier load stored (load/packed.py), by `packing`'s names."""
        super().__init__()
        first = parts[0]
        assert len(parts) == 1 or concatenates(parts), "parts of a multiple of 8 rows"
        self.in_features, self.out_features = first.in_features, sum(m.out_features for m in parts)
        self.bits = [m.bits for m in parts]
        self.groups = [m.group_size for m in parts]
        stored = prepacked or {}
        for i, m in enumerate(parts):
            codes, sb = stored.get(f"codes{i}"), stored.get(f"sb{i}")
            if not self._fits(m, codes, sb):
                codes, sb = planes(m)
            self.register_buffer(f"codes{i}", codes)
            self.register_buffer(f"sb{i}", sb)
        biases = [m.bias.float() if m.bias is not None else torch.zeros(m.out_features) for m in parts]
        has_bias = any(m.bias is not None for m in parts)
        self.register_buffer("bias", torch.cat(biases) if has_bias else None)

    @classmethod
    def reuses(cls, parts: list[QuantizedLinear], prepacked: dict | None) -> bool:
        """Whether ``prepacked`` holds every part's planes, so that making the layer reads none of their codes."""
        stored = prepacked or {}
        return all(cls._fits(m, stored.get(f"codes{i}"), stored.get(f"sb{i}")) for i, m in enumerate(parts))

    @staticmethod
    def _fits(m: QuantizedLinear, codes: torch.Tensor | None, sb: torch.Tensor | None) -> bool:
        groups, rows = m.in_features // m.group_size, _padded_rows(m)
        # scales alone or with biases, as the packing found them (`symmetric` would read the checkpoint's scales;
        # the stored packing is keyed by the checkpoint's files)
        if codes is None or sb is None or codes.dtype != torch.uint8:
            return False
        if tuple(codes.shape) != (rows, m.in_features * m.bits // 8):
            return False
        if sb.dtype == torch.uint8:  # coded: (rows / 8, super-blocks, planes * (16 + 8 * per))
            per = scale_codes.SUPER // m.group_size
            return (sb.dim() == 3 and tuple(sb.shape[:2]) == (rows // ROWS, groups // per)
                    and sb.shape[2] in (16 + 8 * per, 2 * (16 + 8 * per)))
        return (sb.dtype == torch.float16 and sb.dim() == 4 and tuple(sb.shape[:2]) == (rows // ROWS, groups)
                and sb.shape[2] in (1, 2) and sb.shape[3] == ROWS)

    def packing(self) -> dict[str, torch.Tensor]:
        """What `load/packed.py` keeps of this layer, by name."""
        return {name: t for name, t in self.named_buffers() if name != "bias"}

    @property
    def padded(self) -> bool:
        """Whether the kernel computes more outputs than the layer has (a lone part padded to 8 rows)."""
        return self.codes0.shape[0] > self.out_features

    @property
    def parts(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        n = len(self.bits)
        return [getattr(self, f"codes{i}") for i in range(n)], [getattr(self, f"sb{i}") for i in range(n)]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape, dtype = x.shape[:-1], x.dtype
        codes, sb = self.parts
        y = torch.ops.umakit.affine_mm(x.reshape(-1, self.in_features).float(), codes, sb, self.bits, self.groups,
                                       _dense_rows_now(), gemm_form())
        if y.shape[1] > self.out_features:  # a lone part's padding rows
            y = y[:, : self.out_features]
        if self.bias is not None:
            y = y + self.bias
        return y.to(dtype).view(*shape, self.out_features)


class AffineEmbedding(nn.Module):
    """A tied table's lookups read from its output head's planes: the table is held once, as the head reads it."""

    def __init__(self, head: AffineLinear, dtype: torch.dtype):
        super().__init__()
        assert len(head.bits) == 1, "a table is one part"
        self.head, self.dtype = [head], dtype  # a list: the head stays the model's own module, not a child here
        self.bits, self.group = head.bits[0], head.groups[0]

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        head = self.head[0]
        flat = ids.reshape(-1)
        rows = torch.ops.umakit.affine_dequantize(head.codes0, head.sb0, self.bits, self.group, flat)
        return rows.to(self.dtype).view(*ids.shape, -1)


SILU, GELU_TANH = 0, 1  # the activations csrc/experts.cpp computes, as torch's own silu and tanh gelu


def native_activation(act) -> int | None:
    """`SILU` or `GELU_TANH` where ``act`` is torch's own F.silu or F.gelu(approximate="tanh") (as a function,
    `nn.SiLU` or a partial), else None: the experts' C++ step then stays in Python."""
    if act is F.silu or isinstance(act, nn.SiLU):
        return SILU
    gelu = isinstance(act, functools.partial) and act.func is F.gelu and not act.args
    return GELU_TANH if gelu and act.keywords == {"approximate": "tanh"} else None


def expert_rows(forms: tuple, act: int, x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor | None:
    """Row i of ``x`` (R, H) through expert ``idx[i]``'s gated MLP in one C++ call (csrc/experts.cpp), with the
    bits of moe.py's Python path; ``forms``: the gate's, up's and down's layers an expert (`Experts.forms`). None
    where the call does not take them: a layer of more than one part or with a bias, or x not float32."""
    if x.dtype != torch.float32 or x.device.type != "cpu":
        return None
    picked = sorted(set(idx.tolist()))
    layers = [f[e] for e in picked for f in forms]
    if any(len(m.bits) != 1 or m.bias is not None for m in layers):
        return None
    planes = [m._buffers[name] for m in layers for name in ("codes0", "sb0")]
    first = layers[:3]
    return torch.ops.umakit.expert_rows(x, idx, picked, planes, [m.bits[0] for m in first],
                                        [m.groups[0] for m in first], [m.out_features for m in first], act,
                                        _dense_rows_now(), gemm_form())
