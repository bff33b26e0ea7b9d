"""Tiny random checkpoints written by mlx-lm's own model classes (its layout, as mlx-community's files are), for
the families transformers' writer does not give mlx-lm a checkpoint it reads (hybrid models)."""

from __future__ import annotations

import importlib
import json

from support.tiny import VOCAB, write_tokenizer

BASE = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
            head_dim=16, max_position_embeddings=512, rms_norm_eps=1e-6, rope_theta=10000.0,
            tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)
CONFIGS = {
    "qwen3_next": dict(BASE, model_type="qwen3_next", num_hidden_layers=4, full_attention_interval=2,
                       linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=16,
                       linear_value_head_dim=16, linear_conv_kernel_dim=4, num_experts=4, num_experts_per_tok=2,
                       moe_intermediate_size=32, shared_expert_intermediate_size=32, decoder_sparse_step=1,
                       mlp_only_layers=[], norm_topk_prob=True, partial_rotary_factor=0.25, attention_bias=False),
    "lfm2": dict(BASE, model_type="lfm2", num_hidden_layers=3, layer_types=["conv", "full_attention", "conv"],
                 full_attn_idxs=[1], conv_L_cache=3, conv_bias=False, block_dim=64, block_ff_dim=128,
                 block_multiple_of=32, block_ffn_dim_multiplier=1.0, block_auto_adjust_ff_dim=False, norm_eps=1e-5),
}


def make(model_type: str, path):
    import mlx.core as mx
    from mlx.utils import tree_flatten

    module = importlib.import_module(f"mlx_lm.models.{model_type}")
    mx.random.seed(0)
    model = module.Model(module.ModelArgs.from_dict(CONFIGS[model_type]))
    path.mkdir(parents=True)
    mx.save_safetensors(str(path / "model.safetensors"), dict(tree_flatten(model.parameters())))
    (path / "config.json").write_text(json.dumps(CONFIGS[model_type]))
    write_tokenizer(path)
    return path
