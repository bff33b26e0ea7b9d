"""gpt-oss GGUFs (llama.cpp's ``gpt-oss`` architecture) back in OpenAI's own layout.

llama.cpp's converter splits OpenAI's fused ``gate_up_proj`` (gate and up interleaved along its rows: row 2i is
gate row i, row 2i + 1 up row i) into ``ffn_gate_exps`` and ``ffn_up_exps``, and repacks each MXFP4 block as
ggml's ``block_mxfp4``: the E8M0 exponent byte, then 16 bytes whose low nibbles are elements 0-15 and high nibbles
16-31, where OpenAI keeps exponents apart (``*_scales``) and packs elements 2i, 2i + 1 in byte i, low nibble
first. The codes and exponents are the same numbers in both, so turning the blocks back is a byte shuffle and
the experts stay exactly as OpenAI shipped them; umakit's engines load that layout already (hfquant/detect.py).
"""

from __future__ import annotations

import re

import numpy as np

from umakit.errors import UnsupportedModelError
from umakit.checkpoint.gguf.reader import GGUFFile

BLOCK, BLOCK_BYTES = 32, 17  # ggml's block_mxfp4: 32 weights in an exponent byte and 16 bytes of codes
EXPERTS_RE = re.compile(r"^blk\.(\d+)\.ffn_(gate|up|down)_exps\.(weight|bias)$")
_BLOCK = {
    "attn_norm": "input_layernorm",
    "post_attention_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate_inp": "mlp.router",
}
_GLOBAL = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_NAME_RE = re.compile(r"^blk\.(\d+)\.([a-z_]+)\.(weight|bias)$")
# OpenAI's SwiGLU constants, which llama.cpp hard-codes (LLM_FFN_SWIGLU_OAI_MOE) rather than stores
SWIGLU_ALPHA, SWIGLU_LIMIT = 1.702, 7.0


def gpt_oss_name(name: str) -> str | None:
    """HF name of a gpt-oss GGUF tensor other than the routed experts (`experts` makes those), or None."""
    if m := _NAME_RE.match(name):
        layer, part, kind = m.groups()
        if part == "attn_sinks" and kind == "weight":  # llama.cpp adds ".weight"; transformers' is a bare parameter
            return f"model.layers.{layer}.self_attn.sinks"
        if part in _BLOCK:
            return f"model.layers.{layer}.{_BLOCK[part]}.{kind}"
        return None
    stem, _, kind = name.partition(".")
    return f"{_GLOBAL[stem]}.{kind}" if stem in _GLOBAL and kind in ("weight", "bias") else None


def gpt_oss_config(gf: GGUFFile, config: dict) -> dict:
    """transformers' GptOssConfig fields (as OpenAI's config.json spells them) from llama.cpp's metadata and the
    hyperparameters every family shares (``config``, `arch.base_config`'s)."""
    n_layers = config["num_hidden_layers"]
    config.pop("rope_scaling", None)
    factor = gf.get("{arch}.rope.scaling.factor")
    if gf.get("{arch}.rope.scaling.type", "yarn") != "yarn" or not factor:
        raise UnsupportedModelError(f"{gf.path.name}: a gpt-oss model without yarn RoPE scaling is not supported")
    config.update(
        intermediate_size=int(gf.get("{arch}.expert_feed_forward_length") or config["intermediate_size"]),
        num_local_experts=int(gf.require("{arch}.expert_count")),
        num_experts_per_tok=int(gf.require("{arch}.expert_used_count")),
        sliding_window=int(gf.require("{arch}.attention.sliding_window")),
        layer_types=["sliding_attention" if s else "full_attention" for s in _sliding_layers(gf, n_layers)],
        # llama.cpp always rounds yarn's blend range; OpenAI's models do not (truncate false), as transformers reads
        rope_scaling={
            "rope_type": "yarn",
            "factor": float(factor),
            "original_max_position_embeddings": int(gf.require("{arch}.rope.scaling.original_context_length")),
            "beta_fast": float(gf.get("{arch}.rope.scaling.yarn_beta_fast", 32.0)),
            "beta_slow": float(gf.get("{arch}.rope.scaling.yarn_beta_slow", 1.0)),
            "truncate": False,
        },
        attention_bias=True,
        swiglu_alpha=SWIGLU_ALPHA,
        swiglu_limit=SWIGLU_LIMIT,
        quantization_config={"quant_method": "mxfp4", "modules_to_not_convert": [
            "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]},
    )
    return config


def _sliding_layers(gf: GGUFFile, n_layers: int) -> list[bool]:
    """Which layers attend in the sliding window: llama.cpp's ``sliding_window_pattern`` (a flag per layer, or a
    period whose last layer is global), by default 2: even layers sliding, odd ones global."""
    pattern = gf.get("{arch}.attention.sliding_window_pattern", 2)
    if isinstance(pattern, list):
        if len(pattern) != n_layers:
            raise UnsupportedModelError(f"{gf.path.name}: sliding_window_pattern has {len(pattern)} entries for "
                                        f"{n_layers} layers")
        return [bool(p) for p in pattern]
    pattern = int(pattern)
    return [pattern == 0 or i % pattern < pattern - 1 for i in range(n_layers)]


def check_experts(gf: GGUFFile) -> set[str]:
    """The GGUF names of the routed experts' tensors, each checked; an error names any that is not MXFP4."""
    from gguf import GGMLQuantizationType as T

    names = {n for n in gf.tensors if EXPERTS_RE.match(n)}
    for name in sorted(names):
        t = gf.tensors[name]
        want = T.MXFP4 if name.endswith(".weight") else T.F32
        if t.tensor_type != want:
            raise UnsupportedModelError(f"{gf.path.name}: gpt-oss expert tensor {name} is {t.tensor_type.name}; "
                                        f"only {want.name} is supported")
    layers = {int(EXPERTS_RE.match(n).group(1)) for n in names}
    for layer in sorted(layers):
        for part in ("gate", "up", "down"):
            for kind in ("weight", "bias"):
                if f"blk.{layer}.ffn_{part}_exps.{kind}" not in names:
                    raise UnsupportedModelError(f"{gf.path.name}: tensor blk.{layer}.ffn_{part}_exps.{kind} is "
                                                f"missing")
    return names


def openai_blocks(data: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """ggml MXFP4 bytes (experts, rows, cols / 32 * 17) -> OpenAI's blocks (experts, rows, cols / 32, 16) and
    scales (experts, rows, cols / 32), both uint8."""
    experts, rows, width = data.shape
    b = np.ascontiguousarray(data).reshape(experts, rows, width // BLOCK_BYTES, BLOCK_BYTES)
    qs = b[..., 1:]
    codes = np.concatenate([qs & 0x0F, qs >> 4], axis=-1)  # (..., 32): element j of the block
    return np.ascontiguousarray(codes[..., 0::2] | (codes[..., 1::2] << 4)), np.ascontiguousarray(b[..., 0])


def _interleave(gate: np.ndarray, up: np.ndarray) -> np.ndarray:
    """(experts, n, ...) twice -> (experts, 2n, ...): gate's rows at even places, up's at odd (OpenAI's order)."""
    out = np.empty((gate.shape[0], 2 * gate.shape[1], *gate.shape[2:]), dtype=gate.dtype)
    out[:, 0::2], out[:, 1::2] = gate, up
    return out


def experts(gf: GGUFFile) -> dict[str, np.ndarray]:
    """Every layer's routed experts in OpenAI's names and layout, exactly."""
    out = {}
    layers = sorted({int(EXPERTS_RE.match(n).group(1)) for n in gf.tensors if EXPERTS_RE.match(n)})
    for layer in layers:
        t = {part: gf.tensors[f"blk.{layer}.ffn_{part}_exps.weight"] for part in ("gate", "up", "down")}
        bias = {part: np.asarray(gf.tensors[f"blk.{layer}.ffn_{part}_exps.bias"].data, dtype=np.float32)
                for part in ("gate", "up", "down")}
        (gate, gate_s), (up, up_s) = openai_blocks(np.asarray(t["gate"].data)), openai_blocks(np.asarray(t["up"].data))
        down, down_s = openai_blocks(np.asarray(t["down"].data))
        stem = f"model.layers.{layer}.mlp.experts"
        out.update({
            f"{stem}.gate_up_proj_blocks": _interleave(gate, up),
            f"{stem}.gate_up_proj_scales": _interleave(gate_s, up_s),
            f"{stem}.gate_up_proj_bias": np.ascontiguousarray(_interleave(bias["gate"], bias["up"])),
            f"{stem}.down_proj_blocks": down,
            f"{stem}.down_proj_scales": down_s,
            f"{stem}.down_proj_bias": np.ascontiguousarray(bias["down"]),
        })
    return out
