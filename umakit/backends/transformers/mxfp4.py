"""gpt-oss's MXFP4 experts on the torch engine, kept packed: each expert's projections run on the torch engine's
packed forms (its affine kernel on a CPU) instead of being dequantized to float.

An MXFP4 weight is an E2M1 value (0, 0.5, 1, 1.5, 2, 3, 4 or 6, or its negative) times 2^(e - 127), e one byte per
32 weights. Twice the value is an integer of -12..12, so a weight is exactly (code - 16) * 2^(e - 128) with a 5-bit
code of 4..28: MLX's affine form at 5 bits, groups of 32, a float16 scale and a bias of -16 scales (exact while
2^(e - 128) lies between float16's smallest subnormal and 2^11, so that 16 scales still fit). The experts are
read at 5.5 bits a weight (4.25 in the checkpoint) where dequantized float32 would take 32.

As mapped.py does for MLX's layout, a quantizer registered with transformers swaps each experts module for a
holder of the checkpoint's tensors by their own names (``gate_up_proj_blocks``, ``..._scales``, ``..._bias``)
before the weights load, so transformers' loader fills them and no float copy is ever made; after, each holder
becomes `PackedExperts`, which computes what transformers' ``GptOssExperts`` computes (its own gate function,
its routing) with one packed linear layer per expert and projection. An expert whose exponents fall outside that
range runs dequantized, and the load says how many did. On a CPU the packing is kept under ``$UMAKIT_HOME``
(load/packed.py, as for every quantized checkpoint the torch engine packs): later loads read it instead of
packing each expert again.
"""

from __future__ import annotations

import torch
from torch import nn

from umakit.backends import trim_heap
from umakit.backends.torch.load.packed import PackedCache
from umakit.backends.torch.quant import forms
from umakit.backends.torch.quant.layout import QuantizedLinear
from umakit.backends.torch.quant.mxfp4 import BITS, GROUP, OFFSET, dequantized, exponents, packed_codes, steps
from umakit.backends.transformers import quantizer
from umakit.errors import UnsupportedModelError

METHOD = "umakit-mxfp4"
LOWEST, HIGHEST = -24, 11  # the powers of two a scale may be: float16's smallest subnormal; 16 x 2^11 = 2^15
PROJECTIONS = ("gate_up_proj", "down_proj")


def affine(blocks: torch.Tensor, scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(codes packed as MLX's uint32 (rows, cols * 5 / 32), scales (rows, cols / 32) float16) of one expert's MXFP4
    projection (blocks (rows, cols / 32, 16), scales (rows, cols / 32)), exactly; None where a scale is out of
    float16's range."""
    exponent = exponents(scales)
    if int(exponent.min()) < LOWEST or int(exponent.max()) > HIGHEST:
        return None
    return packed_codes(blocks), steps(scales, torch.float16)


def linear(blocks, scales, bias, dtype: torch.dtype) -> QuantizedLinear | torch.Tensor:
    """One expert's projection as a QuantizedLinear, or as its dequantized float weight (rows, cols) where it
    cannot be held exactly."""
    rows, cols = blocks.shape[0], blocks.shape[1] * GROUP
    exact = affine(blocks, scales)
    if exact is None:
        return dequantized(blocks, scales, dtype)
    codes, s = exact
    q = QuantizedLinear(cols, rows, True, BITS, GROUP, device="meta")
    q.weight = codes
    q.scales, q.biases = s, s * -OFFSET
    q.bias = bias.to(dtype)
    return q


def _shaped(blocks, bias, dtype: torch.dtype) -> QuantizedLinear:
    """One expert's projection with its shapes and bias alone, for a packing stored by an earlier load."""
    rows, cols = blocks.shape[0], blocks.shape[1] * GROUP
    q = QuantizedLinear(cols, rows, True, BITS, GROUP, device="meta")
    q.bias = bias.to(dtype)
    return q


class _Stored(nn.Module):
    """An experts module's tensors as the checkpoint stores them, for transformers' loader to fill by name."""

    def __init__(self, experts: nn.Module):
        super().__init__()
        self.alpha, self.limit = experts.alpha, experts.limit
        e, hidden, inner = experts.num_experts, experts.hidden_size, experts.intermediate_size
        shapes = {"gate_up_proj": (2 * inner, hidden), "down_proj": (hidden, inner)}
        for name, (rows, cols) in shapes.items():
            for part, shape, dtype in (("blocks", (e, rows, cols // GROUP, 16), torch.uint8),
                                       ("scales", (e, rows, cols // GROUP), torch.uint8), ("bias", (e, rows), None)):
                empty = torch.empty(shape, dtype=dtype, device="meta")
                setattr(self, f"{name}_{part}", nn.Parameter(empty, requires_grad=False))


class PackedExperts(nn.Module):
    """transformers' ``GptOssExperts`` computation over packed linear layers: each routed token's projection by
    its experts, gate and up interleaved in one projection, gated as gpt-oss gates (clamped SwiGLU, ``alpha``,
    ``limit``), weighted by the router's scores and summed."""

    def __init__(self, gate_up: list[nn.Module], down: list[nn.Module], alpha: float, limit: float):
        super().__init__()
        self.gate_up, self.down = nn.ModuleList(gate_up), nn.ModuleList(down)
        self.alpha, self.limit = alpha, limit
        self.num_experts = len(gate_up)

    def _gate(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up[..., ::2], gate_up[..., 1::2]
        gate = gate.clamp(min=None, max=self.limit)
        up = up.clamp(min=-self.limit, max=self.limit)
        return (up + 1) * (gate * torch.sigmoid(gate * self.alpha))

    def forward(self, hidden_states: torch.Tensor, router_indices: torch.Tensor, routing_weights: torch.Tensor):
        out = torch.zeros_like(hidden_states)
        hit = torch.nn.functional.one_hot(router_indices, num_classes=self.num_experts).permute(2, 1, 0)
        for e in torch.greater(hit.sum(dim=(-1, -2)), 0).nonzero()[:, 0].tolist():
            top_k_pos, token_idx = torch.where(hit[e])
            state = self.down[e](self._gate(self.gate_up[e](hidden_states[token_idx])))
            out.index_add_(0, token_idx, (state * routing_weights[token_idx, top_k_pos, None]).to(out.dtype))
        return out


class _Dense(nn.Module):
    """A projection held as float (its exponents out of the exact range): x @ weight.T + bias."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor):
        super().__init__()
        self.weight, self.bias = nn.Parameter(weight, requires_grad=False), nn.Parameter(bias, requires_grad=False)

    def forward(self, x):
        return torch.nn.functional.linear(x.to(self.weight.dtype), self.weight, self.bias)


def _store(model: nn.Module, c) -> None:
    """Before the weights load: each experts module (gpt-oss's: two 3-D projections and a gate's ``alpha``) as a
    holder of its checkpoint tensors."""
    for path, module in list(model.named_modules()):
        if all(isinstance(getattr(module, p, None), nn.Parameter) and getattr(module, p).dim() == 3
               for p in PROJECTIONS) and hasattr(module, "alpha"):
            c.stored[path] = _Stored(module)
            quantizer.put(model, path, c.stored[path])


def _execute(model: nn.Module, c) -> None:
    device = torch.device(c.device)
    form = torch.bfloat16 if device.type == "cpu" else c.dtype  # "bfloat16" names the packed CPU forms
    for path, stored in c.stored.items():
        layers = {}
        for name in PROJECTIONS:
            blocks, scales, bias = (getattr(stored, f"{name}_{k}").data for k in ("blocks", "scales", "bias"))
            c.params += blocks.numel() * 2 + bias.numel()  # two weights a block byte
            made = []
            for e in range(blocks.shape[0]):
                where = f"{path}.{name}.{e}"
                kept = c.packed.get(where) if c.packed is not None else {}
                q = _shaped(blocks[e], bias[e], c.dtype) if kept else linear(blocks[e], scales[e], bias[e], c.dtype)
                if isinstance(q, torch.Tensor):
                    c.dense += 1
                    made.append(_Dense(q.to(device), bias[e].to(device, c.dtype)))
                else:
                    made.append(forms.for_execution(q, device, form, kept))
                    if c.packed is not None and hasattr(made[-1], "packing"):
                        c.made[where] = made[-1]
                del q
            layers[name] = made
            for k in ("blocks", "scales", "bias"):  # the checkpoint's copy goes as its packed form comes
                setattr(stored, f"{name}_{k}", None)
        quantizer.put(model, path, PackedExperts(layers["gate_up_proj"], layers["down_proj"], stored.alpha, stored.limit))
        trim_heap()  # the layer's blocks, handed back before the next layer's are packed


def load(transformers, ckpt, device: torch.device, dtype: torch.dtype) -> tuple[nn.Module, int, int]:
    """(the model, its parameter count, how many expert projections run dequantized) of an MXFP4 checkpoint."""
    # stored: the holders by path; dense: projections held as float; params: the experts' weights and biases,
    # counted as they are packed; packed: the packing kept from an earlier CPU load (load/packed.py); made: this
    # load's, to keep
    packed = PackedCache.for_checkpoint(ckpt.path, ckpt.files) if device.type == "cpu" else None
    c = quantizer.register(METHOD, _store, _execute)(device=str(device), dtype=dtype, stored={}, dense=0, params=0,
                                                     packed=packed, made={})
    hf_config = transformers.AutoConfig.from_pretrained(str(ckpt.path))
    for cfg in {id(x): x for x in (hf_config, hf_config.get_text_config())}.values():
        cfg.quantization_config = None  # transformers' own MXFP4 path: ours instead
    model, info = transformers.AutoModelForCausalLM.from_pretrained(
        str(ckpt.path), config=hf_config, quantization_config=c, dtype=dtype, device_map={"": device},
        output_loading_info=True)
    if not c.stored:
        raise UnsupportedModelError(f"{ckpt.path}: MXFP4 is read for gpt-oss's routed experts; transformers' "
                                    f"{type(model).__name__} has none of their kind")
    missing = sorted(info.get("missing_keys", ()))
    if missing:
        raise UnsupportedModelError(f"{ckpt.path}: the checkpoint has no tensor {missing[0]} (of {len(missing)} "
                                    f"transformers' {type(model).__name__} needs and it lacks)")
    unexpected = sorted(k for k in info.get("unexpected_keys", ()) if not k.endswith("inv_freq"))
    if unexpected:
        raise UnsupportedModelError(f"{ckpt.path}: {unexpected[0]} is not a tensor of transformers' "
                                    f"{type(model).__name__} (of {len(unexpected)} such)")
    if packed is not None:
        packed.store(c.made)  # nothing where every layer came from it
    rest = sum(p.numel() for n, p in model.named_parameters() if not any(n.startswith(f"{e}.") for e in c.stored))
    return model.eval(), c.params + rest, c.dense
