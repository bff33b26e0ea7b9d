"""Per-architecture knowledge: HF config from GGUF metadata, and tensor names.

llama.cpp renames every tensor (``blk.3.attn_q.weight``) and, for the llama
family only, permutes the rows of Q and K so its RoPE can rotate adjacent
pairs. Each family here has one renaming function; the permutation is undone
by `qk_row_order`, a pure row reordering that leaves quantization groups (which
run along rows) intact, so it stays exact. Gemma norms are stored as ``w + 1``
by llama.cpp and come back as ``w``.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from umakit.errors import CheckpointError, UnsupportedModelError
from umakit.checkpoint.gguf import gemma4_arch, gpt_oss, qwen35_arch
from umakit.checkpoint.gguf.reader import GGUFFile

_GLOBAL = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_LLAMA_BLOCK = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_QWEN_BLOCK = {**_LLAMA_BLOCK, "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"}
_GEMMA3_BLOCK = {
    **_QWEN_BLOCK,
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
# Tensors llama.cpp adds that have no HF counterpart (their content goes to config.json).
_DERIVED = {"rope_freqs.weight"}
_BLOCK_RE = re.compile(r"^blk\.(\d+)\.([a-z0-9_]+)\.(weight|bias)$")
_GLOBAL_RE = re.compile(r"^([a-z_]+)\.(weight|bias)$")


def _rename(name: str, block: dict[str, str]) -> str | None:
    if m := _BLOCK_RE.match(name):
        layer, part, kind = m.groups()
        if part in block:
            return f"model.layers.{layer}.{block[part]}.{kind}"
    elif (m := _GLOBAL_RE.match(name)) and m.group(1) in _GLOBAL:
        return f"{_GLOBAL[m.group(1)]}.{m.group(2)}"
    return None


def llama_name(name: str) -> str | None:
    """HF name of a llama GGUF tensor, or None when it has none."""
    return _rename(name, _LLAMA_BLOCK)


def qwen_name(name: str) -> str | None:
    """Qwen 2 and 3: llama's names plus Qwen 3's per-head Q/K norms."""
    return _rename(name, _QWEN_BLOCK)


def gemma3_name(name: str) -> str | None:
    """Gemma 3: four norms per layer; llama.cpp's ``ffn_norm`` is the pre-feed-forward one."""
    return _rename(name, _GEMMA3_BLOCK)


def qk_row_order(hf_name: str, rows: int, config: dict) -> np.ndarray | None:
    """Row order that undoes llama.cpp's Q/K permutation (HF rows = GGUF rows[order])."""
    if ".self_attn.q_proj." in hf_name:
        n_head = config["num_attention_heads"]
    elif ".self_attn.k_proj." in hf_name:
        n_head = config["num_key_value_heads"]
    else:
        return None
    if rows % (2 * n_head):
        raise CheckpointError(f"{hf_name} has {rows} rows, not a whole number of rotary pairs for {n_head} heads")
    # GGUF holds each head's rows as (half, 2) interleaved pairs; HF as (2, half) halves.
    return np.arange(rows).reshape(n_head, rows // n_head // 2, 2).swapaxes(1, 2).reshape(-1)


def _scalar(gf: GGUFFile, key: str, default: Any = None) -> Any:
    value = gf.get(key, default)
    if isinstance(value, list):  # per-layer values (e.g. head counts); only uniform ones are supported
        if len(set(value)) != 1:
            raise UnsupportedModelError(f"{gf.path.name}: per-layer {key.format(arch=gf.arch)} is not supported")
        value = value[0]
    return value


def _rope_scaling(gf: GGUFFile, head_dim: int, theta: float) -> dict | None:
    kind = gf.get("{arch}.rope.scaling.type")
    factor = gf.get("{arch}.rope.scaling.factor") or gf.get("{arch}.rope.scale_linear")
    if "rope_freqs.weight" in gf.tensors:
        return _llama3_rope_scaling(gf, head_dim, theta)
    if kind in (None, "none") and not factor:
        return None
    kind = kind or "linear"
    if kind not in ("linear", "yarn"):
        raise UnsupportedModelError(f"{gf.path.name}: rope scaling {kind!r} is not supported (linear, yarn)")
    scaling = {"rope_type": kind, "type": kind, "factor": float(factor)}
    if original := gf.get("{arch}.rope.scaling.original_context_length"):
        scaling["original_max_position_embeddings"] = int(original)
    return scaling


def _llama3_rope_scaling(gf: GGUFFile, head_dim: int, theta: float) -> dict:
    """Recover Llama 3.1-style rope_scaling from the per-frequency factors llama.cpp stores.

    Only the published parameter set (low 1, high 4, original context 8192) is
    recognised: the factors are checked against it rather than guessed.
    """
    stored = np.asarray(gf.tensors["rope_freqs.weight"].data, dtype=np.float64).reshape(-1)
    scaling = {
        "rope_type": "llama3",
        "factor": float(stored.max()),
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    wavelen = 2 * np.pi * theta ** (np.arange(0, head_dim, 2) / head_dim)
    orig, low, high, factor = 8192, 1.0, 4.0, scaling["factor"]
    smooth = np.clip((orig / wavelen - low) / (high - low), 0, 1)
    expected = 1 / ((1 - smooth) / factor + smooth)
    if stored.shape != expected.shape or not np.allclose(stored, expected, rtol=1e-3):
        raise UnsupportedModelError(f"{gf.path.name}: its rope_freqs do not match Llama 3 rope scaling")
    return scaling


def base_config(gf: GGUFFile, default_theta: float) -> dict:
    """The hyperparameters every supported family shares."""
    hidden = int(gf.require("{arch}.embedding_length"))
    heads = int(_scalar(gf, "{arch}.attention.head_count"))
    kv_heads = int(_scalar(gf, "{arch}.attention.head_count_kv", heads))
    key_len = gf.get("{arch}.attention.key_length")
    head_dim = int(key_len or gf.get("{arch}.rope.dimension_count") or hidden // heads)
    if gf.get("{arch}.attention.value_length", head_dim) != head_dim:
        raise UnsupportedModelError(f"{gf.path.name}: key and value head sizes differ")
    rope_dims = gf.get("{arch}.rope.dimension_count", head_dim)
    if rope_dims != head_dim:
        raise UnsupportedModelError(f"{gf.path.name}: partial rotary embeddings are not supported")
    embed = gf.tensors.get("token_embd.weight")
    if embed is None:
        raise CheckpointError(f"{gf.path.name} has no token_embd.weight tensor")
    theta = float(gf.get("{arch}.rope.freq_base", default_theta))
    config = {
        "hidden_size": hidden,
        "num_hidden_layers": int(gf.require("{arch}.block_count")),
        "intermediate_size": int(_scalar(gf, "{arch}.feed_forward_length")),
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "rms_norm_eps": float(gf.require("{arch}.attention.layer_norm_rms_epsilon")),
        "rope_theta": theta,
        "max_position_embeddings": int(gf.get("{arch}.context_length", 4096)),
        "vocab_size": int(embed.shape[1]),  # ne = (hidden, vocab)
        "tie_word_embeddings": "output.weight" not in gf.tensors,
        "hidden_act": "silu",
    }
    if scaling := _rope_scaling(gf, head_dim, theta):
        config["rope_scaling"] = scaling
    return config


def llama_config(gf: GGUFFile) -> dict:
    """Llama-family config; biases exist only in some fine-tunes, so they are read from the tensors."""
    config = base_config(gf, default_theta=10000.0)
    config["attention_bias"] = "blk.0.attn_q.bias" in gf.tensors
    config["mlp_bias"] = "blk.0.ffn_up.bias" in gf.tensors
    return config


def smollm3_config(gf: GGUFFile) -> dict:
    """SmolLM3: Llama's layout, with every fourth layer's attention taking no RoPE, a step llama.cpp hard-codes
    rather than stores (its ``n_no_rope_layer_step``); transformers' ``no_rope_layers`` flags 1 for RoPE."""
    config = llama_config(gf)
    step = 4
    config.update(no_rope_layer_interval=step,
                  no_rope_layers=[int((i + 1) % step != 0) for i in range(config["num_hidden_layers"])])
    return config


def qwen2_config(gf: GGUFFile) -> dict:
    """Qwen 2 (Q/K/V biases are implied by the architecture)."""
    return base_config(gf, default_theta=1_000_000.0)


def qwen3_config(gf: GGUFFile) -> dict:
    """Qwen 3 (head_dim comes from attention.key_length)."""
    return base_config(gf, default_theta=1_000_000.0)


def gemma3_config(gf: GGUFFile) -> dict:
    """Gemma 3 text model, with the constants llama.cpp hard-codes rather than stores."""
    config = base_config(gf, default_theta=1_000_000.0)
    n_layers, pattern = config["num_hidden_layers"], 6  # llama.cpp hard-codes Gemma 3's 5 local : 1 global
    # llama.cpp scales the 27B model's queries by hidden/heads and every other size by head_dim.
    big = n_layers == 62
    config.update(
        hidden_activation="gelu_pytorch_tanh",
        query_pre_attn_scalar=config["hidden_size"] // config["num_attention_heads"] if big else config["head_dim"],
        sliding_window=int(gf.get("{arch}.attention.sliding_window", 512)),
        sliding_window_pattern=pattern,
        layer_types=[
            "full_attention" if (i + 1) % pattern == 0 else "sliding_attention" for i in range(n_layers)
        ],
        rope_local_base_freq=10000.0,
        final_logit_softcapping=None,
        attn_logit_softcapping=None,
    )
    del config["hidden_act"]
    return config


def gpt_oss_config(gf: GGUFFile) -> dict:
    """gpt-oss: the shared hyperparameters, and its experts, sliding window and yarn RoPE (gpt_oss.py)."""
    return gpt_oss.gpt_oss_config(gf, base_config(gf, default_theta=150000.0))


@dataclass(frozen=True)
class ArchSpec:
    """How one GGUF architecture becomes a Hugging Face checkpoint."""

    model_type: str
    hf_class: str
    rename: Callable[[str], str | None]
    config: Callable[[GGUFFile], dict]
    permute_qk: bool = False
    norm_offset: float = 0.0  # subtracted from every float ``*norm.weight``
    # gpt-oss: the routed experts, converted together and kept in OpenAI's MXFP4 layout (their GGUF names, checked,
    # and their arrays), every other quantized tensor dequantized (exactly, to float32), since the engines read
    # OpenAI's layout with float tensors beside it and no MLX-quantized ones
    experts: Callable[[GGUFFile], set[str]] | None = None
    expert_arrays: Callable[[GGUFFile], dict[str, np.ndarray]] | None = None
    # gemma4: 3-D expert stacks, converted as the 2-D tensors are (expert by expert) and written as the modules
    # this names, each with its share of the rows; None for a tensor that is not one
    stacked: Callable[[str], list[tuple[str, int, int]] | None] | None = None
    # qwen35: rows and columns llama.cpp reordered, given back as (HF rows = GGUF rows[order], columns likewise;
    # either None), from the HF name, the rows, the columns and the config; and a float tensor's values changed
    # back (an HF name and its array; after the reordering)
    reorder: Callable[[str, int, int, dict], tuple[np.ndarray | None, np.ndarray | None]] | None = None
    fix: Callable[[str, np.ndarray], np.ndarray] | None = None
    # qwen3next: the order of the parts of a tensor llama.cpp split in two (their names past "blk.N."), which
    # `rename` maps to the one HF name; joined along their rows before `reorder`
    joins: tuple[str, ...] = ()


SPECS = {
    "llama": ArchSpec("llama", "LlamaForCausalLM", llama_name, llama_config, permute_qk=True),
    "smollm3": ArchSpec("smollm3", "SmolLM3ForCausalLM", llama_name, smollm3_config, permute_qk=True),
    "qwen2": ArchSpec("qwen2", "Qwen2ForCausalLM", qwen_name, qwen2_config),
    "qwen3": ArchSpec("qwen3", "Qwen3ForCausalLM", qwen_name, qwen3_config),
    "gemma3": ArchSpec("gemma3_text", "Gemma3ForCausalLM", gemma3_name, gemma3_config, norm_offset=1.0),
    "qwen35": ArchSpec("qwen3_5_text", "Qwen3_5ForCausalLM", qwen35_arch.qwen35_name, qwen35_arch.qwen35_config,
                       reorder=qwen35_arch.reorder, fix=qwen35_arch.fix),
    "qwen35moe": ArchSpec("qwen3_5_moe_text", "Qwen3_5MoeForCausalLM", qwen35_arch.qwen35_name,
                          qwen35_arch.qwen35moe_config, reorder=qwen35_arch.reorder, fix=qwen35_arch.fix,
                          stacked=qwen35_arch.expert_parts),
    "qwen3next": ArchSpec("qwen3_next", "Qwen3NextForCausalLM", qwen35_arch.qwen3next_name,
                          qwen35_arch.qwen3next_config, reorder=qwen35_arch.reorder, fix=qwen35_arch.fix_next,
                          stacked=qwen35_arch.expert_parts, joins=("attn_qkv.weight", "attn_gate.weight")),
    "gemma4": ArchSpec("gemma4_text", "Gemma4ForCausalLM", gemma4_arch.gemma4_name, gemma4_arch.gemma4_config,
                       stacked=gemma4_arch.expert_parts),
    "gpt-oss": ArchSpec("gpt_oss", "GptOssForCausalLM", gpt_oss.gpt_oss_name, gpt_oss_config,
                        experts=gpt_oss.check_experts, expert_arrays=gpt_oss.experts),
}


def spec_for(gf: GGUFFile) -> ArchSpec:
    """The spec of ``gf``'s architecture, or an error naming the supported ones."""
    if gf.arch not in SPECS:
        raise UnsupportedModelError(
            f"{gf.path.name}: architecture {gf.arch!r} is not supported (supported: {', '.join(sorted(SPECS))})"
        )
    return SPECS[gf.arch]


def map_names(gf: GGUFFile, spec: ArchSpec) -> dict[str, str]:
    """GGUF tensor name -> HF name for every tensor the model needs."""
    names = {}
    grouped = spec.experts(gf) if spec.experts else set()
    for name in gf.tensors:
        if name in _DERIVED or name in grouped:
            continue
        hf = spec.rename(name)
        if hf is None:
            raise UnsupportedModelError(f"{gf.path.name}: tensor {name} has no counterpart in a {gf.arch} model")
        names[name] = hf
    return names
