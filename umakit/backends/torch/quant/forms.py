"""Which execution form each quantized layer runs as, on each device and dtype.

The checkpoint-layout modules (quant/layout.py) are swapped, once at load, for the
fastest form that stays within float tolerance of dequantize-then-matmul in
the compute dtype: torch's int4 kernels, FBGEMM's float16 kernels on x86 CPUs,
the Triton matvec on CUDA (cuda/matvec.py), umakit's affine kernel on CPU
(cpu/affine_kernel.py: every width, float32 activations), or plain dequantized
weights. What ``--dtype auto`` means on CPU is decided here too (`cpu_auto_dtype`).
"""

from __future__ import annotations

import torch
from torch import nn

from umakit.backends.torch.cpu import affine_kernel as affine
from umakit.errors import CheckpointError
from umakit.backends.torch.cuda.matvec import TritonAffineLinear, triton_kernel
from umakit.backends.torch.model.moe import Experts
from umakit.backends.torch.quant.kernels import Fp16Linear, Int4PackLinear, dense
from umakit.backends.torch.quant.layout import Concat, QuantizedLinear, concat

# torch's CPU capabilities (torch.backends.cpu.get_cpu_capability()) whose int4 kernels beat FBGEMM's float16 ones
INT4_CAPABILITIES = ("AVX512",)


def cuda_linear(m: QuantizedLinear, dtype: torch.dtype) -> nn.Module:
    """The fastest CUDA form of ``m`` within float tolerance of dequantize-then-matmul in ``dtype``.

    4-bit in bfloat16: torch's tinygemm int4 kernels, after an exact repack.
    Otherwise (2, 3, 5, 6 or 8 bits, float16 or float32 compute, odd shapes):
    the Triton kernel (cuda/matvec.py) for decode, dequantize + cuBLAS for
    prefill. Never run on a GPU here: the kernel's logic is tested under
    Triton's interpreter on CPU (tests/engines/test_triton_cpu.py).
    """
    device = m.weight.device
    if dtype == torch.bfloat16 and m.bits == 4 and Int4PackLinear.supports(m, device):
        return Int4PackLinear(m, device)
    if triton_kernel() is not None and m.bits in affine.KERNEL_BITS:
        return TritonAffineLinear(m, dtype)
    return dense(m, dtype)


def for_execution(m: QuantizedLinear, device: torch.device, dtype: torch.dtype, prepacked=None) -> nn.Module:
    """The fastest form of ``m`` that stays within float tolerance of dequantize-then-matmul in ``dtype``;
    ``prepacked``: its packing from an earlier CPU load (load/packed.py), a dict by the form's names."""
    if device.type == "cuda":
        return cuda_linear(m, dtype)
    if dtype == torch.bfloat16 and affine.supports(m) and affine.available():
        return affine.AffineLinear([m], prepacked)
    if dtype == torch.bfloat16 and Int4PackLinear.supports(m, device):
        return Int4PackLinear(m, device, prepacked)
    if dtype == torch.float16 and Fp16Linear.available():
        return Fp16Linear(m)
    # A layer the int4 kernels cannot take (a router of 8 experts, 2/3/5/6 bits) meets the float32
    # activations of a quantized model on CPU (activation_dtype): it runs dequantized in float32.
    return dense(m, activation_dtype(device, dtype, quantized=True))


def activation_dtype(device: torch.device, dtype: torch.dtype, quantized: bool = False) -> torch.dtype:
    """The dtype of activations and the KV cache when linear layers run in ``dtype``.

    x86 CPUs have no fast half-precision arithmetic, so on CPU the half types
    name the matmul's weight form only (FBGEMM's float16 weights; for a
    ``quantized`` checkpoint, torch's int4 kernels, which round only their own
    inputs to bfloat16) and everything else stays float32. Measured on the
    default model: the same decode speed as bfloat16 activations within the
    noise, and its greedy answers kept (bfloat16 throughout turned "The capital
    of France is Paris." into another reply).
    """
    if device.type == "cpu" and dtype == torch.float16 and Fp16Linear.available():
        return torch.float32
    if device.type == "cpu" and dtype == torch.bfloat16 and quantized:
        return torch.float32
    return dtype


def cpu_auto_dtype(quantization: dict | None) -> str:
    """What ``--dtype auto`` runs as on CPU: "bfloat16" (packed kernels) where they beat FBGEMM, else "auto".

    On CPU "bfloat16" names the packed form of a quantized checkpoint: umakit's
    affine kernel for every layer where it is built (cpu/affine_kernel.py; float32
    activations, any width; vectorized with AVX2 or AVX-512), else, with
    AVX-512, torch's int4 kernels for 4- and 8-bit layers (inputs rounded to
    bfloat16). Measured (benchmarks/cpu_engines.py): both decode faster than
    FBGEMM's float16 weights, which read 2 bytes a weight; under AVX2 torch's
    int4 kernels are ~3x slower than FBGEMM, so without the affine kernel
    FBGEMM stays the default there.
    """
    if not quantization:
        return "auto"
    bits = {quantization.get("bits")} | {v.get("bits") for v in quantization.values() if isinstance(v, dict)}
    bits.discard(None)
    if bits <= set(affine.KERNEL_BITS) and affine.available():
        return "bfloat16"
    if bits <= {4, 8} and torch.backends.cpu.get_cpu_capability() in INT4_CAPABILITIES:
        return "bfloat16"
    return "auto"


def convert_model(model: nn.Module, device: torch.device, dtype: torch.dtype, tensors_only=lambda path: False,
                  prepacked=lambda path: {}, made=lambda path, layer, source: None) -> None:
    """Swap every loaded `QuantizedLinear` for its execution form (embeddings stay lookups).

    On CPU in float16, every linear layer then holds float16 weights for
    FBGEMM's float32 kernels (see `Fp16Linear`), except where
    ``tensors_only(path)``: FBGEMM's packed weights are not tensors, so such
    layers (streamed ones, see offload/layers.py) run dequantized in float32 instead.
    ``prepacked(path)`` gives a layer's stored CPU packing (a dict by name, empty if none); ``made(path, layer,
    source)`` hears of each layer with a CPU packing as it is made, and of the module it was made from
    (load/packing_stream.py writes it then, load/pages.py lets go of the source's pages).
    """
    fp16 = device.type == "cpu" and dtype == torch.float16 and Fp16Linear.available()
    if device.type == "cpu" and dtype == torch.bfloat16 and affine.available():
        affine.prefill_gemm()  # a bad UMAKIT_PREFILL_GEMM is refused here, at load
        for path, module in list(model.named_modules()):  # parts of different widths: still one call
            if isinstance(module, Concat) and _affine_parts(list(module.parts)):
                _replace(model, path, affine.AffineLinear(list(module.parts), prepacked(path)), made)
            elif isinstance(module, Experts) and not tensors_only(path):
                pack_experts(module, path, prepacked, made)
    for path, module in list(model.named_modules()):
        if isinstance(module, Concat) and fp16 and all(isinstance(m, (QuantizedLinear, nn.Linear)) for m in module.parts):
            # mixed bits: dequantize each part, then one matmul again
            parts = [dense(m, torch.float32) if isinstance(m, QuantizedLinear) else m for m in module.parts]
            _replace(model, path, concat(parts))
    for path, module in list(model.named_modules()):
        if type(module) is QuantizedLinear:
            plain = tensors_only(path) and fp16
            _replace(model, path, dense(module, torch.float32) if plain
                     else for_execution(module, device, dtype, prepacked(path)), made)
    for path, module in list(model.named_modules()):
        if isinstance(module, Concat) and all(isinstance(m, nn.Linear) for m in module.parts):
            _replace(model, path, concat(list(module.parts)))  # mixed bits, all dequantized: one matmul again
    # The float layers beside packed ones (gpt-oss's attention, routers and head; float32 activations, as
    # `activation_dtype` gives a quantized model) as a float checkpoint's run on a CPU: FBGEMM's float16 weights,
    # half the bytes of float32's
    if device.type == "cpu" and dtype == torch.bfloat16 and Fp16Linear.available():
        fp16 = any(isinstance(m, (affine.AffineLinear, Int4PackLinear)) for m in model.modules())
    if fp16:
        for path, module in list(model.named_modules()):
            if type(module) is nn.Linear and not tensors_only(path):
                _replace(model, path, Fp16Linear(module))
            elif isinstance(module, Experts) and module.bits is None:
                # as Fp16Linear holds them: float16 weights, float32 math (each picked matrix cast on use)
                module.weight = nn.Parameter(module.weight.to(torch.float16), requires_grad=False)


def pack_experts(m: Experts, path: str, prepacked=lambda path: {}, made=lambda path, layer, source: None) -> None:
    """Each expert of a quantized `Experts` as its own layer on umakit's CPU kernel (``m.forms``), the stacked
    tensors dropped: a decode step then reads each picked expert's codes once, where dequantizing them writes and
    reads a float32 copy. Left stacked where the kernel does not take the layer or its scales and biases leave
    float16's range (the planes hold float16, as for every layer on the kernel)."""
    if m.bits is None:
        return
    experts = []
    for e in range(m.n):
        q = QuantizedLinear(m.in_features, m.out_features, m.bias is not None, m.bits, m.group_size, device="meta")
        q.weight, q.scales, q.biases = m.weight[e], m.scales[e], m.biases[e]
        if m.bias is not None:
            q.bias = m.bias[e]
        experts.append(q)
    kept = [prepacked(f"{path}.forms.{e}") for e in range(m.n)]
    reused = all(affine.AffineLinear.reuses([q], k) for q, k in zip(experts, kept))
    unread = m.weight.stride(-1) == 0  # load/openai_experts.py left the codes unread: the kept packing has them
    if unread and not reused:
        raise CheckpointError(f"{path}: the packing kept under $UMAKIT_HOME/packed does not fit this load; "
                              f"delete it to pack again")
    # a packing kept from these files passed the checks when it was made
    if not reused and (not affine.supports(experts[0]) or not all(_in_half_range(t) for t in (m.scales, m.biases))):
        return
    m.forms = nn.ModuleList(affine.AffineLinear([q], k) for q, k in zip(experts, kept))
    for e, (form, q) in enumerate(zip(m.forms, experts)):
        made(f"{path}.forms.{e}", form, q)
    for name in ("weight", "scales", "biases"):
        m._buffers.pop(name)
    if m.bias is not None:
        m._parameters.pop("bias")
        m.bias = None


def _in_half_range(t: torch.Tensor) -> bool:
    """Whether every value of ``t`` is 0 or of a magnitude float16 holds (its subnormals included)."""
    if t.dtype == torch.float16:
        return True
    a = t.abs().float()
    nonzero = a[a > 0]
    smallest = float(nonzero.min()) if nonzero.numel() else 1.0
    return bool(torch.isfinite(a).all()) and float(a.max()) <= 65504.0 and smallest >= 2.0 ** -24


def joiner(device: torch.device, dtype: torch.dtype):
    """How the loader joins q/k/v and gate/up before `convert_model`: on CPU where umakit's affine kernel takes
    them, left as parts (one call all the same, and the checkpoint's codes are never copied to be stacked: with a
    stored packing they are never read at all); elsewhere stacked into one layer (quant/layout.py `concat`)."""
    if device.type == "cpu" and dtype == torch.bfloat16 and affine.available():
        return lambda layers: Concat(layers) if _affine_parts(layers) else concat(layers)
    return concat


def _affine_parts(parts: list) -> bool:
    """Whether umakit's affine kernel takes ``parts`` as one call."""
    return all(type(m) is QuantizedLinear and affine.supports(m) for m in parts) and affine.concatenates(parts)


def _replace(model: nn.Module, path: str, new: nn.Module, made=lambda path, layer, source: None) -> None:
    parent, _, attr = path.rpartition(".")
    old = getattr(model.get_submodule(parent), attr)
    setattr(model.get_submodule(parent), attr, new)
    if hasattr(new, "packing"):
        made(path, new, old)


def describe_execution(model: nn.Module) -> str:
    kinds = {type(m).__name__ for m in model.modules()}
    if "AffineLinear" in kinds:
        gemms = ", bfloat16 GEMMs in long prefills" if affine.prefill_gemm() == "bfloat16" else ""
        gemms += " (on AMX tiles below 256 tokens)" if gemms and affine.gemm_tiles() else ""
        floats = ", its float layers as float16 weights" if "Fp16Linear" in kinds else ""
        return f"runs on umakit's packed kernels{floats}, float32 activations{gemms}"
    if "Fp16Linear" in kinds:
        return "runs as float16 weights, float32 math"
    if "Int4PackLinear" in kinds:
        return "runs on int4 kernels, bfloat16"
    if "TritonAffineLinear" in kinds:
        return "runs on fused dequantize-matmul kernels"
    return "runs dequantized"
