"""gemma4 GGUFs as llama.cpp writes them, from tiny checkpoints saved by the installed transformers: written here
with gguf.GGUFWriter following llama.cpp's converter (conversion/gemma.py, `Gemma4Model`: the tensor names from the
gguf package's own name map, per-layer key/value heads and feed-forward widths, the global layers' RoPE as a
``rope_freqs`` tensor, the SentencePiece-style vocabulary as ``gemma4``), or by that converter itself where
llama.cpp's sources are on this machine (`gguf_gpt_oss.llama_cpp_convert`)."""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
from gguf import GGMLQuantizationType as T

from support.gguf_files import D_FIELDS, tensor_data
from support.tiny import TRAIN_TEXT, VOCAB

ARCH = "gemma4"
SPECIALS = ["<pad>", "<bos>", "<eos>", "<unk>", "<start_of_turn>", "<end_of_turn>"]
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<start_of_turn>{{ m['role'] }}\n{{ m['content'] }}<end_of_turn>\n"
    "{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)
# the converter's own renamings, past the gguf package's name map (conversion/gemma.py, Gemma4Model)
_SPECIAL_NAMES = {"router.scale": "ffn_gate_inp.scale", "router.per_expert_scale": "ffn_down_exps.scale"}


def write_tokenizer(path: Path) -> None:
    """A SentencePiece-style BPE as gemma's tokenizer.json has it: spaces as "▁", byte fallback, special
    tokens added whole."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, processors, trainers

    tok = Tokenizer(models.BPE(byte_fallback=True, unk_token="<unk>", fuse_unk=True))
    tok.normalizer = normalizers.Replace(" ", "▁")
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()])
    byte_tokens = [f"<0x{b:02X}>" for b in range(256)]
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=SPECIALS + byte_tokens)
    tok.train_from_iterator([TRAIN_TEXT.replace("\n", " ")], trainer)
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIALS])
    tok.post_processor = processors.TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", 1)])
    tok.save(str(path / "tokenizer.json"))
    config = {"bos_token": "<bos>", "eos_token": "<end_of_turn>", "pad_token": "<pad>", "unk_token": "<unk>",
              "add_bos_token": True, "chat_template": CHAT_TEMPLATE}
    (path / "tokenizer_config.json").write_text(json.dumps(config))


def _add_tokenizer(w, checkpoint: Path) -> None:
    tok = json.loads((checkpoint / "tokenizer.json").read_text())
    tok_config = json.loads((checkpoint / "tokenizer_config.json").read_text())
    vocab = tok["model"]["vocab"]
    tokens = sorted(vocab, key=vocab.get)
    types = [3 if t in SPECIALS else 6 if t.startswith("<0x") and len(t) == 6 else 1 for t in tokens]
    w.add_tokenizer_model("gemma4")
    w.add_token_list(tokens)
    w.add_token_scores([-1000.0] * len(tokens))  # what the converter stores (LlamaHfVocab)
    w.add_token_types(types)
    w.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]])
    for name in ("bos", "eos", "unk", "pad"):
        getattr(w, f"add_{name}_token_id")(vocab[tok_config[f"{name}_token"]])
    w.add_add_bos_token(True)
    w.add_add_space_prefix(False)
    w.add_chat_template(tok_config["chat_template"])


def _heads(config: dict) -> tuple[list[int], list[int]]:
    """Each layer's key/value heads and head size, as transformers reads them (``per_layer_config``)."""
    per = {int(k): v for k, v in (config.get("per_layer_config") or {}).items()}
    kv = [per.get(i, {}).get("num_key_value_heads", config["num_key_value_heads"])
          for i in range(config["num_hidden_layers"])]
    dims = [per.get(i, {}).get("head_dim", config["head_dim"]) for i in range(config["num_hidden_layers"])]
    return kv, dims


def _metadata(w, config: dict) -> None:
    n, types = config["num_hidden_layers"], config["layer_types"]
    kv, dims = _heads(config)
    full = types.index("full_attention")
    shared = config.get("num_kv_shared_layers") or 0
    ffn = config["intermediate_size"]
    w.add_block_count(n)
    w.add_context_length(config["max_position_embeddings"])
    w.add_embedding_length(config["hidden_size"])
    if config.get("use_double_wide_mlp"):
        w.add_feed_forward_length([ffn if i < n - shared else 2 * ffn for i in range(n)])
    else:
        w.add_feed_forward_length(ffn)
    w.add_head_count(config["num_attention_heads"])
    w.add_head_count_kv(kv if len(set(kv)) > 1 else kv[0])
    rope = config["rope_parameters"]
    w.add_rope_freq_base(rope["full_attention"]["rope_theta"])
    w.add_rope_freq_base_swa(rope["sliding_attention"]["rope_theta"])
    w.add_layer_norm_rms_eps(config["rms_norm_eps"])
    w.add_key_length(dims[full])
    w.add_value_length(dims[full])
    w.add_key_length_swa(config["head_dim"])
    w.add_value_length_swa(config["head_dim"])
    if config.get("final_logit_softcapping"):
        w.add_final_logit_softcapping(config["final_logit_softcapping"])
    w.add_sliding_window(config["sliding_window"])
    w.add_shared_kv_layers(shared)
    w.add_embedding_length_per_layer_input(config.get("hidden_size_per_layer_input") or 0)
    w.add_sliding_window_pattern([t == "sliding_attention" for t in types])
    w.add_rope_dimension_count(dims[full])
    w.add_rope_dimension_count_swa(config["head_dim"])
    if config.get("enable_moe_block"):
        w.add_expert_count(config["num_experts"])
        w.add_expert_used_count(config["top_k_experts"])
        w.add_expert_feed_forward_length(config["moe_intermediate_size"])


def _gguf_name(hf: str, names) -> str:
    if (m := hf.split(".")) and m[0] == "model" and m[1] == "layers":
        tail = ".".join(m[3:])
        if tail in _SPECIAL_NAMES:
            return f"blk.{m[2]}.{_SPECIAL_NAMES[tail]}"
    name = names.get_name(hf, try_suffixes=(".weight", ".bias"))
    assert name is not None, hf
    return name if name.endswith((".weight", ".bias")) else name + ".weight"  # layer_scalar, the expert stacks


def write_gguf(checkpoint: Path, out: Path, dense=T.F32, experts=T.F32, seed: int = 0) -> Path:
    """The checkpoint as llama.cpp's converter writes it; ``dense``: the type of the 2-D weights (F32, Q8_0, Q4_0:
    the gguf package's quantization), ``experts``: the expert stacks' (those, or a type of `D_FIELDS` as random
    blocks, whose values then replace the checkpoint's); `dequantized_twin` writes the float model a quantized
    file is."""
    from safetensors.numpy import load_file

    config = json.loads((checkpoint / "config.json").read_text())
    st = load_file(checkpoint / "model.safetensors")
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.GEMMA4, config["num_hidden_layers"])
    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(str(out), ARCH)
    _metadata(w, config)
    _add_tokenizer(w, checkpoint)
    _, dims = _heads(config)
    turned = int(dims[config["layer_types"].index("full_attention")]
                 * config["rope_parameters"]["full_attention"]["partial_rotary_factor"] / 2)
    half = dims[config["layer_types"].index("full_attention")] // 2
    w.add_tensor("rope_freqs.weight", np.array([1.0] * turned + [1e30] * (half - turned), dtype=np.float32))
    for hf, data in st.items():
        stacked = data.ndim == 3
        qtype = experts if stacked else dense if data.ndim == 2 and not hf.endswith("router.proj.weight") else T.F32
        name = _gguf_name(hf, names)
        if qtype == T.F32:
            w.add_tensor(name, np.ascontiguousarray(data, dtype=np.float32))
            continue
        rows = data.reshape(-1, data.shape[-1]).astype(np.float32)
        if rows.shape[1] % gguf.GGML_QUANT_SIZES[qtype][0]:  # as llama.cpp does, rows too short stay float
            w.add_tensor(name, np.ascontiguousarray(data, dtype=np.float32))
            continue
        if qtype in D_FIELDS:  # no quantizer in the gguf package: random blocks
            blocks = tensor_data(qtype, rows.shape[0], rows.shape[1], rng)
        else:
            blocks = gguf.quants.quantize(rows, qtype)
        w.add_tensor(name, blocks.reshape(*data.shape[:-1], -1), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


def dequantized_twin(src: Path, checkpoint: Path, out: Path) -> Path:
    """``checkpoint`` with every weight replaced by the GGUF's (dequantized by the gguf package): the float model
    the GGUF's quantized weights are."""
    import shutil

    from safetensors.numpy import load_file, save_file

    shutil.copytree(checkpoint, out)
    st = load_file(checkpoint / "model.safetensors")
    config = json.loads((checkpoint / "config.json").read_text())
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.GEMMA4, config["num_hidden_layers"])
    tensors = {t.name: t for t in gguf.GGUFReader(src).tensors}
    twin = {}
    for hf, data in st.items():
        t = tensors[_gguf_name(hf, names)]
        values = gguf.quants.dequantize(np.asarray(t.data), t.tensor_type).astype(np.float32)
        twin[hf] = np.ascontiguousarray(values.reshape(data.shape))
    save_file(twin, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out
