"""gpt-oss GGUFs as llama.cpp writes them, from the tiny OpenAI-layout checkpoint of support/mxfp4.py: written
here with gguf.GGUFWriter following llama.cpp's converter (conversion/gpt_oss.py: gate and up de-interleaved,
each MXFP4 block repacked as ggml's block_mxfp4), or by that converter itself where llama.cpp's sources are on
this machine (../shared/tools/build_llama_peers.sh unpacks them)."""

from __future__ import annotations

import glob
import json
import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
from gguf import GGMLQuantizationType as T
from gguf import quants as gguf_quants

CONVERTERS = sorted(glob.glob(str(Path.home() / ".cache/umakit-peers/src/*/vendor/llama.cpp/convert_hf_to_gguf.py")))
ARCH = "gpt-oss"
# llama.cpp's converter names a BPE pre-tokenizer by hashing the token ids of a fixed text, so it knows only
# tokenizers it has seen; the tiny one is given the family's own name (gpt-4o for gpt-oss, qwen2 for Qwen), the rest
# of the converter untouched.
_CONVERT = """
import runpy, sys
root, pre = sys.argv[1], sys.argv[2]
sys.path[:0] = [root, root + "/gguf-py"]
from conversion import base
base.TextModel.get_vocab_base_pre = lambda self, tokenizer: pre
sys.argv = [root + "/convert_hf_to_gguf.py", *sys.argv[3:]]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def llama_cpp_convert(checkpoint: Path, out: Path, outtype: str = "f32", pre: str = "gpt-4o",
                      extra: tuple[str, ...] = ()) -> Path:
    """``checkpoint`` converted by llama.cpp's own convert_hf_to_gguf.py (the first found in `CONVERTERS`); ``pre``:
    the pre-tokenizer's name for a byte-level vocabulary, ``extra``: more of the converter's arguments."""
    config = json.loads((checkpoint / "config.json").read_text())
    if not config.get("architectures"):  # the converter picks its model class by this name
        config["architectures"] = ["GptOssForCausalLM"]
        (checkpoint / "config.json").write_text(json.dumps(config, indent=1))
    root = str(Path(CONVERTERS[0]).parent)
    run = subprocess.run([sys.executable, "-c", _CONVERT, root, pre, str(checkpoint), "--outfile", str(out),
                          "--outtype", outtype, *extra], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    return out


def ggml_mxfp4(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """OpenAI's blocks (..., n / 32, 16: elements 2i, 2i + 1 in byte i, low nibble first) and scales (..., n / 32)
    -> ggml's block_mxfp4 bytes (..., n / 32 * 17: the exponent, then element j in byte j's low nibble for j < 16,
    in byte j - 16's high nibble after)."""
    codes = np.stack([blocks & 0x0F, blocks >> 4], axis=-1).reshape(*blocks.shape[:-1], 32)
    qs = codes[..., :16] | (codes[..., 16:] << 4)
    return np.concatenate([scales[..., None], qs], axis=-1).reshape(*scales.shape[:-1], -1)


def write_gguf(checkpoint: Path, out: Path, dense=T.F32, experts=T.MXFP4) -> Path:
    """The checkpoint as llama.cpp's converter writes it; ``dense``: the type of the 2-D weights other than the
    experts and the router (F32, F16, BF16 or Q8_0), as the converter's --outtype picks; ``experts`` F32: the
    experts dequantized (what umakit does not import)."""
    from safetensors.numpy import load_file

    config = json.loads((checkpoint / "config.json").read_text())
    rope = config.get("rope_parameters") or config["rope_scaling"]
    st = load_file(checkpoint / "model.safetensors")
    w = gguf.GGUFWriter(str(out), ARCH)
    w.add_block_count(config["num_hidden_layers"])
    w.add_context_length(config["max_position_embeddings"])
    w.add_embedding_length(config["hidden_size"])
    w.add_feed_forward_length(config["intermediate_size"])
    w.add_head_count(config["num_attention_heads"])
    w.add_head_count_kv(config["num_key_value_heads"])
    w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
    w.add_rope_scaling_factor(rope["factor"])
    w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
    w.add_rope_scaling_yarn_beta_fast(rope["beta_fast"])
    w.add_rope_scaling_yarn_beta_slow(rope["beta_slow"])
    w.add_rope_freq_base(rope.get("rope_theta", config.get("rope_theta")))
    w.add_layer_norm_rms_eps(config["rms_norm_eps"])
    w.add_expert_count(config["num_local_experts"])
    w.add_expert_used_count(config["num_experts_per_tok"])
    w.add_key_length(config["head_dim"])
    w.add_value_length(config["head_dim"])
    w.add_sliding_window(config["sliding_window"])
    w.add_expert_feed_forward_length(config["intermediate_size"])
    _add_tokenizer(w, checkpoint)

    def add_experts(name, blocks, scales):
        data = ggml_mxfp4(blocks, scales)
        if experts == T.MXFP4:
            w.add_tensor(name, data, raw_dtype=T.MXFP4)
        else:
            w.add_tensor(name, gguf_quants.dequantize(data, T.MXFP4).astype(np.float32))

    def add(name, data, qtype=T.F32):
        if qtype == T.F32 or data.ndim == 1:
            w.add_tensor(name, np.ascontiguousarray(data, dtype=np.float32))
        elif qtype == T.F16:
            w.add_tensor(name, data.astype(np.float16))
        else:  # BF16, Q8_0: the gguf package's own quantization, raw bytes
            w.add_tensor(name, gguf_quants.quantize(data.astype(np.float32), qtype), raw_dtype=qtype)

    add("token_embd.weight", st["model.embed_tokens.weight"], dense)
    add("output.weight", st["lm_head.weight"], dense)
    add("output_norm.weight", st["model.norm.weight"])
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        add(f"blk.{i}.attn_norm.weight", st[p + "input_layernorm.weight"])
        add(f"blk.{i}.post_attention_norm.weight", st[p + "post_attention_layernorm.weight"])
        for ours, theirs in (("attn_q", "q_proj"), ("attn_k", "k_proj"), ("attn_v", "v_proj"),
                             ("attn_output", "o_proj")):
            add(f"blk.{i}.{ours}.weight", st[f"{p}self_attn.{theirs}.weight"], dense)
            add(f"blk.{i}.{ours}.bias", st[f"{p}self_attn.{theirs}.bias"])
        add(f"blk.{i}.attn_sinks.weight", st[p + "self_attn.sinks"])
        add(f"blk.{i}.ffn_gate_inp.weight", st[p + "mlp.router.weight"])
        add(f"blk.{i}.ffn_gate_inp.bias", st[p + "mlp.router.bias"])
        e = p + "mlp.experts."
        blocks, scales, bias = (st[e + "gate_up_proj_" + k] for k in ("blocks", "scales", "bias"))
        for part, rows in (("gate", slice(0, None, 2)), ("up", slice(1, None, 2))):  # interleaved in OpenAI's
            add_experts(f"blk.{i}.ffn_{part}_exps.weight", blocks[:, rows], scales[:, rows])
            add(f"blk.{i}.ffn_{part}_exps.bias", bias[:, rows])
        add_experts(f"blk.{i}.ffn_down_exps.weight", st[e + "down_proj_blocks"], st[e + "down_proj_scales"])
        add(f"blk.{i}.ffn_down_exps.bias", st[e + "down_proj_bias"])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


def _add_tokenizer(w, checkpoint: Path) -> None:
    """The checkpoint's byte-level BPE as llama.cpp stores one (``gpt2``, pre-tokenizer ``gpt-4o``)."""
    tok = json.loads((checkpoint / "tokenizer.json").read_text())
    tok_config = json.loads((checkpoint / "tokenizer_config.json").read_text())
    vocab = tok["model"]["vocab"]
    specials = {t["content"] for t in tok["added_tokens"] if t["special"]}
    tokens = sorted(vocab, key=vocab.get)
    merges = [m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt-4o")
    w.add_token_list(tokens)
    w.add_token_types([3 if t in specials else 1 for t in tokens])
    w.add_token_merges(merges)
    w.add_bos_token_id(vocab[tok_config["bos_token"]])
    w.add_eos_token_id(vocab[tok_config["eos_token"]])
    w.add_add_bos_token(False)
    w.add_chat_template(tok_config["chat_template"])
