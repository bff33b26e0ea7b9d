"""Tiny GGUF files, written with gguf.GGUFWriter, and the oracles the GGUF tests read them with: the `gguf`
package's dequantization, transformers' GGUF loader, mlx-lm."""

import json
from pathlib import Path

import gguf
import mlx.core as mx
import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as T
from gguf import quants as gguf_quants

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
MERGES = ["Ġ t", "h e", "Ġt he", "i n", "Ġ a", "Ġa n", "Ġan d", "e r", "o n", "Ġ w", "Ġ s", "r e", "Ġ c", "a t"]
HIDDEN, FFN = 256, 512  # K-quant rows must be multiples of 256
# arch -> heads, kv heads, head_dim. transformers' GGUF loader does not read head_dim for
# qwen3 and gemma3 (it keeps the defaults 128 and 256, what the real models use), so neither do we.
SHAPES = {"llama": (4, 2, 64), "qwen2": (4, 2, 64), "qwen3": (4, 2, 128), "gemma3": (2, 1, 256)}
# A mix of every exact type per layer; transformers reads all of these, so it can be the oracle.
EXACT_LAYERS = [
    dict(attn_q=T.Q4_0, attn_k=T.Q4_1, attn_v=T.Q8_0, attn_output=T.Q4_K, ffn_gate=T.Q5_K, ffn_up=T.F16,
         ffn_down=T.Q4_K),
    dict(attn_q=T.Q4_K, attn_k=T.Q5_K, attn_v=T.F16, attn_output=T.Q4_0, ffn_gate=T.Q4_1, ffn_up=T.BF16,
         ffn_down=T.F32),
]
LOSSY_LAYERS = [
    dict(attn_q=T.Q6_K, attn_k=T.Q2_K, attn_v=T.Q3_K, attn_output=T.IQ4_NL, ffn_gate=T.Q4_0, ffn_up=T.Q4_0,
         ffn_down=T.Q6_K),
]
D_FIELDS = {  # offset and magnitude of the float16 super-scales in blocks built from random bytes
    T.Q4_K: ((0, 1e-4), (2, 1e-4)), T.Q5_K: ((0, 5e-5), (2, 5e-5)), T.Q2_K: ((80, 2e-3), (82, 2e-3)),
    T.Q3_K: ((108, 5e-4),), T.Q6_K: ((208, 2e-5),), T.IQ4_NL: ((0, 5e-4),),
}


def _byte_alphabet():
    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
    extra = iter(range(256, 512))
    return [chr(b) if b in printable else chr(next(extra)) for b in range(256)]


def tensor_data(qtype, rows, cols, rng, std=0.05, mean=0.0):
    if qtype in (T.F32, T.F16):
        return rng.normal(mean, std, (rows, cols)).astype(np.float32 if qtype == T.F32 else np.float16)
    if qtype in D_FIELDS:
        block, size = GGML_QUANT_SIZES[qtype]
        blocks = rng.integers(0, 256, (rows * cols // block, size), dtype=np.uint8)
        for offset, scale in D_FIELDS[qtype]:
            d = (rng.uniform(0.5, 1.0, len(blocks)) * scale).astype(np.float16)
            blocks[:, offset : offset + 2] = d.view(np.uint8).reshape(-1, 2)
        return blocks.reshape(rows, -1)
    return gguf_quants.quantize(rng.normal(mean, std, (rows, cols)).astype(np.float32), qtype)


def write_gguf(path, arch="llama", layers=EXACT_LAYERS, tied=True, embed=T.Q8_0, output=T.Q6_K, seed=0,
               tokenizer="gpt2", tensor_arch=None, rope_theta=10000.0, extra_meta=(), extra_tensors=()):
    """A tiny random model in llama.cpp's layout and naming; returns ``path``."""
    rng = np.random.default_rng(seed)
    heads, kv, head_dim = SHAPES.get(tensor_arch or arch, SHAPES["llama"])
    tokens = SPECIALS + _byte_alphabet() + [m.replace(" ", "") for m in MERGES]
    w = gguf.GGUFWriter(str(path), arch)
    w.add_uint32(f"{arch}.block_count", len(layers))
    w.add_uint32(f"{arch}.context_length", 2048)
    w.add_uint32(f"{arch}.embedding_length", HIDDEN)
    w.add_uint32(f"{arch}.feed_forward_length", FFN)
    w.add_uint32(f"{arch}.attention.head_count", heads)
    w.add_uint32(f"{arch}.attention.head_count_kv", kv)
    w.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)
    w.add_float32(f"{arch}.rope.freq_base", rope_theta)
    for key, value in extra_meta:
        w.add_key_value(key.format(arch=arch), value, *value_types(value))
    w.add_uint32(f"{arch}.vocab_size", len(tokens))
    if arch == "llama":
        w.add_uint32(f"{arch}.rope.dimension_count", head_dim)
    else:
        w.add_uint32(f"{arch}.attention.key_length", head_dim)
        w.add_uint32(f"{arch}.attention.value_length", head_dim)
    if arch == "gemma3":
        w.add_uint32(f"{arch}.attention.sliding_window", 512)
    w.add_tokenizer_model(tokenizer)
    w.add_tokenizer_pre("smollm")
    w.add_token_list(tokens)
    w.add_token_types([3 if t in SPECIALS else 1 for t in tokens])
    w.add_token_merges(MERGES)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_add_bos_token(False)
    w.add_chat_template(CHAT_TEMPLATE)

    norm_mean = 1.0  # llama.cpp stores Gemma's norms as w + 1; values near 1 suit every family

    def add(name, qtype, rows, cols):
        data = tensor_data(qtype, rows, cols, rng)
        w.add_tensor(name, data, raw_dtype=qtype if data.dtype == np.uint8 else None)

    add("token_embd.weight", embed, len(tokens), HIDDEN)
    if not tied:
        add("output.weight", output, len(tokens), HIDDEN)
    w.add_tensor("output_norm.weight", tensor_data(T.F32, 1, HIDDEN, rng, 0.1, norm_mean)[0])
    dims = dict(attn_q=(heads * head_dim, HIDDEN), attn_k=(kv * head_dim, HIDDEN), attn_v=(kv * head_dim, HIDDEN),
                attn_output=(HIDDEN, heads * head_dim), ffn_gate=(FFN, HIDDEN), ffn_up=(FFN, HIDDEN),
                ffn_down=(HIDDEN, FFN))
    norms = ["attn_norm", "ffn_norm"]
    norms += {"gemma3": ["post_attention_norm", "post_ffw_norm"]}.get(arch, [])
    for i, types in enumerate(layers):
        for name, qtype in types.items():
            add(f"blk.{i}.{name}.weight", qtype, *dims[name])
        for name in norms:
            w.add_tensor(f"blk.{i}.{name}.weight", tensor_data(T.F32, 1, HIDDEN, rng, 0.1, norm_mean)[0])
        if arch in ("qwen3", "gemma3"):
            for name in ("attn_q_norm", "attn_k_norm"):
                w.add_tensor(f"blk.{i}.{name}.weight", tensor_data(T.F32, 1, head_dim, rng, 0.1, 1.0)[0])
        if arch == "qwen2":
            for name in ("attn_q", "attn_k", "attn_v"):
                w.add_tensor(f"blk.{i}.{name}.bias", tensor_data(T.F32, 1, dims[name][0], rng, 0.05)[0])
    for name, data in extra_tensors:
        w.add_tensor(name, data)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return Path(path)


def with_metadata(src, dst, typed=(), **changes):
    """A copy of the GGUF ``src`` at ``dst`` with metadata keys changed or added (``{arch}`` in a key: the file's
    architecture; the value's GGUF types as `value_types` picks them, or as given: ``typed`` holds (key, value,
    type, item type) entries) and every tensor as stored; returns ``dst``."""
    reader = gguf.GGUFReader(src)
    arch = reader.fields["general.architecture"].contents()
    changes = {k.format(arch=arch): v for k, v in changes.items()}
    w = gguf.GGUFWriter(str(dst), arch)
    for k, field in reader.fields.items():
        if not k.startswith(("GGUF.", "general.architecture")) and k not in changes:
            w.add_key_value(k, field.contents(), field.types[0], field.types[-1] if len(field.types) > 1 else None)
    for k, v in changes.items():
        w.add_key_value(k, v, *value_types(v))
    for k, v, kind, item in typed:
        w.add_key_value(k, v, kind, item)
    for t in reader.tensors:
        w.add_tensor(t.name, np.asarray(t.data), raw_dtype=t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return dst


def value_types(value):
    kinds = {str: gguf.GGUFValueType.STRING, float: gguf.GGUFValueType.FLOAT32, int: gguf.GGUFValueType.UINT32,
             bool: gguf.GGUFValueType.BOOL}
    if isinstance(value, list):
        return gguf.GGUFValueType.ARRAY, kinds[type(value[0])]
    return (kinds[type(value)],)


def mlx_forward(model_dir, ids):
    """Logits of mlx-lm's model for the directory, computed in float32."""
    from mlx.utils import tree_map
    from mlx_lm.utils import load_model

    model, _ = load_model(Path(model_dir))
    model.update(tree_map(lambda x: x.astype(mx.float32) if x.dtype in (mx.float16, mx.bfloat16) else x,
                          model.parameters()))
    return np.array(model(mx.array([ids]))[0])


def hf_forward(gguf_path, ids):
    pytest.importorskip("accelerate", reason="transformers needs accelerate to load GGUF files")
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        str(gguf_path.parent), gguf_file=gguf_path.name, dtype=torch.float32
    )
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].numpy()


def stored_values(model_dir):
    """Every stored weight as float32 values, dequantized by MLX for quantized ones; the 8-bit copies of Q6_K
    layers as the first load that reads them makes them (`Checkpoint.complete`)."""
    from umakit.checkpoint.files import open_checkpoint

    arrays = {}
    for f in open_checkpoint(model_dir).complete().files:
        arrays.update(mx.load(str(f)))
    config = json.loads((model_dir / "config.json").read_text())
    q = config.get("quantization", {})
    out = {}
    for name, arr in arrays.items():
        if name.endswith((".scales", ".biases")):
            continue
        module = name.removesuffix(".weight")
        if f"{module}.scales" in arrays:
            spec = q.get(module, q)
            arr = mx.dequantize(arr, arrays[f"{module}.scales"].astype(mx.float32),
                                arrays[f"{module}.biases"].astype(mx.float32),
                                group_size=spec["group_size"], bits=spec["bits"])
        out[name] = np.array(arr.astype(mx.float32))
    return out


def reverse_permute(w, n_head):
    """transformers' inverse of llama.cpp's Q/K permutation, written out independently."""
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def hf_name_of(name, arch):
    from umakit.checkpoint.gguf.arch import SPECS

    return SPECS[arch].rename(name)


IDS = [1, 40, 120, 260, 7, 99, 3, 270, 15, 200, 31]


# llama.cpp's LLAMA_FTYPE_MOSTLY_* numbers of the types users download most
LLAMA_FTYPES = {"Q4_0": 2, "Q4_1": 3, "Q8_0": 7, "Q5_0": 8, "Q5_1": 9, "Q4_K_M": 15, "Q5_K_M": 17, "Q6_K": 18}
_QUANTIZE = """
import sys, llama_cpp
p = llama_cpp.llama_model_quantize_default_params()
p.ftype, p.nthread = int(sys.argv[3]), 1
sys.exit(llama_cpp.llama_model_quantize(sys.argv[1].encode(), sys.argv[2].encode(), p))
"""


def llama_quantize(llama_python, src, dst, ftype: str):
    """``src`` (a float GGUF) quantized by llama.cpp's own quantizer to ``ftype``, with its default mix per tensor."""
    import subprocess

    run = subprocess.run([llama_python, "-c", _QUANTIZE, str(src), str(dst), str(LLAMA_FTYPES[ftype])],
                         capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-2000:]
    return Path(dst)
