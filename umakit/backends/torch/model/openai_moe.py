"""What gpt-oss does differently from the Llama family, for the torch model.

Sliding-window layers alternate with global ones (``layer_types``), all under one RoPE (yarn, its blend's range
unrounded where ``truncate`` is false: model/rope.py); q, k, v and o carry biases; each head's softmax has one more
logit, a learned "sink" that takes a share of the attention and gives back nothing (`sink_attention`); every layer's
feed-forward is a mixture of experts whose router has a bias and softmaxes only its top-k logits, and whose experts
(gate and up interleaved in one projection, rows 2i and 2i + 1, each projection with a bias) gate as gpt-oss does:
(clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g), g = min(gate, limit). transformers' ``GptOssForCausalLM``
is the oracle (tests/engines/test_torch_gpt_oss.py). The experts are held stacked as the other mixtures' are
(model/moe.py), so offload, CUDA graphs and quantized layouts treat them alike; load/openai_experts.py maps OpenAI's and
transformers' checkpoint layouts to them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from umakit.checkpoint.config import FULL, SLIDING
from umakit.errors import UnsupportedModelError
from umakit.backends.torch.model.moe import Experts, SparseMoE


def gpt_oss_fields(c: dict) -> dict:
    """`ModelArgs` fields of a gpt-oss config (empty for another family)."""
    if c["model_type"] != "gpt_oss":
        return {}
    n = c["num_hidden_layers"]
    types = c.get("layer_types") or [SLIDING if i % 2 == 0 else FULL for i in range(n)]  # transformers' default
    if len(types) != n or set(types) - {FULL, SLIDING}:
        raise UnsupportedModelError(f"layer_types must name {n} layers, each {FULL!r} or {SLIDING!r}")
    experts, top_k = c.get("num_local_experts"), c.get("num_experts_per_tok")
    if not experts or not top_k:
        raise UnsupportedModelError("config.json of a gpt_oss model lacks num_local_experts or num_experts_per_tok")
    return dict(layer_types=tuple(types), attn_sinks=True, num_experts=experts, num_experts_per_tok=top_k,
                moe_intermediate_size=c["intermediate_size"], moe_layers=tuple(range(n)), ffn_name="mlp",
                swiglu=(float(c.get("swiglu_alpha", 1.702)), float(c.get("swiglu_limit", 7.0))))


def sink_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float,
                   sinks: torch.Tensor) -> torch.Tensor:
    """Attention (B, T, nh, hd) of ``q`` (B, nh, T, hd) over ``k``, ``v`` (B, nkv, S, hd), each head's softmax
    taken with its sink logit beside the keys' (float32). ``mask``: None, (T, S) or one per row (B, 1, 1, S),
    True where a key is seen."""
    B, nh, T, hd = q.shape
    nkv, S = k.shape[1], k.shape[2]
    g = nh // nkv
    scores = (q.reshape(B, nkv, g * T, hd) @ k.transpose(-1, -2)).float().mul_(scale).view(B, nkv, g, T, S)
    if mask is not None:
        mask = mask[None, None, None] if mask.dim() == 2 else mask[:, :, None]  # (1|B, 1, 1, T|1, S)
        scores = scores.masked_fill(~mask, float("-inf"))
    sink = sinks.float().view(1, nkv, g, 1, 1).expand(B, nkv, g, T, 1)
    probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :S]
    out = probs.to(v.dtype).view(B, nkv, g * T, S) @ v  # (B, nkv, g*T, hd)
    return out.view(B, nh, T, hd).transpose(1, 2)


class GptOssExperts(nn.Module):
    """Every expert's MLP: ``gate_up_proj`` (gate and up interleaved) and ``down_proj``, stacked, with biases."""

    def __init__(self, n: int, hidden: int, inter: int, alpha: float, limit: float):
        super().__init__()
        self.gate_up_proj = Experts(n, hidden, 2 * inter, bias=True)
        self.down_proj = Experts(n, inter, hidden, bias=True)
        self.alpha, self.limit = alpha, limit

    def act(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up[..., ::2].clamp(max=self.limit), gate_up[..., 1::2].clamp(-self.limit, self.limit)
        return (up + 1) * (gate * torch.sigmoid(gate * self.alpha))

    def gathered(self, x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        """Row i of ``x`` (M, H) through expert ``idx[i]``: (M, H)."""
        return self.down_proj.apply(self.act(self.gate_up_proj.apply(x, idx)), idx)

    def one(self, x: torch.Tensor, e: int) -> torch.Tensor:
        """Every row of ``x`` (M, H) through expert ``e``."""
        return self.down_proj.apply_one(self.act(self.gate_up_proj.apply_one(x, e)), e)


class GptOssMoE(SparseMoE):
    """gpt-oss's router (a bias; softmax over the top-k logits only) and experts (`GptOssExperts`)."""

    def __init__(self, a):
        nn.Module.__init__(self)
        self.router = nn.Linear(a.hidden_size, a.num_experts, bias=True)
        self.switch_mlp = GptOssExperts(a.num_experts, a.hidden_size, a.moe_intermediate_size, *a.swiglu)
        self.n, self.top_k = a.num_experts, a.num_experts_per_tok

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        top, idx = self.router(x).topk(self.top_k, dim=-1)
        return F.softmax(top.float(), dim=-1), idx
