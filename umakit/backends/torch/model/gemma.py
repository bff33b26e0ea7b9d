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

import torch

from umakit.checkpoint.config import FULL, SLIDING
from umakit.core.gemma4_layers import GEMMA4, gemma4_layers
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


def softcap(logits: torch.Tensor, cap: float | None) -> torch.Tensor:
    """cap * tanh(logits / cap), or the logits unchanged without a cap."""
    return logits if not cap else torch.tanh(logits / cap) * cap


# -- gemma4 (its per-layer shapes: core/gemma4_layers.py; its layers: model/gemma4.py) ------------------------
def gemma4_fields(c: dict) -> dict:
    """`ModelArgs` fields of a gemma4 text config (empty for another family); what the torch engine does not run
    is refused, and "auto" moves to the next engine."""
    if c["model_type"] != GEMMA4:
        return {}
    layers = gemma4_layers(c)
    n, rope = c["num_hidden_layers"], layers.rope
    moe = {}
    if c.get("enable_moe_block"):  # experts beside every layer's dense MLP (gemma4's 26B-A4B)
        if not (c.get("num_experts") and c.get("top_k_experts") and c.get("moe_intermediate_size")):
            raise UnsupportedModelError("gemma4's config enables its experts without num_experts, top_k_experts "
                                        "and moe_intermediate_size")
        moe = dict(num_experts=c["num_experts"], num_experts_per_tok=c["top_k_experts"],
                   moe_intermediate_size=c["moe_intermediate_size"], moe_layers=tuple(range(n)))
    return dict(
        **moe,
        layer_types=layers.types,
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
