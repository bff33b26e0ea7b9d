"""`umakit plan`'s weight bytes against what `umakit quantize` really stores, on mlx-lm's own model classes,
and against a real checkpoint's quantization block (per-layer overrides included)."""

import importlib

import pytest

from umakit.plan import planner as P
from umakit.plan.placement import (
    ROUTED_EXPERTS,
    WHOLE_LAYERS,
    LayerBytes,
    expected_active_experts,
    plan_experts,
    plan_layers,
    streamed_bytes_per_token,
)

BASE = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-6, rope_theta=10000.0, head_dim=16)
FAMILIES = {
    "llama": dict(model_type="llama", tie_word_embeddings=False),
    "qwen2": dict(model_type="qwen2", tie_word_embeddings=True),
    "qwen3": dict(model_type="qwen3", tie_word_embeddings=True),
    "mixtral": dict(model_type="mixtral", tie_word_embeddings=False, num_local_experts=4, num_experts_per_tok=2),
    "qwen3_moe": dict(model_type="qwen3_moe", tie_word_embeddings=False, num_experts=4, num_experts_per_tok=2,
                      moe_intermediate_size=32, decoder_sparse_step=1, mlp_only_layers=[], norm_topk_prob=True),
    "gemma3_text": dict(model_type="gemma3_text", sliding_window=8, query_pre_attn_scalar=16,
                        sliding_window_pattern=2, tie_word_embeddings=True),
    "deepseek_v3": dict(model_type="deepseek_v3", tie_word_embeddings=False, n_routed_experts=4, num_experts_per_tok=2,
                        moe_intermediate_size=32, n_shared_experts=1, first_k_dense_replace=1, kv_lora_rank=32,
                        q_lora_rank=32, qk_rope_head_dim=16, qk_nope_head_dim=16, v_head_dim=16, n_group=2,
                        topk_group=1, topk_method="noaux_tc", scoring_func="sigmoid", routed_scaling_factor=2.5,
                        norm_topk_prob=True, moe_layer_freq=1, num_key_value_heads=4),
}


def _mlx_model(config):
    mx = pytest.importorskip("mlx.core")
    module = importlib.import_module(f"mlx_lm.models.{config['model_type']}")
    model = module.Model(module.ModelArgs.from_dict(config))
    if config["model_type"] == "gemma3_text":
        model.sanitize({})  # a checkpoint without lm_head ties it, as a real Gemma 3 is
    model.set_dtype(mx.float16)
    return model


def _nbytes(model) -> int:
    from mlx.utils import tree_flatten

    return sum(v.nbytes for _, v in tree_flatten(model.parameters()))


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_weight_bytes_are_what_quantize_stores(family):
    from umakit.quantize.recipes import quantize_model

    config = {**BASE, **FAMILIES[family]}
    assert P.plan_model(config).weight_bytes == _nbytes(_mlx_model(config))
    for recipe in ("default", "mixed", "uniform"):
        model = _mlx_model(config)
        block, _ = quantize_model(model, 4, 32, recipe)
        stored = _nbytes(model)
        assert P.plan_model(config, bits=4, group_size=32, recipe=recipe).weight_bytes == stored, recipe
        # the checkpoint it would write, planned from its config.json alone
        from_block = P.plan_model({**config, "quantization": block})
        assert from_block.weight_bytes == stored and from_block.quantization.startswith("checkpoint")


SMOLLM_BLOCK = {"group_size": 32, "bits": 4, "mode": "affine", "model.embed_tokens": {"group_size": 32, "bits": 8}}


def test_the_built_in_model_plans_at_its_real_4_bit_size():
    # the default model's config.json as GGUF import writes it (mlx-lm's block, also as quantization_config)
    config = {**P.load_preset("smollm2-135m"), "quantization": SMOLLM_BLOCK, "quantization_config": SMOLLM_BLOCK}
    p = P.plan_model(config)
    embed, layers, norms = 49152 * 576 * 9 / 8, 30 * (576 * 1152 + 576 * 384 + 3 * 576 * 1536) * 5 / 8, 35136 * 2
    assert p.weight_bytes == embed + layers + norms == 98_275_968  # the file's tensors: 98.35 MB (norms in fp32)
    assert (p.bits, p.embed_bits, p.group_size) == (4, 8, 32)
    assert P.plan_model(P.load_preset("smollm2-135m")).weight_bytes > 2.6 * p.weight_bytes  # 16-bit: 269 MB
    # --bits replans it as quantize would write a float source
    assert P.plan_model(config, bits=8).bits == 8


def test_per_layer_overrides_and_layers_left_float():
    config = {**BASE, **FAMILIES["llama"]}
    plain = P.plan_model({**config, "quantization": {"group_size": 64, "bits": 4}})
    block = {"group_size": 64, "bits": 4, "model.layers.1.mlp.down_proj": {"group_size": 64, "bits": 8},
             "lm_head": False}
    p = P.plan_model({**config, "quantization": block})
    down = 64 * 128
    head = 256 * 64
    assert p.weight_bytes - plain.weight_bytes == down * (8.5 - 4.5) / 8 + head * (16 - 4.5) / 8
    assert p.layers[1].total > p.layers[0].total == p.layers[2].total
    # multimodal checkpoints nest the text model under language_model.
    nested = {k if "." not in k else f"language_model.{k}": v for k, v in block.items()}
    assert P.plan_model({**config, "quantization": nested}).weight_bytes == p.weight_bytes
    # a width the group size does not divide stays float, as the quantizer leaves it
    odd = {**config, "intermediate_size": 96}
    q = P.plan_model({**odd, "quantization": {"group_size": 64, "bits": 4}})
    assert q.weight_bytes > P.plan_model({**odd, "intermediate_size": 128, "quantization": {"group_size": 64,
                                                                                            "bits": 4}}).weight_bytes


def test_streamed_bytes_per_placement():
    dense = [LayerBytes(100), LayerBytes(120)]
    assert streamed_bytes_per_token(dense) == 220
    moe = [LayerBytes(10, 50, 8)] * 3
    assert streamed_bytes_per_token(moe, WHOLE_LAYERS) == 3 * (10 + 8 * 50)  # every expert crosses
    assert streamed_bytes_per_token(moe, ROUTED_EXPERTS, 2.0) == 3 * 2 * 50  # only the routed ones
    assert expected_active_experts(8, 2, 1) == 2
    assert 2 < expected_active_experts(8, 2, 4) < 8
    # plan_layers' streamed bytes are this function's
    assert plan_layers([l.total for l in moe], 0, gpu_layers=1).streamed_bytes == streamed_bytes_per_token(moe[1:])


def test_routed_experts_split():
    layers = [LayerBytes(10, 50, 8)] * 4  # 410 per layer, 400 of it experts
    fixed, reserve = 100, 60
    # dense parts 40 + fixed 100 + reserve 60 + ring of 3 x 2 experts (300) = 500: no layer's experts fit
    assert plan_experts(layers, fixed, vram_budget=500, reserved_bytes=reserve, active_experts=2).gpu_layers == 0
    p = plan_experts(layers, fixed, vram_budget=900, reserved_bytes=reserve, active_experts=2)
    assert p.gpu_layers == 1 and p.placement == ROUTED_EXPERTS
    assert p.streamed_bytes == 3 * 2 * 50 and p.ring_bytes == 3 * 100
    assert p.vram_bytes <= 900
    with pytest.raises(Exception, match="budget"):
        plan_experts(layers, fixed, vram_budget=499, reserved_bytes=reserve, active_experts=2)


def test_mixtral_on_a_24gb_gpu_whole_layers_cross_the_link_with_every_expert():
    from umakit.hardware import lookup_device

    p = P.plan_model(P.load_preset("mixtral-8x7b"), bits=4, context=4096, devices=[lookup_device("RTX 4090 24GB")])
    (d,) = p.devices
    routed, whole = d.offload, d.whole_layers  # the engine's placement, and whole layers for comparison
    assert whole.placement == WHOLE_LAYERS and routed.placement == ROUTED_EXPERTS
    streamed = p.layers[whole.layers_resident:]
    assert whole.streamed_bytes == sum(lb.total for lb in streamed)  # all 8 experts of each streamed layer
    assert routed.streamed_bytes == sum(2 * lb.expert for lb in p.layers[routed.layers_resident:])
    assert whole.ceiling_tps < routed.ceiling_tps
    assert routed.engines == P.offload_engines("mixtral") == ("torch",) and whole.engines == ()
