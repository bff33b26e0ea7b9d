"""Qwen3.5 GGUFs (llama.cpp's ``qwen35``) as llama.cpp writes them, from tiny text-only checkpoints saved by the
installed transformers: written here with gguf.GGUFWriter following llama.cpp's converter (conversion/qwen.py,
`Qwen3_5TextModel`: names from the gguf package's own map, the value heads tiled, norms stored as 1 + w, A_log
as -exp(A_log), the conv kernel squeezed), or by that converter itself where llama.cpp's sources are here."""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
from gguf import GGMLQuantizationType as T

from support import gguf_gpt_oss
from support.tiny import VOCAB, write_tokenizer

ARCH = "qwen35"
CONFIG = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
              num_key_value_heads=2, head_dim=32, linear_num_key_heads=2, linear_num_value_heads=4,
              linear_key_head_dim=32, linear_value_head_dim=32, linear_conv_kernel_dim=4,
              layer_types=["linear_attention"] * 3 + ["full_attention"], max_position_embeddings=512,
              bos_token_id=1, eos_token_id=2, pad_token_id=0, tie_word_embeddings=False)


MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32)


def make(path: Path, seed: int = 0, moe: bool = False, next_: bool = False, **overrides) -> Path:
    """A random text-only Qwen3.5 (three gated delta-net layers, then gated full attention; ``moe``: the mixture
    with a shared expert in every layer), its norms, decays and time steps moved off their defaults so that a slip
    in any shows, its routers made decisive so that a wrong expert would."""
    import torch
    import transformers

    torch.manual_seed(seed)
    if next_:  # Qwen3-Next: in_proj_qkvz and in_proj_ba fused, every layer a mixture
        config = transformers.Qwen3NextConfig(**{**CONFIG, **MOE, **overrides})
        model = transformers.Qwen3NextForCausalLM(config)
    elif moe:
        config = transformers.Qwen3_5MoeTextConfig(**{**CONFIG, **MOE, **overrides})
        model = transformers.Qwen3_5MoeForCausalLM(config)
    else:
        model = transformers.Qwen3_5ForCausalLM(transformers.Qwen3_5TextConfig(**{**CONFIG, **overrides}))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
            if name.endswith(("A_log", "dt_bias")):
                p.add_(torch.randn_like(p) * 0.3)
            if name.endswith("mlp.gate.weight"):
                p.mul_(20)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path, safe_serialization=True)
    write_tokenizer(path)
    return path


def llama_cpp_convert(checkpoint: Path, out: Path) -> Path:
    """``checkpoint`` converted by llama.cpp's own convert_hf_to_gguf.py (multi-token prediction off)."""
    return gguf_gpt_oss.llama_cpp_convert(checkpoint, out, pre="qwen2", extra=("--no-mtp",))


def _stacked(st: dict, c: dict) -> dict:
    """Each layer's routed experts as 3-D stacks (``mlp.experts.gate_proj``: experts, rows, columns), as the
    converter stacks them."""
    out = {k: v for k, v in st.items() if ".mlp.experts." not in k}
    for i in range(c["num_hidden_layers"] if c.get("num_experts") else 0):
        for part in ("gate_proj", "up_proj", "down_proj"):
            out[f"model.layers.{i}.mlp.experts.{part}.weight"] = np.stack(
                [st[f"model.layers.{i}.mlp.experts.{e}.{part}.weight"] for e in range(c["num_experts"])])
    return out


def _tiled(x: np.ndarray, axis: int, c: dict, width: int) -> np.ndarray:
    """The value heads along ``axis`` from grouped by key head (k, v) to tiled (v, k), as the converter does."""
    k, per = c["linear_num_key_heads"], c["linear_num_value_heads"] // c["linear_num_key_heads"]
    x = np.moveaxis(x, axis, 0)
    shape = x.shape
    x = x.reshape(k, per, width, *shape[1:]).swapaxes(0, 1).reshape(shape)
    return np.moveaxis(x, 0, axis)


def _split_qkvz(x: np.ndarray, c: dict) -> tuple[np.ndarray, np.ndarray]:
    """qwen3next's ``in_proj_qkvz`` (each key head's q, k, v and z together) as the converter splits it: all
    heads' q, k and v one after another, and all their z."""
    k, hk, hv = c["linear_num_key_heads"], c["linear_key_head_dim"], c["linear_value_head_dim"]
    per = c["linear_num_value_heads"] // k
    q, kk, v, z = np.split(x.reshape(k, -1, x.shape[-1]), np.cumsum([hk, hk, per * hv]), axis=1)
    return np.concatenate([p.reshape(-1, x.shape[-1]) for p in (q, kk, v)]), z.reshape(-1, x.shape[-1])


def _stored(hf: str, x: np.ndarray, c: dict) -> np.ndarray:
    """A checkpoint tensor as llama.cpp's converter stores it."""
    hv, qk = c["linear_value_head_dim"], 2 * c["linear_num_key_heads"] * c["linear_key_head_dim"]
    if c["model_type"] == "qwen3_next":  # no value heads tiled there
        x = x.reshape(x.shape[0], -1) if hf.endswith("conv1d.weight") else x
    elif hf.endswith(("in_proj_qkv.weight", "conv1d.weight")):
        x = x.reshape(x.shape[0], -1)  # the conv kernel loses its middle axis
        x = np.concatenate([x[:qk], _tiled(x[qk:], 0, c, hv)])
    elif hf.endswith("in_proj_z.weight"):
        x = _tiled(x, 0, c, hv)
    elif hf.endswith(("in_proj_a.weight", "in_proj_b.weight", "A_log", "dt_bias")):
        x = _tiled(x, 0, c, 1)
    elif hf.endswith("out_proj.weight"):
        x = _tiled(x, 1, c, hv)
    if hf.endswith("A_log"):
        x = -np.exp(x)
    elif hf.endswith("norm.weight") and not hf.endswith("linear_attn.norm.weight"):
        x = x + 1
    return x


def write_gguf(checkpoint: Path, out: Path, dense=T.F32, overrides: dict | None = None) -> Path:
    """The checkpoint as llama.cpp's converter writes it; ``dense``: the 2-D weights' type (F32, Q8_0, Q4_0),
    ``overrides``: another type for the tensors whose HF name ends so (as a Q4_K_M keeps some at higher widths)."""
    from safetensors.numpy import load_file

    c = json.loads((checkpoint / "config.json").read_text())
    st = _stacked(load_file(checkpoint / "model.safetensors"), c)
    arch = "qwen3next" if c["model_type"] == "qwen3_next" else "qwen35moe" if c.get("num_experts") else ARCH
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH[arch.upper()], c["num_hidden_layers"])
    w = gguf.GGUFWriter(str(out), arch)
    w.add_block_count(c["num_hidden_layers"])
    w.add_context_length(c["max_position_embeddings"])
    w.add_embedding_length(c["hidden_size"])
    w.add_feed_forward_length(c["intermediate_size"])
    if c.get("num_experts"):
        w.add_expert_count(c["num_experts"])
        w.add_expert_used_count(c["num_experts_per_tok"])
        w.add_expert_feed_forward_length(c["moe_intermediate_size"])
        w.add_expert_shared_feed_forward_length(c["shared_expert_intermediate_size"])
    w.add_head_count(c["num_attention_heads"])
    w.add_head_count_kv(c["num_key_value_heads"])
    w.add_rope_freq_base(c["rope_parameters"]["rope_theta"])
    w.add_layer_norm_rms_eps(c["rms_norm_eps"])
    w.add_key_length(c["head_dim"])
    w.add_value_length(c["head_dim"])
    w.add_ssm_conv_kernel(c["linear_conv_kernel_dim"])
    w.add_ssm_state_size(c["linear_key_head_dim"])
    w.add_ssm_group_count(c["linear_num_key_heads"])
    w.add_ssm_time_step_rank(c["linear_num_value_heads"])
    w.add_ssm_inner_size(c["linear_value_head_dim"] * c["linear_num_value_heads"])
    w.add_array(f"{arch}.attention.recurrent_layers", [t == "linear_attention" for t in c["layer_types"]])
    w.add_full_attention_interval(c.get("full_attention_interval", 4))
    w.add_rope_dimension_count(int(c["head_dim"] * c["rope_parameters"]["partial_rotary_factor"]))
    if arch != "qwen3next":  # Qwen3.5's interleaved MRoPE sections (text positions: plain RoPE)
        w.add_rope_dimension_sections([11, 11, 10, 0])
    tok = json.loads((checkpoint / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2")
    w.add_token_list(sorted(vocab, key=vocab.get))
    w.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]])
    stored = {}
    for hf, x in st.items():
        x = _stored(hf, x, c).astype(np.float32)
        if hf.endswith("in_proj_qkvz.weight"):
            qkv, z = _split_qkvz(x, c)
            stored[hf.replace("in_proj_qkvz", "in_proj_qkv")], stored[hf.replace("in_proj_qkvz", "in_proj_z")] = qkv, z
        else:
            stored[hf] = x
    for hf, x in stored.items():
        name = names.get_name(hf.replace(".dt_bias", ".dt_proj.bias"), try_suffixes=(".weight", ".bias"))
        qtype = next((t for end, t in (overrides or {}).items() if hf.endswith(end)), dense)
        if qtype != T.F32 and x.ndim >= 2 and x.shape[-1] % 32 == 0 and "conv1d" not in hf:
            rows = gguf.quants.quantize(x.reshape(-1, x.shape[-1]), qtype)
            w.add_tensor(name, rows.reshape(*x.shape[:-1], -1), raw_dtype=qtype)
        else:
            w.add_tensor(name, np.ascontiguousarray(x))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out
