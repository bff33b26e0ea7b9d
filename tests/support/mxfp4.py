"""A tiny gpt-oss checkpoint in OpenAI's own layout: the routed experts in MXFP4 (``*_blocks``: FP4 E2M1 codes,
two a byte, the low nibble first; ``*_scales``: an E8M0 exponent per 32 weights, biased by 127), everything else
float, and ``quantization_config`` {"quant_method": "mxfp4"}, as openai/gpt-oss-20b ships.

The packer is this file's; the format's reading is transformers' own (``convert_moe_packed_tensors``), which the
tests hold umakit's engines to."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from support.tiny import VOCAB, write_tokenizer

E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])  # codes 0-7; 8-15 the same, negative
NOT_CONVERTED = ["model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]
CONFIG = dict(
    vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
    head_dim=16, max_position_embeddings=512, bos_token_id=1, eos_token_id=2, pad_token_id=0,
    num_hidden_layers=2, num_local_experts=4, num_experts_per_tok=2, sliding_window=8,
    layer_types=["sliding_attention", "full_attention"],
    # gpt-oss's own RoPE: yarn with its blend's range unrounded (truncate false)
    rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 4.0, "beta_fast": 32.0,
                     "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 128},
)


def pack(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(..., n) float -> blocks (..., n / 32, 16) uint8 and scales (..., n / 32) uint8: each 32 weights over the
    smallest power of two that brings their largest within 6, rounded to the nearest E2M1 value."""
    *lead, n = w.shape
    g = w.float().reshape(*lead, n // 32, 32)
    top = g.abs().amax(-1, keepdim=True).clamp(min=2.0 ** -120)
    exponent = torch.ceil(torch.log2(top / 6.0))
    v = g / torch.exp2(exponent)
    code = (v.abs()[..., None] - E2M1).abs().argmin(-1)
    code = (code + 8 * ((v < 0) & (code > 0))).to(torch.uint8)
    blocks = code[..., 0::2] | (code[..., 1::2] << 4)
    return blocks, (exponent.squeeze(-1) + 127).to(torch.uint8)


def write(path: Path, seed: int = 0, packed: bool = True, **overrides) -> Path:
    """A random tiny gpt-oss at ``path`` with MXFP4 experts (``packed``; else all float, as transformers saves a
    float gpt-oss); its routers made decisive, so a wrong expert shows. ``overrides`` change `CONFIG`'s fields."""
    import transformers
    from safetensors.torch import save_file

    torch.manual_seed(seed)
    model = transformers.GptOssForCausalLM(transformers.GptOssConfig(**{**CONFIG, **overrides}))
    path.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for name, p in model.state_dict().items():
        if name.endswith(".router.weight"):
            p = p * 20
        if packed and name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            # transformers holds them (experts, in, out); the checkpoint (experts, out, in / 32, 16)
            tensors[name + "_blocks"], tensors[name + "_scales"] = pack(p.transpose(1, 2))
        else:
            tensors[name] = p.contiguous()
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    config = model.config.to_dict()
    if packed:
        config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": NOT_CONVERTED}
    (path / "config.json").write_text(json.dumps(config, indent=1))
    write_tokenizer(path)
    return path


def dequantized(path: Path) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors as transformers reads them with its MXFP4 dequantized (float32, its names)."""
    from safetensors.torch import load_file
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    stored = load_file(path / "model.safetensors")
    out = {}
    for name, t in stored.items():
        if name.endswith("_blocks"):
            base = name.removesuffix("_blocks")
            out[base] = convert_moe_packed_tensors(t, stored[base + "_scales"], dtype=torch.float32)
        elif not name.endswith("_scales"):
            out[name] = t.float()
    return out


def reference(path: Path):
    """transformers' float32 model of the checkpoint, its MXFP4 dequantized at load."""
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, quantization_config=transformers.Mxfp4Config(dequantize=True)).eval()


