"""mlx-lm's stacked routed experts in a transformers model: the ``mlp.switch_mlp.{gate,up,down}_proj`` stacks
((E, out, in) each, float or in MLX's affine layout) that an imported GGUF's mixture (qwen35moe) and mlx-lm's
conversions write, where transformers' own experts module holds gate and up fused in one 3-D parameter.

Before the weights load, each such experts module's sparse block gets a ``switch_mlp`` of the torch engine's
stacked projections (`moe.SwitchMLP`, on the meta device), which transformers' loader fills by the checkpoint's
names, and the experts module itself becomes `_Routed`: what transformers' module computes (each token's picked
experts, ``act_fn(gate) * up`` then down, summed by the router's weights) on those stacks, through the torch
engine's `moe.mix`. After, on a CPU, each quantized stack becomes one packed layer an expert on umakit's kernel
(`forms.pack_experts`), as the torch engine's own mixtures run. A router of its own class (transformers' top-k
routers hold a bare 2-D ``weight``) whose weight the checkpoint quantizes is filled as codes, scales and biases
and dequantized after: E x H, small.

Only experts modules of transformers' standard form are taken (concatenated gate and up, not transposed, no
biases, no post-expert norm, the default gate); the stacks of any other (gpt-oss's clamped gate, say) are left
unmapped, and the load's check then refuses them by name.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from umakit.backends.torch.model.moe import Experts, SwitchMLP, mix
from umakit.backends.torch.load.loader import quant_spec
from umakit.backends.torch.cpu import affine_kernel as affine
from umakit.backends.torch.quant.forms import pack_experts
from umakit.backends.torch.quant.layout import dequantize
from umakit.backends.transformers import quantizer
from umakit.errors import UnsupportedModelError

ROUTER_SKIP = (nn.Linear, nn.Embedding, SwitchMLP, Experts)  # what else takes a quantized weight
SCALE_DTYPES = {"F16": torch.float16, "BF16": torch.bfloat16, "F32": torch.float32}  # by the checkpoint's name
STACKED = "switch_mlp"  # the sparse block's submodule that holds the stacks, as mlx-lm names it
PROJECTIONS = ("gate_proj", "up_proj", "down_proj")


class _Routed(nn.Module):
    """transformers' experts call (tokens (N, H), their picked experts (N, k), the router's weights (N, k)) on the
    stacks its sparse block holds (not registered here: they load, move and count under the block's name)."""

    def __init__(self, switch: SwitchMLP):
        super().__init__()
        self.stacks = (switch,)

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
        switch = self.stacks[0]
        out = mix(switch, hidden_states, top_k_weights.float(), top_k_index, switch.gate_proj.n)
        return out.to(hidden_states.dtype)


def _standard(module: nn.Module) -> bool:
    """Whether ``module`` is a transformers experts module of the standard form (see the module's docstring)."""
    from transformers.integrations.moe import _default_apply_gate

    fused = getattr(module, "gate_up_proj", None)
    return (isinstance(fused, torch.Tensor) and fused.dim() == 3 and hasattr(module, "act_fn")
            and getattr(module, "is_concatenated", False) and not getattr(module, "is_transposed", True)
            and not getattr(module, "has_bias", True) and not getattr(module, "has_post_expert_norm", True)
            and getattr(type(module), "_apply_gate", None) is _default_apply_gate)


def _torch_act(act):
    """transformers' SiLU and tanh-GELU modules as the torch functions their forwards call, which the experts'
    C++ step recognizes (affine_kernel.native_activation); any other activation as it is."""
    from transformers import activations

    if type(act) is activations.SiLUActivation:
        return F.silu
    inner = getattr(act, "act", None)
    return inner if type(act) is activations.GELUTanh and affine.native_activation(inner) is not None else act


def swap_in(model: nn.Module, block: dict, tensors) -> dict[str, SwitchMLP | dict]:
    """Give each standard experts module whose stacks the checkpoint holds (``tensors``: names to their
    descriptions, ``block``: its quantization) a `SwitchMLP` to be filled by name, and each router whose weight it
    quantizes its codes, scales and biases. Returns them by path (a router's: its bits and group size)."""
    stacks: dict[str, SwitchMLP | dict] = {}
    for path, module in list(model.named_modules()):
        base = f"{path.rpartition('.')[0]}.{STACKED}"
        if not _standard(module) or f"{base}.gate_proj.weight" not in tensors:
            continue
        n, inter2, hidden = module.gate_up_proj.shape
        with torch.device("meta"):
            switch = SwitchMLP(n, hidden, inter2 // 2, _torch_act(module.act_fn))
        for name in PROJECTIONS:
            spec = quant_spec(f"{base}.{name}", block, tensors)
            if spec is not None:
                stored = SCALE_DTYPES.get(tensors[f"{base}.{name}.scales"].dtype, torch.float32)
                setattr(switch, name, getattr(switch, name).quantized(spec["bits"], spec["group_size"], stored))
        quantizer.put(model, base, switch)
        quantizer.put(model, path, _Routed(switch))
        stacks[base] = switch
    for path, module in list(model.named_modules()):  # the routers
        weight = getattr(module, "weight", None)
        spec = quant_spec(path, block, tensors)
        if isinstance(module, ROUTER_SKIP) or not isinstance(weight, nn.Parameter) or weight.dim() != 2 or not spec:
            continue
        (rows, cols), groups = weight.shape, weight.shape[1] // spec["group_size"]
        scales = SCALE_DTYPES.get(tensors[f"{path}.scales"].dtype, torch.float32)
        for name, shape, dtype in (("weight", cols * spec["bits"] // 32, torch.uint32), ("scales", groups, scales),
                                   ("biases", groups, scales)):
            setattr(module, name, nn.Parameter(torch.empty(rows, shape, dtype=dtype, device="meta"),
                                               requires_grad=False))
        stacks[path] = spec
    return stacks


def params(stacks: dict) -> int:
    """The weights of the quantized stacks (held as buffers, not parameters)."""
    return sum(e.n * e.in_features * e.out_features for s in stacks.values() if isinstance(s, SwitchMLP)
               for e in (s.gate_proj, s.up_proj, s.down_proj) if e.bits is not None)


def finish(model: nn.Module, stacks: dict, device: torch.device, dtype: torch.dtype,
           kept=lambda path: {}, made=lambda path, layer, source: None) -> None:
    """Refuse stacks the checkpoint left unfilled; on a CPU, pack each quantized expert for umakit's kernel
    (``kept(path)``: a layer's packing kept by an earlier load; ``made``: as `forms.convert_model` calls it); the
    quantized routers' weights dequantized to ``dtype``."""
    for base, switch in stacks.items():
        if not isinstance(switch, SwitchMLP):
            router = model.get_submodule(base)
            w = dequantize(router.weight, router.scales, router.biases, switch["bits"], switch["group_size"], dtype)
            del router.scales, router.biases
            router.weight = nn.Parameter(w, requires_grad=False)
            continue
        for name in PROJECTIONS:
            e = getattr(switch, name)
            if e.weight.is_meta:
                raise UnsupportedModelError(f"the checkpoint has no tensor for {base}.{name}.weight (the stacked "
                                            "experts of a layer it holds stacks for)")
            if device.type == "cpu" and e.bits is not None and affine.available():
                pack_experts(e, f"{base}.{name}", kept, made)
