"""Mixture-of-experts feed-forward layers (mixtral, qwen3_moe; gpt-oss's in model/openai_moe.py) for the torch model.

A router picks ``top_k`` experts per token; each expert is a gated MLP. The
experts of one projection are held stacked, as mlx-lm names and stores them
(``switch_mlp.gate_proj.weight`` (E, out, in), or in MLX's affine layout
(E, out, in*bits/32) with scales and biases (E, out, in/group): each expert's
matrix is quantized as a linear layer's is). Checkpoints saved by transformers
hold one tensor per expert (``experts.3.w1.weight``): the loader stacks them
(`expert_slot`, `stacked_shapes`).
"""

from __future__ import annotations

import re
from typing import Callable, Mapping, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from umakit.errors import UnsupportedModelError
from umakit.backends.torch.cpu import affine_kernel
from umakit.backends.torch.quant.layout import dequantize

# HF per-expert projection names -> mlx-lm's stacked ones
_PROJECTIONS = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj",
                "gate_proj": "gate_proj", "up_proj": "up_proj", "down_proj": "down_proj"}
_EXPERT = re.compile(r"^(.+)\.experts\.(\d+)\.(w1|w2|w3|gate_proj|up_proj|down_proj)\.(weight|scales|biases)$")
# The module a family's sparse layer is named by in its checkpoints.
FFN_NAMES = {"mixtral": "block_sparse_moe", "qwen3_moe": "mlp"}


def moe_fields(c: dict) -> dict:
    """`ModelArgs` fields of a mixture-of-experts config (empty for a dense family)."""
    kind = c["model_type"]
    if kind not in FFN_NAMES:
        return {}
    n = c.get("num_local_experts") or c.get("num_experts")
    if kind == "qwen3_moe":
        skip = set(c.get("mlp_only_layers") or ())
        step = c.get("decoder_sparse_step") or 1
        layers = tuple(i for i in range(c["num_hidden_layers"]) if i not in skip and (i + 1) % step == 0)
        inter, renorm = c["moe_intermediate_size"], bool(c.get("norm_topk_prob", False))
    else:
        layers, inter, renorm = tuple(range(c["num_hidden_layers"])), c["intermediate_size"], True
    if not n or not c.get("num_experts_per_tok"):
        raise UnsupportedModelError(f"config.json of a {kind} model lacks num_local_experts or num_experts_per_tok")
    return dict(num_experts=n, num_experts_per_tok=c["num_experts_per_tok"], moe_intermediate_size=inter,
                norm_topk_prob=renorm, moe_layers=layers, ffn_name=FFN_NAMES[kind])


def expert_slot(name: str) -> tuple[str, int] | None:
    """("...switch_mlp.gate_proj.weight", 3) for "...experts.3.w1.weight"; None for any other name."""
    m = _EXPERT.match(name)
    if m is None:
        return None
    prefix, e, proj, kind = m.groups()
    return f"{prefix}.switch_mlp.{_PROJECTIONS[proj]}.{kind}", int(e)


def stacked_shapes(shapes: Mapping[str, Sequence[int]]) -> tuple[dict[str, tuple], dict[str, str]]:
    """(name -> shape with per-expert tensors joined as (E, ...), stacked name -> a checkpoint name for messages).

    Experts missing from the checkpoint shorten E, which the shape check then reports.
    """
    out: dict[str, tuple] = {}
    parts: dict[str, dict[int, tuple]] = {}
    source: dict[str, str] = {}
    for name, shape in shapes.items():
        slot = expert_slot(name)
        if slot is None:
            out[name] = tuple(shape)
            continue
        stacked, e = slot
        parts.setdefault(stacked, {})[e] = tuple(shape)
        source.setdefault(stacked, name)
    for stacked, by_expert in parts.items():
        first = by_expert[min(by_expert)]
        same = all(s == first for s in by_expert.values()) and sorted(by_expert) == list(range(len(by_expert)))
        out[stacked] = (len(by_expert) if same else -1, *first)
    return out, source


class Experts(nn.Module):
    """The (E, out, in) matrices of one projection of every expert, float or in MLX's affine layout."""

    def __init__(self, n: int, in_features: int, out_features: int, bits: int | None = None,
                 group_size: int | None = None, dtype=torch.float16, device=None, bias: bool = False):
        super().__init__()
        self.n, self.in_features, self.out_features = n, in_features, out_features
        self.bits, self.group_size = bits, group_size
        self.streamer = None  # an ExpertStreamer (offload/experts.py) when the tensors live in host memory
        self.forms = None  # one layer an expert on a packed CPU kernel, in place of the stacked tensors (forms.py)
        # one bias row per expert (gpt-oss's), float whatever the weights' layout
        self.bias = nn.Parameter(torch.empty(n, out_features, device=device), requires_grad=False) if bias else None
        if bits is None:
            self.weight = nn.Parameter(torch.empty(n, out_features, in_features, device=device), requires_grad=False)
            return
        if in_features % group_size or (in_features * bits) % 32:
            raise ValueError(f"cannot quantize {in_features} inputs with {bits} bits in groups of {group_size}")
        groups = in_features // group_size
        self.register_buffer("weight", torch.empty(n, out_features, in_features * bits // 32, dtype=torch.uint32,
                                                   device=device))
        self.register_buffer("scales", torch.empty(n, out_features, groups, dtype=dtype, device=device))
        self.register_buffer("biases", torch.empty(n, out_features, groups, dtype=dtype, device=device))

    def quantized(self, bits: int, group_size: int, dtype) -> Experts:
        """The same projection in MLX's affine layout (on the meta device, to be filled by the loader)."""
        return Experts(self.n, self.in_features, self.out_features, bits, group_size, dtype, device="meta",
                       bias=self.bias is not None)

    def apply(self, x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        """Row i of ``x`` (M, in) through expert ``idx[i]``: (M, out). Off a CPU, without a host sync (CUDA graphs):
        the picked experts' matrices gathered, one per row; on a CPU, each picked expert once, over its rows, read
        where it lies (gathering copied every picked matrix each step)."""
        if self.forms is not None or (x.device.type == "cpu" and self.streamer is None):
            picked = idx.tolist()
            if len(set(picked)) == len(picked):  # a decode step's: each row its own expert, so no search
                return torch.cat([self.apply_one(x[i:i + 1], e) for i, e in enumerate(picked)])
            out = x.new_empty(x.shape[0], self.out_features)
            for e in torch.unique(idx).tolist():
                rows = (idx == e).nonzero()[:, 0]
                out[rows] = self.apply_one(x[rows], e)
            return out
        w, b = self.picked(idx, x.dtype)
        y = torch.bmm(w, x[:, :, None])[:, :, 0]
        return y if b is None else y + b

    def apply_one(self, x: torch.Tensor, e: int) -> torch.Tensor:
        """Every row of ``x`` (M, in) through expert ``e``."""
        if self.forms is not None:
            return self.forms[e](x).to(x.dtype)
        if self.bits is None and self.streamer is None:  # a view of its matrix, not a copy
            b = None if self.bias is None else self.bias[e].to(x.dtype)
            return F.linear(x, self.weight[e].to(x.dtype), b)
        w, b = self.picked(torch.tensor([e], device=x.device), x.dtype)
        return F.linear(x, w[0], None if b is None else b[0])

    def matrices(self, idx: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """The matrices (len(idx), out, in) of the experts ``idx`` (1-D), in ``dtype``: only those are read."""
        return self.picked(idx, dtype)[0]

    def picked(self, idx: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(the matrices (len(idx), out, in), their biases (len(idx), out) or None) of the experts ``idx``."""
        if self.streamer is not None:
            rows = self.streamer.rows(self, idx)
        else:
            names = ("weight",) if self.bits is None else ("weight", "scales", "biases")
            rows = {k: getattr(self, k)[idx] for k in names + (("bias",) if self.bias is not None else ())}
        bias = rows["bias"].to(dtype) if "bias" in rows else None
        if self.bits is None:
            return rows["weight"].to(dtype), bias
        k, out = idx.shape[0], self.out_features
        w = dequantize(rows["weight"].reshape(k * out, -1), rows["scales"].reshape(k * out, -1),
                       rows["biases"].reshape(k * out, -1), self.bits, self.group_size, dtype)
        return w.view(k, out, self.in_features), bias


class SwitchMLP(nn.Module):
    """Every expert's gated MLP: down(act(gate(x)) * up(x)), each projection stacked over experts."""

    def __init__(self, n: int, hidden: int, inter: int, act: Callable):
        super().__init__()
        self.gate_proj = Experts(n, hidden, inter)
        self.up_proj = Experts(n, hidden, inter)
        self.down_proj = Experts(n, inter, hidden)
        self.act = act
        self.native_act = affine_kernel.native_activation(act)  # None: not one the C++ step computes

    def gathered(self, x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        """Row i of ``x`` (M, H) through expert ``idx[i]``: (M, H). Reads only the experts picked. Where each
        expert is a packed CPU layer, one C++ call does what the Python below does, to the bit."""
        forms = (self.gate_proj.forms, self.up_proj.forms, self.down_proj.forms)
        if self.native_act is not None and all(f is not None for f in forms):
            y = affine_kernel.expert_rows(forms, self.native_act, x, idx)
            if y is not None:
                return y
        return self.down_proj.apply(self.act(self.gate_proj.apply(x, idx)) * self.up_proj.apply(x, idx), idx)

    def one(self, x: torch.Tensor, e: int) -> torch.Tensor:
        """Every row of ``x`` (M, H) through expert ``e``."""
        return self.down_proj.apply_one(self.act(self.gate_proj.apply_one(x, e)) * self.up_proj.apply_one(x, e), e)


class SparseMoE(nn.Module):
    """Router and experts of one layer; the router's weights renormalised over the picked experts when
    ``renormalize`` (mixtral always; qwen3_moe with norm_topk_prob), as transformers does."""

    def __init__(self, hidden: int, inter: int, n: int, top_k: int, renormalize: bool, act: Callable):
        super().__init__()
        self.gate = nn.Linear(hidden, n, bias=False)
        self.switch_mlp = SwitchMLP(n, hidden, inter, act)
        self.n, self.top_k, self.renormalize = n, top_k, renormalize

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights (N, k) float32, expert ids (N, k)) for tokens ``x`` (N, H)."""
        probs = F.softmax(self.gate(x).float(), dim=-1)  # (N, E)
        weights, idx = probs.topk(self.top_k, dim=-1)
        if self.renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights, idx

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])  # (N, H)
        weights, idx = self.route(flat)
        return mix(self.switch_mlp, flat, weights, idx, self.n).to(x.dtype).view(x.shape)


def mix(switch_mlp: SwitchMLP, flat: torch.Tensor, weights: torch.Tensor, idx: torch.Tensor, n: int) -> torch.Tensor:
    """Tokens ``flat`` (N, H) through their picked experts ``idx`` (N, k), summed by ``weights`` (N, k): (N, H)
    float32. A decode step gathers the picked experts' matrices (graph-capturable: no host sync); a prompt runs
    each expert once, over the tokens routed to it. Either way a token's k outputs are summed in its picks' order,
    so a row's sum has the same bits in a batch as alone."""
    N, k = idx.shape
    if N * k <= n:
        y = switch_mlp.gathered(flat.repeat_interleave(k, dim=0), idx.reshape(-1)).view(N, k, -1)  # (N, k, H)
    else:
        y = torch.empty(N, k, flat.shape[-1], dtype=torch.float32, device=flat.device)
        for e in torch.unique(idx).tolist():
            token, slot = torch.where(idx == e)
            y[token, slot] = switch_mlp.one(flat[token], e).float()
    return (y.float() * weights[..., None]).sum(dim=1)
