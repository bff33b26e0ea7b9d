"""Qwen3.5 and Qwen3-Next GGUFs (llama.cpp's ``qwen35``: the dense hybrid models, gated delta-net layers beside
gated full attention; ``qwen35moe``: their mixtures; ``qwen3next``) back in a layout the engines read:
transformers' for the dense models (mlx-lm and the transformers engine read it), with the mixtures' experts as
mlx-lm's ``switch_mlp`` stacks (MLX reads those), and Qwen3-Next wholly in mlx-lm's own layout (`fix_next`).

llama.cpp's converter (conversion/qwen.py, `Qwen3_5TextModel`) changes what it stores, and each change is undone
here exactly: the value heads of the linear-attention layers, grouped by key head in the checkpoint, are tiled
for ggml's broadcast (rows of ``in_proj_qkv``'s V part, ``in_proj_z``, ``in_proj_a``/``b``, the conv channels,
``A_log``, ``dt_bias``; columns of ``out_proj``), a pure reordering that keeps quantization groups whole (rows
always; columns in whole heads); the RMSNorm weights that act as 1 + w are stored as 1 + w (the gated norm of the
linear layers is not); ``A_log`` is stored as -exp(A_log); the conv kernel loses its middle axis. For Qwen3-Next
it splits ``in_proj_qkvz`` (each key head's q, k, v and z together) into ``attn_qkv`` and ``attn_gate``, which
the import joins back (`ArchSpec.joins`, then `reorder`), and tiles no value heads.
"""

from __future__ import annotations

import re

import numpy as np

from umakit.errors import UnsupportedModelError
from umakit.checkpoint.gguf.reader import GGUFFile

_BLOCK = {
    "attn_norm.weight": "input_layernorm.weight",
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",  # the queries and their output gate, per head
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
    "attn_qkv.weight": "linear_attn.in_proj_qkv.weight",
    "attn_gate.weight": "linear_attn.in_proj_z.weight",
    "ssm_beta.weight": "linear_attn.in_proj_b.weight",
    "ssm_alpha.weight": "linear_attn.in_proj_a.weight",
    "ssm_a": "linear_attn.A_log",
    "ssm_dt.bias": "linear_attn.dt_bias",
    "ssm_conv1d.weight": "linear_attn.conv1d.weight",
    "ssm_norm.weight": "linear_attn.norm.weight",
    "ssm_out.weight": "linear_attn.out_proj.weight",
}
_MOE = {  # qwen35moe: every layer's MLP a mixture with a shared expert
    "ffn_gate_inp.weight": "mlp.gate.weight",
    "ffn_gate_exps.weight": "mlp.experts.gate_proj",
    "ffn_up_exps.weight": "mlp.experts.up_proj",
    "ffn_down_exps.weight": "mlp.experts.down_proj",
    "ffn_gate_shexp.weight": "mlp.shared_expert.gate_proj.weight",
    "ffn_up_shexp.weight": "mlp.shared_expert.up_proj.weight",
    "ffn_down_shexp.weight": "mlp.shared_expert.down_proj.weight",
    "ffn_gate_inp_shexp.weight": "mlp.shared_expert_gate.weight",
}
_GLOBAL = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
           "output.weight": "lm_head.weight"}
_NAME_RE = re.compile(r"^blk\.(\d+)\.(.+)$")


def qwen35_name(name: str) -> str | None:
    """HF name of a qwen35 or qwen35moe GGUF tensor, or None when it has none."""
    if m := _NAME_RE.match(name):
        layer, part = m.groups()
        known = _BLOCK.get(part) or _MOE.get(part)
        return f"model.layers.{layer}.{known}" if known else None
    return _GLOBAL.get(name)


def qwen3next_name(name: str) -> str | None:
    """HF name of a qwen3next GGUF tensor: qwen35moe's, but for the projections llama.cpp split out of one
    (``in_proj_qkvz``: ``attn_qkv`` and ``attn_gate``) and kept whole (``in_proj_ba``)."""
    if m := _NAME_RE.match(name):
        layer, part = m.groups()
        if part in ("attn_qkv.weight", "attn_gate.weight"):
            return f"model.layers.{layer}.linear_attn.in_proj_qkvz.weight"
        if part == "ssm_ba.weight":
            return f"model.layers.{layer}.linear_attn.in_proj_ba.weight"
    return qwen35_name(name)


def qwen3next_config(gf: GGUFFile) -> dict:
    """transformers' Qwen3NextConfig fields (qwen35moe's; every layer a mixture)."""
    config = qwen35moe_config(gf)
    rope = config["rope_parameters"]
    # mlx-lm's qwen3_next reads these at the top level, as Qwen3-Next's own config.json states them
    return {**config, "model_type": "qwen3_next", "decoder_sparse_step": 1, "mlp_only_layers": [],
            "norm_topk_prob": True, "intermediate_size": int(gf.get("{arch}.feed_forward_length", 0)),
            "partial_rotary_factor": rope["partial_rotary_factor"], "rope_theta": rope["rope_theta"]}


def expert_parts(hf: str) -> list[tuple[str, int, int]] | None:
    """A stacked experts tensor's module in mlx-lm's layout (``mlp.switch_mlp``), which MLX reads."""
    base, _, kind = hf.rpartition(".mlp.experts.")
    return [(f"{base}.mlp.switch_mlp.{kind}", 0, 1)] if kind in ("gate_proj", "up_proj", "down_proj") else None


def qwen35moe_config(gf: GGUFFile) -> dict:
    """transformers' Qwen3_5MoeTextConfig fields: qwen35's, and the experts'."""
    config = qwen35_config(gf)
    del config["intermediate_size"]  # no dense MLP
    config.update(num_experts=int(gf.require("{arch}.expert_count")),
                  num_experts_per_tok=int(gf.require("{arch}.expert_used_count")),
                  moe_intermediate_size=int(gf.require("{arch}.expert_feed_forward_length")),
                  shared_expert_intermediate_size=int(gf.require("{arch}.expert_shared_feed_forward_length")))
    return config


def qwen35_config(gf: GGUFFile) -> dict:
    """transformers' Qwen3_5TextConfig fields from llama.cpp's qwen35 metadata."""
    if gf.get("{arch}.rope.scaling.type") not in (None, "none") or gf.get("{arch}.rope.scaling.factor"):
        raise UnsupportedModelError(f"{gf.path.name}: qwen35 with RoPE scaling is not supported")
    if gf.get("{arch}.nextn_predict_layers"):
        raise UnsupportedModelError(f"{gf.path.name}: a qwen35 file with multi-token-prediction layers is not "
                                    "supported (convert it with --no-mtp)")
    n = int(gf.require("{arch}.block_count"))
    recurrent = gf.require("{arch}.attention.recurrent_layers")
    head_dim = int(gf.require("{arch}.attention.key_length"))
    if gf.get("{arch}.attention.value_length", head_dim) != head_dim:
        raise UnsupportedModelError(f"{gf.path.name}: key and value head sizes differ")
    for key in ("{arch}.attention.head_count", "{arch}.attention.head_count_kv"):
        if isinstance(gf.get(key), list):
            raise UnsupportedModelError(f"{gf.path.name}: per-layer {key.format(arch=gf.arch)} is not supported")
    if all(recurrent) or not any(recurrent):
        raise UnsupportedModelError(f"{gf.path.name}: a qwen35 model without both kinds of layer is not supported")
    # the layers' kinds, which mlx-lm reads from the interval alone (the file's own interval key can be stale)
    interval = list(recurrent).index(False) + 1
    if list(recurrent) != [(i + 1) % interval != 0 for i in range(n)]:
        raise UnsupportedModelError(f"{gf.path.name}: full-attention layers at uneven intervals are not supported")
    value_heads = int(gf.require("{arch}.ssm.time_step_rank"))
    embed = gf.tensors["token_embd.weight"]
    return {
        "hidden_size": int(gf.require("{arch}.embedding_length")),
        "num_hidden_layers": n,
        "intermediate_size": int(gf.get("{arch}.feed_forward_length", 0)),
        "num_attention_heads": int(gf.require("{arch}.attention.head_count")),
        "num_key_value_heads": int(gf.require("{arch}.attention.head_count_kv")),
        "head_dim": head_dim,
        "layer_types": ["linear_attention" if r else "full_attention" for r in recurrent],
        "full_attention_interval": interval,
        "linear_conv_kernel_dim": int(gf.require("{arch}.ssm.conv_kernel")),
        "linear_key_head_dim": int(gf.require("{arch}.ssm.state_size")),
        "linear_num_key_heads": int(gf.require("{arch}.ssm.group_count")),
        "linear_num_value_heads": value_heads,
        "linear_value_head_dim": int(gf.require("{arch}.ssm.inner_size")) // value_heads,
        "rope_parameters": {
            "rope_type": "default", "rope_theta": float(gf.get("{arch}.rope.freq_base", 10_000_000.0)),
            "partial_rotary_factor": int(gf.require("{arch}.rope.dimension_count")) / head_dim,
        },
        "rms_norm_eps": float(gf.require("{arch}.attention.layer_norm_rms_epsilon")),
        "max_position_embeddings": int(gf.get("{arch}.context_length", 262144)),
        "vocab_size": int(embed.shape[1]),  # ne = (hidden, vocab)
        "tie_word_embeddings": "output.weight" not in gf.tensors,
        "hidden_act": "silu",
        "attention_bias": False,
    }


def _interleaved(groups: int, widths: list[int]) -> np.ndarray:
    """The order that takes parts stored one after another (all groups' first part, then all their second...)
    to each group's parts together, as the checkpoint fuses them."""
    starts = np.cumsum([0] + [groups * w for w in widths])[:-1]
    return np.concatenate([np.arange(s + g * w, s + (g + 1) * w) for g in range(groups)
                           for s, w in zip(starts, widths)])


def _untiled(count: int, key_heads: int, per_key: int, width: int) -> np.ndarray:
    """The order that gives tiled value heads (v, k) back in the checkpoint's grouped order (k, v)."""
    return np.arange(count).reshape(per_key, key_heads, width).transpose(1, 0, 2).reshape(-1)


def reorder(hf: str, rows: int, cols: int, config: dict) -> tuple[np.ndarray | None, np.ndarray | None]:
    """(rows, columns) orders that undo llama.cpp's tiling of the value heads (see the module's text)."""
    k_heads, v_heads = config["linear_num_key_heads"], config["linear_num_value_heads"]
    per, hk, hv = v_heads // k_heads, config["linear_key_head_dim"], config["linear_value_head_dim"]
    if hf.endswith(".in_proj_qkvz.weight"):  # qwen3next: q, k, v and z of each key head together, not tiled
        return _interleaved(k_heads, [hk, hk, per * hv, per * hv]), None
    if ".linear_attn." not in hf or k_heads == v_heads or config.get("model_type") == "qwen3_next":
        return None, None
    qk = 2 * k_heads * hk
    if hf.endswith((".in_proj_qkv.weight", ".conv1d.weight")):
        return np.concatenate([np.arange(qk), qk + _untiled(rows - qk, k_heads, per, hv)]), None
    if hf.endswith(".in_proj_z.weight"):
        return _untiled(rows, k_heads, per, hv), None
    if hf.endswith((".in_proj_a.weight", ".in_proj_b.weight", ".A_log", ".dt_bias")):
        return _untiled(rows, k_heads, per, 1), None
    if hf.endswith(".out_proj.weight"):
        return None, _untiled(cols, k_heads, per, hv)
    return None, None


def _one_row(hf: str, values: np.ndarray) -> np.ndarray:
    """The shared expert's gate, a one-row matrix, which llama.cpp's quantizer writes as a vector."""
    return values[None] if hf.endswith(".shared_expert_gate.weight") and values.ndim == 1 else values


def fix(hf: str, values: np.ndarray) -> np.ndarray:
    """A float tensor's values as the checkpoint holds them (after `reorder`)."""
    values = _one_row(hf, values)
    if hf.endswith(".A_log"):
        return np.log(-values.astype(np.float32))
    if hf.endswith(".conv1d.weight"):
        return values.reshape(values.shape[0], 1, -1)  # (channels, kernel) -> (channels, 1, kernel)
    if hf.endswith("norm.weight") and not hf.endswith(".linear_attn.norm.weight"):
        return (values.astype(np.float32) - 1).astype(values.dtype)
    return values


def fix_next(hf: str, values: np.ndarray) -> np.ndarray:
    """qwen3next's float tensors in mlx-lm's own layout for that model, which is the one that holds its experts as
    stacks (mlx-lm converts a checkpoint's names, conv kernel and norms only when its experts come one by one):
    the norms kept as stored (1 + w), the conv kernel as (channels, kernel, 1)."""
    values = _one_row(hf, values)
    if hf.endswith(".A_log"):
        return np.log(-values.astype(np.float32))
    if hf.endswith(".conv1d.weight"):
        return values.reshape(values.shape[0], -1, 1)
    return values
