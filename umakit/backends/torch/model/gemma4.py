"""gemma4's text model (``gemma4_text``) on the torch engine's compact code.

What it does beyond gemma3 (model/gemma.py reads it from the config): global layers with heads of another size
and count, whose values may be the keys' projection (``attention_k_eq_v``) and whose RoPE turns only part of
each head (transformers' "proportional"); values normed per head without a weight; q and k normed and the
scores unscaled; plain (w, not 1 + w) RMSNorms; the last ``num_kv_shared_layers`` layers attend to the keys and
values of the last earlier layer of their kind and compute none; per-layer inputs (a second embedding table and
a projection of the hidden state, one slice per layer, gated into each layer's output); a learned scalar on
every layer's output. Names equal the checkpoint's, as in model/llama.py, whose `Transformer` this extends.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch import nn

from umakit.backends.torch import crossover
from umakit.backends.torch.model.llama import ACTIVATIONS, MLP, ModelArgs, RMSNorm, Step, Transformer
from umakit.backends.torch.model.moe import SwitchMLP, mix
from umakit.backends.torch.model.norm import ScalelessNorm
from umakit.backends.torch.model.rope import apply_rope
from umakit.backends.torch.model.step import each_row


class Gemma4Attention(nn.Module):
    def __init__(self, a: ModelArgs, layer: int):
        super().__init__()
        g = a.gemma4
        self.n_heads, self.n_kv, self.head_dim = a.num_attention_heads, g.kv_heads[layer], g.head_dims[layer]
        self.sliding, self.slot, self.shared = a.sliding(layer), g.slots[layer], g.shared[layer]
        q, kv = self.n_heads * self.head_dim, self.n_kv * self.head_dim
        self.q_proj = nn.Linear(a.hidden_size, q, bias=False)
        self.q_norm = RMSNorm(self.head_dim, a.rms_norm_eps)
        self.widths = [q]
        if not self.shared:
            self.k_proj = nn.Linear(a.hidden_size, kv, bias=False)
            self.k_norm = RMSNorm(self.head_dim, a.rms_norm_eps)
            self.v_norm = ScalelessNorm(a.rms_norm_eps)
            self.widths.append(kv)
            if not g.k_eq_v[layer]:
                self.v_proj = nn.Linear(a.hidden_size, kv, bias=False)
                self.widths.append(kv)
        self.o_proj = nn.Linear(q, a.hidden_size, bias=False)
        self.qkv_proj = None  # set by fuse

    def fuse(self, concat) -> None:
        names = ("q_proj", "k_proj", "v_proj")[:len(self.widths)]
        self.qkv_proj = concat([getattr(self, n) for n in names])
        for n in names:
            delattr(self, n)

    def forward(self, x, step: Step, cache, shared: dict):
        B, T, _ = x.shape
        nh, nkv, hd = self.n_heads, self.n_kv, self.head_dim
        cos, sin, mask = step.local if self.sliding else (step.cos, step.sin, step.mask)
        parts = self.qkv_proj(x).split(self.widths, dim=-1)
        q = apply_rope(self.q_norm(parts[0].view(B, T, nh, hd)).transpose(1, 2), cos, sin)
        if self.shared:
            k, v = shared[self.slot]
        else:
            raw = parts[1].view(B, T, nkv, hd)
            v = self.v_norm(parts[2].view(B, T, nkv, hd) if len(parts) > 2 else raw)
            k = apply_rope(self.k_norm(raw).transpose(1, 2), cos, sin)
            k, v = cache.update(self.slot, k, v.transpose(1, 2), step.positions, step.static)  # (B, nkv, S, hd)
            shared[self.slot] = k, v
        rows = each_row(q, k, v, mask, step.positions, self._scores)
        return self.o_proj(rows if rows is not None else self._scores(q, k, v, mask))

    def _scores(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        B, nh, T, hd = q.shape
        if T == 1:  # each kv group's queries folded into the time axis, as model/llama.py does
            out = F.scaled_dot_product_attention(q.reshape(B, self.n_kv, nh // self.n_kv, hd), k, v, attn_mask=mask,
                                                 scale=1.0)
        else:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=1.0, enable_gqa=nh != self.n_kv)
            out = out.transpose(1, 2)
        return out.reshape(B, T, nh * hd)


class Gemma4Router(nn.Module):
    """The experts' router: the hidden state normed (scaled by ``scale`` / sqrt(hidden)), projected, softmaxed;
    the top k renormalized, then scaled per expert."""

    def __init__(self, a: ModelArgs):
        super().__init__()
        self.proj = nn.Linear(a.hidden_size, a.num_experts, bias=False)
        self.scale = nn.Parameter(torch.ones(a.hidden_size))
        self.per_expert_scale = nn.Parameter(torch.ones(a.num_experts))
        self.norm, self.top_k, self.root = ScalelessNorm(a.rms_norm_eps), a.num_experts_per_tok, a.hidden_size ** -0.5

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights (N, k) float32, expert ids (N, k)) for tokens ``x`` (N, H)."""
        probs = F.softmax(self.proj(self.norm(x) * self.scale * self.root).float(), dim=-1)
        weights, idx = probs.topk(self.top_k, dim=-1)
        return weights / weights.sum(dim=-1, keepdim=True) * self.per_expert_scale[idx].float(), idx


class Gemma4Experts(nn.Module):
    """Every expert's GELU-gated MLP, stacked as mlx-lm holds them (``switch_mlp``; its checkpoints say
    ``switch_glu``, transformers' a fused ``gate_up_proj``: load/gemma4_experts.py)."""

    def __init__(self, a: ModelArgs):
        super().__init__()
        self.switch_mlp = SwitchMLP(a.num_experts, a.hidden_size, a.moe_intermediate_size, ACTIVATIONS[a.hidden_act])
        self.n = a.num_experts

    def forward(self, x: torch.Tensor, weights: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        return mix(self.switch_mlp, x, weights, idx, self.n).to(x.dtype)


class Gemma4Block(nn.Module):
    ffn_name = "mlp"

    def __init__(self, a: ModelArgs, layer: int):
        super().__init__()
        g = a.gemma4
        self.self_attn = Gemma4Attention(a, layer)
        self.mlp = MLP(dataclasses.replace(a, intermediate_size=g.mlp_sizes[layer]))
        for name in ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                     "post_feedforward_layernorm"):
            setattr(self, name, RMSNorm(a.hidden_size, a.rms_norm_eps))
        self.register_buffer("layer_scalar", torch.ones(1))
        self.moe = a.num_experts > 0  # experts beside the dense MLP, each output normed, their sum normed again
        if self.moe:
            self.router, self.experts = Gemma4Router(a), Gemma4Experts(a)
            for name in ("post_feedforward_layernorm_1", "pre_feedforward_layernorm_2", "post_feedforward_layernorm_2"):
                setattr(self, name, RMSNorm(a.hidden_size, a.rms_norm_eps))
        if g.per_layer_input:
            self.act = ACTIVATIONS[a.hidden_act]
            self.per_layer_input_gate = nn.Linear(a.hidden_size, g.per_layer_input, bias=False)
            self.per_layer_projection = nn.Linear(g.per_layer_input, a.hidden_size, bias=False)
            self.post_per_layer_input_norm = RMSNorm(a.hidden_size, a.rms_norm_eps)

    def fuse(self, concat) -> None:
        self.self_attn.fuse(concat)
        self.mlp.gate_up_proj = concat([self.mlp.gate_proj, self.mlp.up_proj])
        del self.mlp.gate_proj, self.mlp.up_proj

    def forward(self, x, step: Step, cache, shared: dict, extra: torch.Tensor | None):
        h = x + self.post_attention_layernorm(self.self_attn(self.input_layernorm(x), step, cache, shared))
        ffn = self.mlp(self.pre_feedforward_layernorm(h))
        if self.moe:
            flat = h.reshape(-1, h.shape[-1])
            weights, idx = self.router(flat)
            routed = self.experts(self.pre_feedforward_layernorm_2(flat), weights, idx).view(h.shape)
            ffn = self.post_feedforward_layernorm_1(ffn) + self.post_feedforward_layernorm_2(routed)
        h = h + self.post_feedforward_layernorm(ffn)
        if extra is not None:
            gate = crossover.each_row(self.act, self.per_layer_input_gate(h)) * extra
            h = h + self.post_per_layer_input_norm(self.per_layer_projection(gate))
        return h * self.layer_scalar


class Gemma4Transformer(Transformer):
    block = Gemma4Block
    mixes = False  # its layers attend as one part (Transformer.mixed)

    def __init__(self, args: ModelArgs):
        super().__init__(args)
        g = args.gemma4
        if g.per_layer_input:
            width = args.num_hidden_layers * g.per_layer_input
            self.model.embed_tokens_per_layer = nn.Embedding(g.vocab_per_layer, width,
                                                             _weight=torch.empty(g.vocab_per_layer, width))
            self.model.per_layer_model_projection = nn.Linear(args.hidden_size, width, bias=False)
            self.model.per_layer_projection_norm = RMSNorm(g.per_layer_input, args.rms_norm_eps)
        types = args.layer_types
        self._widths = tuple(args.gemma4.head_dims[types.index(t)] // 2 if t in types else 0
                             for t in ("full_attention", "sliding_attention"))

    def _rope_tables(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.inv_freq[0, :self._widths[0]], self.inv_freq[1, :self._widths[1]]

    def _layer_inputs(self, tokens: torch.Tensor, x: torch.Tensor) -> torch.Tensor | None:
        """(B, T, layers, width): the token's row of the per-layer table (scaled by sqrt(width)) and the
        projected, normed embedding, summed and scaled by 1/sqrt(2), as transformers' Gemma4TextModel does."""
        g, m = self.args.gemma4, self.model
        if not g.per_layer_input:
            return None
        shape = (*tokens.shape, self.args.num_hidden_layers, g.per_layer_input)
        looked = m.embed_tokens_per_layer(tokens)
        looked = looked * float(torch.tensor(g.per_layer_input ** 0.5, dtype=looked.dtype))
        projected = m.per_layer_model_projection(x) * self.args.hidden_size ** -0.5
        projected = m.per_layer_projection_norm(projected.reshape(shape))
        return (projected + looked.reshape(shape).to(projected.dtype)) * 2 ** -0.5

    def _blocks(self, x: torch.Tensor, step: Step, cache, extra: torch.Tensor | None = None) -> torch.Tensor:
        streamer = self.streamer
        shared: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # a slot's keys and values, this pass
        for i, layer in enumerate(self.model.layers):
            if streamer is not None:
                streamer.before(i)
            x = layer(x, step, cache, shared, None if extra is None else extra[:, :, i])
            if streamer is not None:
                streamer.after(i)
        return x


def transformer_for(args: ModelArgs) -> Transformer:
    """The compact model of ``args``' family."""
    return Gemma4Transformer(args) if args.gemma4 is not None else Transformer(args)
