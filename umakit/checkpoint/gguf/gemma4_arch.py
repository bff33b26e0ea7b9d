"""gemma4 GGUFs (llama.cpp's ``gemma4`` architecture) back in transformers' and mlx-lm's layout.

llama.cpp's converter keeps gemma4's weights as they are (no row permutation, norms not shifted) and stores per
layer what transformers' config states once: the key/value head count and the feed-forward width of every layer
(lists: the global layers' heads, the double-wide MLPs of the layers that share keys and values), the sliding
pattern, and the global layers' "proportional" RoPE as a ``rope_freqs`` tensor whose unrotated pairs have the
frequency factor 1e30. The 26B-A4B's experts are 3-D tensors, gate and up fused along their rows as transformers
fuses them; they become mlx-lm's ``experts.switch_glu`` stacks, which both engines read.
"""

from __future__ import annotations

import re

import numpy as np

from umakit.errors import UnsupportedModelError
from umakit.checkpoint.gguf.reader import GGUFFile

_BLOCK = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "ffn_norm.weight": "pre_feedforward_layernorm.weight",
    "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
    "layer_output_scale.weight": "layer_scalar",
    "inp_gate.weight": "per_layer_input_gate.weight",
    "proj.weight": "per_layer_projection.weight",
    "post_norm.weight": "post_per_layer_input_norm.weight",
    # the mixture beside the dense MLP (26B-A4B)
    "ffn_gate_inp.weight": "router.proj.weight",
    "ffn_gate_inp.scale": "router.scale",
    "ffn_down_exps.scale": "router.per_expert_scale",
    "pre_ffw_norm_2.weight": "pre_feedforward_layernorm_2.weight",
    "post_ffw_norm_1.weight": "post_feedforward_layernorm_1.weight",
    "post_ffw_norm_2.weight": "post_feedforward_layernorm_2.weight",
    "ffn_gate_up_exps.weight": "experts.gate_up_proj",
    "ffn_down_exps.weight": "experts.down_proj",
}
_GLOBAL = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
    "per_layer_token_embd.weight": "model.embed_tokens_per_layer.weight",
    "per_layer_model_proj.weight": "model.per_layer_model_projection.weight",
    "per_layer_proj_norm.weight": "model.per_layer_projection_norm.weight",
}
_NAME_RE = re.compile(r"^blk\.(\d+)\.(.+)$")
UNROTATED = 1e30  # the frequency factor llama.cpp's converter gives a global head's unrotated pairs
SLIDING, FULL = "sliding_attention", "full_attention"


def gemma4_name(name: str) -> str | None:
    """HF name of a gemma4 GGUF tensor, or None when it has none."""
    if m := _NAME_RE.match(name):
        layer, part = m.groups()
        return f"model.layers.{layer}.{_BLOCK[part]}" if part in _BLOCK else None
    return _GLOBAL.get(name)


def expert_parts(hf: str) -> list[tuple[str, int, int]] | None:
    """For a stacked experts tensor, mlx-lm's modules it becomes, each with its share of the rows (of ``parts``
    equal shares, ``(module, index, parts)``); None for any other tensor."""
    base, _, kind = hf.rpartition(".experts.")
    if kind == "gate_up_proj":
        return [(f"{base}.experts.switch_glu.gate_proj", 0, 2), (f"{base}.experts.switch_glu.up_proj", 1, 2)]
    if kind == "down_proj":
        return [(f"{base}.experts.switch_glu.down_proj", 0, 1)]
    return None


def _per_layer(gf: GGUFFile, key: str, n_layers: int) -> list:
    value = gf.require(key.format(arch=gf.arch))
    return list(value) if isinstance(value, list) else [value] * n_layers


def _by_kind(values: list, types: list[str], what: str, gf: GGUFFile) -> dict[str, int]:
    """The one value each kind of layer has (the shared layers' double-wide MLPs are read apart)."""
    found: dict[str, set] = {}
    for v, t in zip(values, types):
        found.setdefault(t, set()).add(int(v))
    if any(len(v) != 1 for v in found.values()):
        raise UnsupportedModelError(f"{gf.path.name}: {what} differs between layers of one kind")
    return {t: v.pop() for t, v in found.items()}


def _partial_rotary(gf: GGUFFile, head_dim: int, key: str) -> float:
    """The share of each head turned: from the ``rope_freqs`` factors (1 turned, 1e30 not) where the file has
    them, otherwise from the stored rotary width."""
    if key == "{arch}.rope.dimension_count" and "rope_freqs.weight" in gf.tensors:
        factors = np.asarray(gf.tensors["rope_freqs.weight"].data, dtype=np.float64).reshape(-1)
        turned = factors == 1.0
        prefix = np.arange(factors.size) < turned.sum()  # the turned pairs come first
        if factors.size != head_dim // 2 or not np.all(turned == prefix) or not np.all(turned | (factors >= UNROTATED)):
            raise UnsupportedModelError(f"{gf.path.name}: its rope_freqs are not gemma4's proportional RoPE")
        return 2 * int(turned.sum()) / head_dim
    return int(gf.get(key, head_dim)) / head_dim


def gemma4_config(gf: GGUFFile) -> dict:
    """transformers' Gemma4TextConfig fields from llama.cpp's gemma4 metadata."""
    if gf.get("{arch}.rope.scaling.type") not in (None, "none") or gf.get("{arch}.rope.scaling.factor"):
        raise UnsupportedModelError(f"{gf.path.name}: gemma4 with RoPE scaling is not supported")
    n = int(gf.require("{arch}.block_count"))
    pattern = _per_layer(gf, "{arch}.attention.sliding_window_pattern", n)
    types = [SLIDING if s else FULL for s in pattern]
    shared = int(gf.get("{arch}.attention.shared_kv_layers", 0))
    if FULL not in types or not 0 <= shared < n:
        raise UnsupportedModelError(f"{gf.path.name}: a gemma4 layout without global layers, or whose every layer "
                                    "shares another's keys, is not supported")
    owners = types[: n - shared]  # the shared layers' own widths may be doubled
    kv = _by_kind(_per_layer(gf, "{arch}.attention.head_count_kv", n), types, "the key/value head count", gf)
    widths = _per_layer(gf, "{arch}.feed_forward_length", n)
    ffn = _by_kind(widths[: n - shared], owners, "the feed-forward width", gf)
    if len(set(ffn.values())) != 1:
        raise UnsupportedModelError(f"{gf.path.name}: sliding and global layers of different feed-forward widths")
    ffn_width = ffn.popitem()[1]
    double = any(int(w) == 2 * ffn_width for w in widths[n - shared:])
    if any(int(w) != ffn_width * (2 if double else 1) for w in widths[n - shared:]):
        raise UnsupportedModelError(f"{gf.path.name}: the shared layers' feed-forward widths are not supported")
    head_dim = int(gf.get("{arch}.attention.key_length_swa") or gf.require("{arch}.attention.key_length"))
    global_head_dim = int(gf.require("{arch}.attention.key_length"))
    for key in ("{arch}.attention.value_length_swa", "{arch}.attention.value_length"):
        if gf.get(key) not in (None, head_dim if key.endswith("_swa") else global_head_dim):
            raise UnsupportedModelError(f"{gf.path.name}: key and value head sizes differ")
    embed = gf.tensors["token_embd.weight"]
    first_full = types.index(FULL)
    k_eq_v = (first_full < n - shared
              and f"blk.{first_full}.attn_k.weight" in gf.tensors
              and f"blk.{first_full}.attn_v.weight" not in gf.tensors)
    per_layer = int(gf.get("{arch}.embedding_length_per_layer_input", 0) or 0)
    rope = {
        SLIDING: {"rope_type": "default", "rope_theta": float(gf.get("{arch}.rope.freq_base_swa", 10000.0))},
        FULL: {"rope_type": "proportional", "rope_theta": float(gf.get("{arch}.rope.freq_base", 1_000_000.0)),
               "partial_rotary_factor": _partial_rotary(gf, global_head_dim, "{arch}.rope.dimension_count")},
    }
    if (swa_turned := _partial_rotary(gf, head_dim, "{arch}.rope.dimension_count_swa")) != 1.0:
        rope[SLIDING]["partial_rotary_factor"] = swa_turned
    config = {
        "hidden_size": int(gf.require("{arch}.embedding_length")),
        "num_hidden_layers": n,
        "intermediate_size": ffn_width,
        "num_attention_heads": int(gf.require("{arch}.attention.head_count")),
        "num_key_value_heads": kv.get(SLIDING, kv.get(FULL)),
        "head_dim": head_dim,
        # the global layers' heads as transformers v5 saves them
        "per_layer_config": {str(i): {"head_dim": global_head_dim, "num_key_value_heads": kv[FULL]}
                             for i, t in enumerate(types) if t == FULL},
        "attention_k_eq_v": k_eq_v,
        "layer_types": types,
        "sliding_window": int(gf.get("{arch}.attention.sliding_window", 512)),
        "rope_parameters": rope,
        "num_kv_shared_layers": shared,
        "use_double_wide_mlp": double,
        "hidden_size_per_layer_input": per_layer,
        "rms_norm_eps": float(gf.require("{arch}.attention.layer_norm_rms_epsilon")),
        "max_position_embeddings": int(gf.get("{arch}.context_length", 131072)),
        "vocab_size": int(embed.shape[1]),  # ne = (hidden, vocab)
        "tie_word_embeddings": "output.weight" not in gf.tensors,
        "hidden_activation": "gelu_pytorch_tanh",
        "attention_bias": False,
        "final_logit_softcapping": gf.get("{arch}.final_logit_softcapping"),
    }
    if per_layer:
        config["vocab_size_per_layer_input"] = int(gf.tensors["per_layer_token_embd.weight"].shape[1])
    if experts := gf.get("{arch}.expert_count"):
        config.update(enable_moe_block=True, num_experts=int(experts),
                      top_k_experts=int(gf.require("{arch}.expert_used_count")),
                      moe_intermediate_size=int(gf.require("{arch}.expert_feed_forward_length")))
    return config
