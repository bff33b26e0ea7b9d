"""What gemma3 (``gemma3_text``) does differently from the Llama family, for the torch model; and gemma4's
configuration (`gemma4_fields`; its layers are model/gemma4.py's).

Sliding-window layers alternate with global ones (``layer_types``), each kind
with its own RoPE base (``rope_local_base_freq`` for sliding layers, unscaled;
``rope_theta`` and the rope scaling for global ones); every norm is RMSNorm
with a (1 + w) weight, four per layer (around attention and around the MLP)
plus q/k norms; embeddings are scaled by sqrt(hidden); attention scores by
``query_pre_attn_scalar`` ** -0.5; the MLP is GELU-tanh; the logits may be
soft-capped. The layer code itself lives in model/llama.py, switched by these fields.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from umakit.checkpoint.config import FULL, SLIDING
from umakit.errors import UnsupportedModelError


def gemma_fields(c: dict) -> dict:
    """`ModelArgs` fields of a gemma3 config (empty for another family)."""
    if c["model_type"] != "gemma3_text":
        return {}
    if c.get("attn_logit_softcapping"):
        raise UnsupportedModelError("gemma3 with attn_logit_softcapping is not supported by the torch backend")
    n = c["num_hidden_layers"]
    types = c.get("layer_types")
    if types is None:  # config_compat.normalize writes them; a hand-made config may give the pattern only
        p = c.get("sliding_window_pattern", 6)
        types = [FULL if (i + 1) % p == 0 else SLIDING for i in range(n)]
    if len(types) != n or set(types) - {FULL, SLIDING}:
        raise UnsupportedModelError(f"layer_types must name {n} layers, each {FULL!r} or {SLIDING!r}")
    head_dim = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
    return dict(
        layer_types=tuple(types),
        rope_local_theta=float(c.get("rope_local_base_freq", 10000.0)),
        attn_scale=float(c.get("query_pre_attn_scalar") or head_dim) ** -0.5,
        embed_scale=float(c["hidden_size"]) ** 0.5,
        final_logit_softcapping=c.get("final_logit_softcapping") or None,
        gemma_norms=True,
        qk_norm=True,
        tie_word_embeddings=bool(c.get("tie_word_embeddings", True)),
    )


class GemmaRMSNorm(nn.Module):
    """RMSNorm with weight (1 + w), the product taken in float32 (transformers' Gemma3RMSNorm)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        out = x32 * torch.rsqrt(x32.square().mean(-1, keepdim=True) + self.eps)
        return (out * (1.0 + self.weight.float())).to(x.dtype)


def softcap(logits: torch.Tensor, cap: float | None) -> torch.Tensor:
    """cap * tanh(logits / cap), or the logits unchanged without a cap."""
    return logits if not cap else torch.tanh(logits / cap) * cap


# -- gemma4 (the layers themselves: model/gemma4.py) ---------------------------------------------------------------
GEMMA4 = "gemma4_text"


@dataclass(frozen=True)
class Gemma4Layers:
    """What differs from one gemma4 layer to the next, read from its config.

    Global layers have heads of their own size and count (``per_layer_config``) and may take their values from
    the keys' projection (``attention_k_eq_v``); the last ``num_kv_shared_layers`` layers compute no keys or
    values but attend to those of the last earlier layer of their kind, whose cache slot they name here, and may
    have an MLP twice as wide. Every layer may add a per-layer input (``hidden_size_per_layer_input``).
    """

    head_dims: tuple[int, ...]
    kv_heads: tuple[int, ...]
    slots: tuple[int, ...]  # the cache slot a layer writes (its own) or reads (a shared layer: its source's)
    shared: tuple[bool, ...]  # computes no keys or values of its own
    k_eq_v: tuple[bool, ...]  # values are the keys' projection (before the keys' norm and RoPE)
    mlp_sizes: tuple[int, ...]
    per_layer_input: int  # 0: none
    vocab_per_layer: int
    rope: dict  # layer type -> (theta, rotated fraction, factor) of transformers' "default"/"proportional" RoPE

    @property
    def cache_shapes(self) -> list[tuple[int, int]]:
        """(kv heads, head size) of each cache slot, the layers that write one in order."""
        return [(self.kv_heads[i], self.head_dims[i]) for i in range(len(self.slots)) if not self.shared[i]]


def gemma4_fields(c: dict) -> dict:
    """`ModelArgs` fields of a gemma4 text config (empty for another family); what the torch engine does not run
    (bidirectional attention) is refused, and "auto" moves to the next engine."""
    if c["model_type"] != GEMMA4:
        return {}
    if c.get("use_bidirectional_attention") == "all":
        raise UnsupportedModelError("gemma4 with use_bidirectional_attention 'all' is not supported by the torch "
                                    "backend")
    n, hd, nkv = c["num_hidden_layers"], c["head_dim"], c.get("num_key_value_heads") or c["num_attention_heads"]
    types = list(c.get("layer_types") or [FULL if (i + 1) % 6 == 0 else SLIDING for i in range(n)])
    if len(types) != n or set(types) - {FULL, SLIDING}:
        raise UnsupportedModelError(f"layer_types must name {n} layers, each {FULL!r} or {SLIDING!r}")
    overrides = c.get("per_layer_config")
    if overrides is None:  # transformers' own derivation, where a config names the global size only
        glob = {"head_dim": c.get("global_head_dim") or 512}
        if c.get("num_global_key_value_heads") and c.get("attention_k_eq_v", True):
            glob["num_key_value_heads"] = c["num_global_key_value_heads"]
        overrides = {str(i): glob for i, t in enumerate(types) if t == FULL}
    per = [overrides.get(str(i)) or overrides.get(i) or {} for i in range(n)]
    unknown = {k for o in per for k in o} - {"head_dim", "num_key_value_heads"}
    if unknown:
        raise UnsupportedModelError(f"gemma4's per_layer_config sets {', '.join(sorted(unknown))}, which the torch "
                                    "engine does not run")
    head_dims = tuple(int(o.get("head_dim", hd)) for o in per)
    kv_heads = tuple(int(o.get("num_key_value_heads", nkv)) for o in per)
    first_shared = n - int(c.get("num_kv_shared_layers") or 0)
    slots, shared = [], []
    for i, t in enumerate(types):
        if i < first_shared:
            slots.append(i)
            shared.append(False)
            continue
        sources = [j for j in range(first_shared) if types[j] == t]
        if not sources:
            raise UnsupportedModelError(f"gemma4 layer {i} shares the keys of no earlier {t} layer")
        slots.append(slots[sources[-1]])
        shared.append(True)
    rope = {}
    for t in set(types):
        p = (c.get("rope_parameters") or {}).get(t) or {}
        kind = p.get("rope_type", "default")
        if kind not in ("default", "proportional"):
            raise UnsupportedModelError(f"gemma4's {t} layers take {kind!r} RoPE, which the torch engine lacks")
        dims = {head_dims[i] for i in range(n) if types[i] == t}
        if len(dims) > 1:
            raise UnsupportedModelError(f"gemma4's {t} layers have heads of several sizes: {sorted(dims)}")
        rope[t] = (float(p.get("rope_theta", 10000.0)), float(p.get("partial_rotary_factor", 1.0))
                   if kind == "proportional" else 1.0, float(p.get("factor", 1.0)) if kind == "proportional"
                   else 1.0)
    wide = 2 if c.get("use_double_wide_mlp") else 1
    layers = Gemma4Layers(
        head_dims=head_dims, kv_heads=kv_heads, slots=tuple(slots), shared=tuple(shared),
        k_eq_v=tuple(bool(c.get("attention_k_eq_v")) and t == FULL for t in types),
        mlp_sizes=tuple(c["intermediate_size"] * (wide if s else 1) for s in shared),
        per_layer_input=int(c.get("hidden_size_per_layer_input") or 0),
        vocab_per_layer=int(c.get("vocab_size_per_layer_input") or c["vocab_size"]), rope=rope)
    moe = {}
    if c.get("enable_moe_block"):  # experts beside every layer's dense MLP (gemma4's 26B-A4B)
        if not (c.get("num_experts") and c.get("top_k_experts") and c.get("moe_intermediate_size")):
            raise UnsupportedModelError("gemma4's config enables its experts without num_experts, top_k_experts "
                                        "and moe_intermediate_size")
        moe = dict(num_experts=c["num_experts"], num_experts_per_tok=c["top_k_experts"],
                   moe_intermediate_size=c["moe_intermediate_size"], moe_layers=tuple(range(n)))
    return dict(
        **moe,
        layer_types=tuple(types),
        sliding_window=c.get("sliding_window"),
        attn_scale=1.0,  # q and k are normed per head
        embed_scale=float(c["hidden_size"]) ** 0.5,
        final_logit_softcapping=c.get("final_logit_softcapping") or None,
        qk_norm=True,
        rope_scaling=None,  # per layer type, in ``gemma4.rope``
        rope_local_theta=rope.get(SLIDING, (None,))[0],
        tie_word_embeddings=bool(c.get("tie_word_embeddings", True)),
        gemma4=layers,
    )
