"""GGUFs of real models' exact shapes with random weights, quantized by llama.cpp itself: what users download,
for benchmarks to run on without a network.

    python benchmarks/shaped_ggufs.py DIR [--models qwen2.5-0.5b qwen2.5-1.5b gemma4-moe-small ...] [--types Q4_K_M ...]

Each model is written once as float16 with the `gguf` package (the built-in
model's tokenizer, padded with unused tokens to Qwen's vocabulary), then
quantized by llama.cpp's own quantizer (llama-cpp-python's
``llama_model_quantize``, run by ``--llama-python``) to each type with
llama.cpp's default choices per tensor (a Q4_K_M keeps some tensors at Q6_K,
and where a row is not a multiple of 256 falls back to Q5_0/Q8_0, as on the
Hub's files). Random weights cost the same to load and run as real ones;
``smollm2-135m`` is a real model for perplexity: the built-in Q4_1 file
re-quantized by llama.cpp (its weights already on a 4-bit grid).
Files already in DIR are kept. Prints the paths written.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np

LLAMA_PYTHON = os.environ.get("LLAMA_PYTHON") or str(Path.home() / ".cache" / "umakit-peers" / "venv" / "bin" / "python")
QWEN = dict(vocab=151936, theta=1e6, eps=1e-6, context=32768, kv_heads=2)
SHAPES = {
    "qwen2.5-0.5b": dict(QWEN, layers=24, hidden=896, heads=14, inter=4864),
    "qwen2.5-1.5b": dict(QWEN, layers=28, hidden=1536, heads=12, inter=8960),
}
# gemma4 shapes: a transformers config of the presets beside this script, written in llama.cpp's gemma4 layout
GEMMA4 = {name: Path(__file__).parent / "presets" / f"{name}.json"
          for name in ("gemma4-e4b-width-6l", "gemma4-moe-small")}
# Qwen3.5: a transformers config beside this script (27B's and 35B-A3B's widths, as transformers' own defaults give
# them, with fewer layers, and experts), written in llama.cpp's qwen35 / qwen35moe layout
QWEN35 = {name: Path(__file__).parent / "presets" / f"{name}.json"
          for name in ("qwen3.5-27b-width-4l", "qwen3.5-35b-a3b-width-8l")}
# llama.cpp's LLAMA_FTYPE_MOSTLY_* numbers
FTYPES = {"Q4_0": 2, "Q4_1": 3, "Q8_0": 7, "Q5_0": 8, "Q5_1": 9, "Q4_K_M": 15, "Q5_K_M": 17, "Q6_K": 18}
Q8_0_TYPE = 8  # GGML_TYPE_Q8_0

QUANTIZE = """
import sys, llama_cpp
p = llama_cpp.llama_model_quantize_default_params()
p.ftype, p.nthread, p.allow_requantize = int(sys.argv[3]), 2, True
if int(sys.argv[4]) >= 0:
    p.token_embedding_type = int(sys.argv[4])
assert llama_cpp.llama_model_quantize(sys.argv[1].encode(), sys.argv[2].encode(), p) == 0
"""


def _tokenizer(w, tokenizer_from: Path, vocab: int) -> None:
    """The given GGUF's tokenizer, padded with unused tokens to ``vocab``."""
    import gguf

    src = gguf.GGUFReader(str(tokenizer_from))
    field = lambda key: src.fields[key].contents()  # noqa: E731
    tokens, types = field("tokenizer.ggml.tokens"), field("tokenizer.ggml.token_type")
    pad = vocab - len(tokens)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(field("tokenizer.ggml.pre"))
    w.add_token_list(tokens + [f"<|unused_{i}|>" for i in range(pad)])
    w.add_token_types(types + [gguf.TokenType.UNUSED] * pad)
    w.add_token_merges(field("tokenizer.ggml.merges"))
    w.add_bos_token_id(field("tokenizer.ggml.bos_token_id"))
    w.add_eos_token_id(field("tokenizer.ggml.eos_token_id"))
    w.add_add_bos_token(False)
    w.add_chat_template(field("tokenizer.chat_template"))


def write_f16(path: Path, shape: dict, name: str, tokenizer_from: Path) -> None:
    """A float16 GGUF of ``shape`` (Qwen2's architecture: q/k/v biases, tied embeddings), random weights, the given
    GGUF's tokenizer padded to the vocabulary."""
    import gguf

    s = shape
    w = gguf.GGUFWriter(str(path), "qwen2")
    w.add_name(f"{name}-shaped, random weights")
    w.add_context_length(s["context"])
    w.add_embedding_length(s["hidden"])
    w.add_block_count(s["layers"])
    w.add_feed_forward_length(s["inter"])
    w.add_head_count(s["heads"])
    w.add_head_count_kv(s["kv_heads"])
    w.add_rope_freq_base(s["theta"])
    w.add_layer_norm_rms_eps(s["eps"])
    w.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    _tokenizer(w, tokenizer_from, s["vocab"])
    rng = np.random.default_rng(0)
    h, hd = s["hidden"], s["hidden"] // s["heads"]
    kv = s["kv_heads"] * hd

    def rand(*dims):  # GGUF lists dimensions innermost first; numpy arrays are (out, in)
        return (rng.standard_normal(dims, dtype=np.float32) * 0.02).astype(np.float16)

    w.add_tensor("token_embd.weight", rand(s["vocab"], h))
    w.add_tensor("output_norm.weight", np.ones(h, dtype=np.float32))
    for i in range(s["layers"]):
        b = f"blk.{i}."
        w.add_tensor(b + "attn_norm.weight", np.ones(h, dtype=np.float32))
        w.add_tensor(b + "ffn_norm.weight", np.ones(h, dtype=np.float32))
        for part, rows in (("attn_q", h), ("attn_k", kv), ("attn_v", kv)):
            w.add_tensor(b + part + ".weight", rand(rows, h))
            w.add_tensor(b + part + ".bias", rand(rows).astype(np.float32))
        w.add_tensor(b + "attn_output.weight", rand(h, h))
        w.add_tensor(b + "ffn_gate.weight", rand(s["inter"], h))
        w.add_tensor(b + "ffn_up.weight", rand(s["inter"], h))
        w.add_tensor(b + "ffn_down.weight", rand(h, s["inter"]))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def write_gemma4_f16(path: Path, config_path: Path, name: str, tokenizer_from: Path) -> None:
    """A float16 GGUF of a gemma4 config's shapes as llama.cpp's converter lays one out (per-layer head counts and
    widths, the global layers' RoPE factors, per-layer inputs, the experts beside each dense MLP), random weights."""
    import gguf

    c = json.loads(config_path.read_text())
    n, types, h, p = c["num_hidden_layers"], c["layer_types"], c["hidden_size"], c["hidden_size_per_layer_input"]
    per = {int(k): v for k, v in (c.get("per_layer_config") or {}).items()}
    dims = [per.get(i, {}).get("head_dim", c["head_dim"]) for i in range(n)]
    kv = [per.get(i, {}).get("num_key_value_heads", c["num_key_value_heads"]) for i in range(n)]
    full = types.index("full_attention")
    rope = c["rope_parameters"]
    w = gguf.GGUFWriter(str(path), "gemma4")
    w.add_name(f"{name}-shaped, random weights")
    w.add_block_count(n)
    w.add_context_length(c["max_position_embeddings"])
    w.add_embedding_length(h)
    w.add_feed_forward_length(c["intermediate_size"])
    w.add_head_count(c["num_attention_heads"])
    w.add_head_count_kv(kv)
    w.add_rope_freq_base(rope["full_attention"]["rope_theta"])
    w.add_rope_freq_base_swa(rope["sliding_attention"]["rope_theta"])
    w.add_layer_norm_rms_eps(c["rms_norm_eps"])
    w.add_key_length(dims[full])
    w.add_value_length(dims[full])
    w.add_key_length_swa(c["head_dim"])
    w.add_value_length_swa(c["head_dim"])
    w.add_sliding_window(c["sliding_window"])
    w.add_shared_kv_layers(c.get("num_kv_shared_layers") or 0)
    w.add_embedding_length_per_layer_input(p)
    w.add_sliding_window_pattern([t == "sliding_attention" for t in types])
    w.add_rope_dimension_count(dims[full])
    w.add_rope_dimension_count_swa(c["head_dim"])
    experts = c.get("num_experts") if c.get("enable_moe_block") else None
    if experts:
        w.add_expert_count(experts)
        w.add_expert_used_count(c["top_k_experts"])
        w.add_expert_feed_forward_length(c["moe_intermediate_size"])
    w.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    # the vocabulary at least the tokenizer's (49,152 tokens: a preset's smaller one grows to it)
    vocab = max(c["vocab_size"], len(gguf.GGUFReader(str(tokenizer_from)).fields["tokenizer.ggml.tokens"].data))
    _tokenizer(w, tokenizer_from, vocab)
    rng = np.random.default_rng(0)

    def rand(*dims):  # numpy arrays are (out, in)
        return (rng.standard_normal(dims, dtype=np.float32) * 0.02).astype(np.float16)

    ones = lambda k: np.ones(k, dtype=np.float32)  # noqa: E731
    turned = int(dims[full] * rope["full_attention"]["partial_rotary_factor"] / 2)
    w.add_tensor("rope_freqs.weight", np.array([1.0] * turned + [1e30] * (dims[full] // 2 - turned), np.float32))
    w.add_tensor("token_embd.weight", rand(vocab, h))
    w.add_tensor("output_norm.weight", ones(h))
    if p:
        w.add_tensor("per_layer_token_embd.weight", rand(max(vocab, c["vocab_size_per_layer_input"]), n * p))
        w.add_tensor("per_layer_model_proj.weight", rand(n * p, h))
        w.add_tensor("per_layer_proj_norm.weight", ones(p))
    heads, inter = c["num_attention_heads"], c["intermediate_size"]
    for i in range(n):
        b, d = f"blk.{i}.", dims[i]
        for t, value in (("attn_q", rand(heads * d, h)), ("attn_k", rand(kv[i] * d, h)),
                         ("attn_v", rand(kv[i] * d, h)), ("attn_output", rand(h, heads * d)),
                         ("ffn_gate", rand(inter, h)), ("ffn_up", rand(inter, h)), ("ffn_down", rand(h, inter))):
            w.add_tensor(b + t + ".weight", value)
        for t, k in (("attn_norm", h), ("attn_q_norm", d), ("attn_k_norm", d), ("post_attention_norm", h),
                     ("ffn_norm", h), ("post_ffw_norm", h), ("layer_output_scale", 1)):
            w.add_tensor(b + t + ".weight", ones(k))
        if experts:  # the mixture beside the dense MLP (26B-A4B's layout), as llama.cpp stores it
            moe = c["moe_intermediate_size"]
            w.add_tensor(b + "ffn_gate_inp.weight", rand(experts, h))
            w.add_tensor(b + "ffn_gate_inp.scale", ones(h))
            w.add_tensor(b + "ffn_down_exps.scale", ones(experts))
            w.add_tensor(b + "ffn_gate_up_exps.weight", rand(experts, 2 * moe, h))
            w.add_tensor(b + "ffn_down_exps.weight", rand(experts, h, moe))
            for t in ("pre_ffw_norm_2", "post_ffw_norm_1", "post_ffw_norm_2"):
                w.add_tensor(b + t + ".weight", ones(h))
        if p:
            w.add_tensor(b + "inp_gate.weight", rand(p, h))
            w.add_tensor(b + "proj.weight", rand(h, p))
            w.add_tensor(b + "post_norm.weight", ones(h))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def write_qwen35_f16(path: Path, config_path: Path, name: str, tokenizer_from: Path) -> None:
    """A float16 GGUF of a Qwen3.5 config's shapes in llama.cpp's layout (gated delta-net layers beside gated full
    attention; a mixture's as qwen35moe: 3-D expert stacks and a shared expert), random weights."""
    import gguf

    c = json.loads(config_path.read_text())
    n, h, types = c["num_hidden_layers"], c["hidden_size"], c["layer_types"]
    kh, vh, dk, dv = (c[f"linear_{k}"] for k in ("num_key_heads", "num_value_heads", "key_head_dim", "value_head_dim"))
    heads, kv, hd, e = c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"], c.get("num_experts")
    arch = "qwen35moe" if e else "qwen35"
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name(f"{name}-shaped, random weights")
    w.add_block_count(n)
    w.add_context_length(c["max_position_embeddings"])
    w.add_embedding_length(h)
    w.add_feed_forward_length(c.get("intermediate_size", 0))
    if e:
        w.add_expert_count(e)
        w.add_expert_used_count(c["num_experts_per_tok"])
        w.add_expert_feed_forward_length(c["moe_intermediate_size"])
        w.add_expert_shared_feed_forward_length(c["shared_expert_intermediate_size"])
    w.add_head_count(heads)
    w.add_head_count_kv(kv)
    w.add_rope_freq_base(c["rope_parameters"]["rope_theta"])
    w.add_layer_norm_rms_eps(c["rms_norm_eps"])
    w.add_key_length(hd)
    w.add_value_length(hd)
    w.add_ssm_conv_kernel(c["linear_conv_kernel_dim"])
    w.add_ssm_state_size(dk)
    w.add_ssm_group_count(kh)
    w.add_ssm_time_step_rank(vh)
    w.add_ssm_inner_size(dv * vh)
    w.add_array(f"{arch}.attention.recurrent_layers", [t == "linear_attention" for t in types])
    w.add_full_attention_interval(c["full_attention_interval"])
    rope = int(hd * c["rope_parameters"]["partial_rotary_factor"])
    w.add_rope_dimension_count(rope)
    w.add_rope_dimension_sections([11, 11, 10, 0] if rope == 64 else [rope // 2, 0, 0, 0])
    w.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    _tokenizer(w, tokenizer_from, c["vocab_size"])
    rng = np.random.default_rng(0)

    def rand(*dims):  # numpy arrays are (out, in)
        return (rng.standard_normal(dims, dtype=np.float32) * 0.02).astype(np.float16)

    ones = lambda k: np.ones(k, dtype=np.float32)  # noqa: E731
    w.add_tensor("token_embd.weight", rand(c["vocab_size"], h))
    w.add_tensor("output_norm.weight", ones(h))
    w.add_tensor("output.weight", rand(c["vocab_size"], h))
    conv = 2 * kh * dk + vh * dv
    for i, kind in enumerate(types):
        b = f"blk.{i}."
        if kind == "linear_attention":
            tensors = dict(attn_qkv=rand(conv, h), attn_gate=rand(vh * dv, h), ssm_alpha=rand(vh, h),
                           ssm_beta=rand(vh, h), ssm_conv1d=rand(conv, c["linear_conv_kernel_dim"]).astype(np.float32),
                           ssm_a=-ones(vh), ssm_dt=np.zeros(vh, np.float32), ssm_norm=ones(dv),
                           ssm_out=rand(h, vh * dv))
        else:
            tensors = dict(attn_q=rand(2 * heads * hd, h), attn_k=rand(kv * hd, h), attn_v=rand(kv * hd, h),
                           attn_output=rand(h, heads * hd), attn_q_norm=ones(hd), attn_k_norm=ones(hd))
        tensors.update(attn_norm=ones(h), post_attention_norm=ones(h))
        if e:
            inter, shared = c["moe_intermediate_size"], c["shared_expert_intermediate_size"]
            tensors.update(ffn_gate_inp=rand(e, h), ffn_gate_exps=rand(e, inter, h), ffn_up_exps=rand(e, inter, h),
                           ffn_down_exps=rand(e, h, inter), ffn_gate_shexp=rand(shared, h), ffn_up_shexp=rand(shared, h),
                           ffn_down_shexp=rand(h, shared), ffn_gate_inp_shexp=rand(1, h).astype(np.float32))
        else:
            inter = c["intermediate_size"]
            tensors.update(ffn_gate=rand(inter, h), ffn_up=rand(inter, h), ffn_down=rand(h, inter))
        for t, value in tensors.items():
            w.add_tensor(b + t + (".bias" if t == "ssm_dt" else "" if t == "ssm_a" else ".weight"), value)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def quantize(llama_python: str, f16: Path, out: Path, qtype: str, embedding_type: int = -1) -> None:
    """``f16`` quantized by llama.cpp to ``qtype`` (``embedding_type``: a GGML type for the table, -1: llama.cpp's)."""
    part = out.with_suffix(".part")
    run = subprocess.run([llama_python, "-c", QUANTIZE, str(f16), str(part), str(FTYPES[qtype]), str(embedding_type)],
                         capture_output=True, text=True)
    if run.returncode:
        raise RuntimeError(f"llama.cpp could not quantize {f16.name} to {qtype}:\n{run.stderr[-2000:]}")
    part.rename(out)


def make(where: Path, model: str, types: list[str], llama_python: str = LLAMA_PYTHON) -> dict[str, Path]:
    """The GGUFs of ``model``'s shapes in each of ``types`` under ``where``, written where missing."""
    from umakit.checkpoint.default import packaged_gguf

    where.mkdir(parents=True, exist_ok=True)
    files = {t: where / f"{model}-shaped.{t}.gguf" for t in types}
    missing = [t for t, f in files.items() if not f.exists()]
    if model == "smollm2-135m":  # a real model: the built-in Q4_1 file, re-quantized by llama.cpp
        for t in missing:
            quantize(llama_python, packaged_gguf(), files[t], t)
        return files
    if missing:
        f16 = where / f"{model}-shaped.F16.gguf"
        if not f16.exists() and model in GEMMA4:
            write_gemma4_f16(f16.with_suffix(".part"), GEMMA4[model], model, packaged_gguf())
            f16.with_suffix(".part").rename(f16)
        if not f16.exists() and model in QWEN35:
            write_qwen35_f16(f16.with_suffix(".part"), QWEN35[model], model, packaged_gguf())
            f16.with_suffix(".part").rename(f16)
        if not f16.exists():
            write_f16(f16.with_suffix(".part"), SHAPES[model], model, packaged_gguf())
            f16.with_suffix(".part").rename(f16)
        for t in missing:
            quantize(llama_python, f16, files[t], t)
    return files


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("dir", type=Path)
    ap.add_argument("--models", nargs="*", default=list(SHAPES), choices=[*SHAPES, *GEMMA4, *QWEN35, "smollm2-135m"],
                    help="shapes to write (gemma4-*, qwen3.5-*: a preset's), or smollm2-135m: the built-in model's "
                         "weights (Q4_1) re-quantized")
    ap.add_argument("--types", nargs="*", default=["Q4_K_M", "Q5_K_M", "Q6_K", "Q8_0"], choices=FTYPES)
    ap.add_argument("--llama-python", default=LLAMA_PYTHON)
    args = ap.parse_args()
    if not Path(args.llama_python).exists():
        sys.exit(f"no {args.llama_python}: llama-cpp-python is llama.cpp's quantizer here (see cpu_engines.py)")
    for model in args.models:
        for path in make(args.dir, model, args.types, args.llama_python).values():
            print(path)


if __name__ == "__main__":
    main()
