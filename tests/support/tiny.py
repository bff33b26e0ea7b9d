"""Tiny random-weight checkpoints of real architectures, written by transformers.

No downloads: configs are a few hundred parameters wide, the tokenizer is a
byte-level BPE trained here on a short text, and the chat template is ChatML.
"""

from __future__ import annotations

import json
from pathlib import Path

CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
TRAIN_TEXT = (
    "The quick brown fox jumps over the lazy dog. Paris is the capital of France. "
    "Unified memory lets the GPU read every weight at full bandwidth. Ünïcödé ✓ 東京 🚀 "
) * 20
VOCAB = 512
SPECIALS = ["<unk>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"]

COMMON = dict(
    vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
    bos_token_id=1, eos_token_id=2, rms_norm_eps=1e-6,
)
FAMILIES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", dict(tie_word_embeddings=False, rope_theta=10000.0)),
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(tie_word_embeddings=False, sliding_window=None)),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(tie_word_embeddings=True)),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(tie_word_embeddings=True, head_dim=16)),
    # As transformers v5 writes it: layer_types (and no sliding_window_pattern), one RoPE per layer type
    # (linear scaling on the global layers only); the window is shorter than the tests' prompts.
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", dict(
        head_dim=16, sliding_window=8, query_pre_attn_scalar=24, num_hidden_layers=3,
        layer_types=["sliding_attention", "sliding_attention", "full_attention"],
        rope_parameters={"full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}},
    )),
    # Two experts of four per token; qwen3_moe renormalises the picked weights.
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", dict(
        num_local_experts=4, num_experts_per_tok=2, tie_word_embeddings=False)),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", dict(
        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, head_dim=16, norm_topk_prob=True,
        tie_word_embeddings=False)),
}
ALL_FAMILIES = sorted(FAMILIES)


def write_tokenizer(path: Path, template: str | None = CHATML, extra_specials: tuple[str, ...] = ()) -> None:
    """A byte-level BPE of `VOCAB` tokens; ``extra_specials`` (``<tool_call>``, say) become added tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB, special_tokens=SPECIALS + list(extra_specials),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator([TRAIN_TEXT], trainer)
    tok.save(str(path / "tokenizer.json"))
    config = {"bos_token": "<s>", "eos_token": "<|im_end|>", "add_bos_token": False}
    if template is not None:
        config["chat_template"] = template
    (path / "tokenizer_config.json").write_text(json.dumps(config))


def make_tiny_model(family: str, path: Path, seed: int = 0, **overrides) -> Path:
    """Write a random ``family`` model with save_pretrained plus a tokenizer; return ``path``.

    ``overrides`` change config fields (e.g. ``num_hidden_layers=5``).
    """
    import torch
    import transformers

    cfg_name, model_name, extra = FAMILIES[family]
    config = getattr(transformers, cfg_name)(**{**COMMON, **extra, **overrides})
    torch.manual_seed(seed)
    model = getattr(transformers, model_name)(config)
    with torch.no_grad():  # random norms too, so a missing norm weight would show
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(torch.randn_like(p) * 0.1 + (0.0 if family == "gemma3" else 1.0))
            elif name.endswith(".gate.weight"):  # a router: decisive logits, so the experts picked matter
                p.mul_(20)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path, safe_serialization=True)
    write_tokenizer(path)
    return path
