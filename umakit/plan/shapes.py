"""A decoder-only transformer's shapes from its config.json, and the memory they set besides the
weights: the KV cache and the working memory of a prefill chunk. `umakit plan` and the offload
planner (what an engine keeps in VRAM next to the weights) count them with these functions.

Formulas (sizes in bytes, B = batch, everything 16-bit unless said):

* KV cache: 2 x L x H_kv x D x bytes per element x context x B; layers with a
  sliding window keep at most ``window`` tokens. gemma4's layers differ: each
  kind its own H_kv and D, and layers that share an earlier layer's keys and
  values cache none (`cached_layers`). Multi-head latent attention
  (DeepSeek-V2/V3) caches one compressed vector per token and layer instead:
  (kv_lora_rank + qk_rope_head_dim) elements.
* working memory (an upper bound; fused attention kernels need less):
  fp32 logits (vocab x 4 x B) + four hidden-size buffers, q/k/v and the MLP
  gate/up activations for a prefill chunk of `PREFILL_CHUNK` tokens + the
  attention scores of one layer for that chunk against the whole context
  (what an unfused attention materialises; fused kernels need no score matrix).
"""

from __future__ import annotations

from dataclasses import dataclass

from umakit.core.gemma4_layers import GEMMA4, Gemma4Layers, gemma4_layers
from umakit.core.affine import KV_GROUP_SIZE
from umakit.errors import ConfigError, UnsupportedModelError
from umakit.plan.roofline import kv_bytes_per_token

PREFILL_CHUNK = 512  # tokens per prefill chunk, every engine: bounds attention memory on long prompts
# The first chunk of a prefill that Ctrl-C may stop (the chat): small enough that a CPU finishes it in
# about 0.1-0.3 s at a few thousand tokens of context; later chunks grow towards PREFILL_CHUNK on fast devices.
INTERRUPT_PREFILL_CHUNK = 16
# The context a GPU engine sizes its KV cache for up front, and what its offload budget (and so
# `umakit plan`'s offload split) reserves next to the weights; a longer context grows the cache later.
KV_RESERVE_TOKENS = 4096
FLOAT_BYTES = 2  # bf16/fp16 activations, norms and unquantized weights
# Defaults that Hugging Face config classes fill in when config.json omits them.
_TYPE_DEFAULTS = {
    "gemma": {"tie_word_embeddings": True},
    "gemma2": {"tie_word_embeddings": True, "sliding_window_pattern": 2},
    "gemma3_text": {"tie_word_embeddings": True, "vocab_size": 262208, "sliding_window_pattern": 6},
}
_FOUR_NORM_TYPES = ("gemma2", "gemma3_text")  # pre/post norms around attention and MLP
_QK_NORM_TYPES = ("gemma3_text", "qwen3", "qwen3_moe")
_QKV_BIAS_TYPES = ("qwen2", "qwen2_moe")
_ROUTER_BIAS_TYPES = ("deepseek_v3",)  # a bare router weight with a score correction bias (checkpoint tensors)


@dataclass(frozen=True)
class ModelShape:
    """The shapes that set a decoder-only transformer's memory, read from config.json."""

    model_type: str
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int  # per expert for MoE
    vocab_size: int
    tie_word_embeddings: bool
    num_experts: int = 0  # 0: dense MLP
    experts_per_token: int = 0
    shared_expert_intermediate_size: int = 0
    qkv_bias: bool = False
    o_bias: bool = False
    norms_per_layer: int = 2
    qk_norm: bool = False
    sliding_window: int | None = None
    sliding_layers: int = 0
    dense_layers: int = 0  # MoE: leading layers with a dense MLP of dense_intermediate_size instead
    dense_intermediate_size: int = 0
    shared_expert_gate: bool = False  # qwen2_moe: a sigmoid gate on the shared expert
    router_bias: bool = False  # deepseek_v3: a bare router weight (never quantized) and a per-expert bias
    # Multi-head latent attention (0: ordinary attention)
    q_lora_rank: int = 0
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    gemma4: Gemma4Layers | None = None  # per-layer heads, shared keys and values, per-layer inputs

    @classmethod
    def from_config(cls, config: dict) -> ModelShape:
        cfg = {**config, **(config.get("text_config") or {})}
        model_type = str(cfg.get("model_type", ""))
        cfg = {**_TYPE_DEFAULTS.get(model_type, {}), **{k: v for k, v in cfg.items() if v is not None}}

        def need(*keys):
            for key in keys:
                if isinstance(cfg.get(key), int) and cfg[key] > 0:
                    return cfg[key]
            raise ConfigError(
                f"config.json has no positive integer {keys[0]}; plan needs a decoder-only transformer config"
            )

        hidden, layers, heads = need("hidden_size"), need("num_hidden_layers"), need("num_attention_heads")
        experts = int(cfg.get("num_local_experts") or cfg.get("num_experts") or cfg.get("n_routed_experts") or 0)
        experts = experts if experts > 1 else 0
        gemma4 = gemma4_layers(cfg) if model_type == GEMMA4 else None
        if gemma4 is not None and not cfg.get("enable_moe_block"):
            experts = 0
        mla = bool(cfg.get("kv_lora_rank"))
        dense = 0
        if experts:
            if cfg.get("mlp_only_layers") or int(cfg.get("decoder_sparse_step") or 1) != 1 \
                    or int(cfg.get("moe_layer_freq") or 1) != 1:
                raise UnsupportedModelError("plan models MoE layers that are all sparse or lead with dense ones; "
                                            "this config interleaves them")
            dense = int(cfg.get("first_k_dense_replace") or 0)
        shared = int(cfg.get("shared_expert_intermediate_size") or 0)
        if experts and cfg.get("n_shared_experts"):
            shared = int(cfg["n_shared_experts"]) * int(cfg.get("moe_intermediate_size") or 0)
        window = cfg.get("sliding_window") if cfg.get("use_sliding_window", True) else None
        if window:
            if isinstance(cfg.get("layer_types"), list):
                sliding = sum(t == "sliding_attention" for t in cfg["layer_types"])
            elif cfg.get("sliding_window_pattern"):
                sliding = layers - layers // int(cfg["sliding_window_pattern"])
            else:
                sliding = layers
        if mla:
            rope, nope = need("qk_rope_head_dim"), need("qk_nope_head_dim")
            mla_fields = dict(q_lora_rank=int(cfg.get("q_lora_rank") or 0), kv_lora_rank=need("kv_lora_rank"),
                              qk_nope_head_dim=nope, qk_rope_head_dim=rope, v_head_dim=need("v_head_dim"))
        return cls(
            model_type=model_type,
            hidden_size=hidden,
            num_layers=layers,
            num_heads=heads,
            # MLA: the query/key width per head, for the activations (its cache is the latent vector)
            num_kv_heads=heads if mla else int(cfg.get("num_key_value_heads") or heads),
            head_dim=rope + nope if mla else int(cfg.get("head_dim") or hidden // heads),
            intermediate_size=need(*(("moe_intermediate_size",) if experts else ()), "intermediate_size"),
            vocab_size=need("vocab_size"),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            num_experts=experts,
            experts_per_token=int(cfg.get("num_experts_per_tok") or cfg.get("top_k_experts") or 0) if experts else 0,
            shared_expert_intermediate_size=shared if experts else 0,
            qkv_bias=bool(cfg.get("attention_bias")) or model_type in _QKV_BIAS_TYPES,
            o_bias=bool(cfg.get("attention_bias")),
            norms_per_layer=4 if model_type in _FOUR_NORM_TYPES else 2,
            qk_norm=model_type in _QK_NORM_TYPES,
            sliding_window=int(window) if window else None,
            sliding_layers=sliding if window else 0,
            dense_layers=dense,
            dense_intermediate_size=int(cfg.get("intermediate_size") or 0) if dense else 0,
            shared_expert_gate=bool(experts and shared and model_type == "qwen2_moe"),
            router_bias=bool(experts and model_type in _ROUTER_BIAS_TYPES),
            **(mla_fields if mla else {}),
            gemma4=gemma4,
        )

    @property
    def q_out(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_out(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def kv_latent_dim(self) -> int:
        """Elements multi-head latent attention caches per token and layer (0: K and V per head)."""
        return self.kv_lora_rank + self.qk_rope_head_dim if self.kv_lora_rank else 0

    @property
    def mlp_width(self) -> int:
        """Intermediate activations per token: the routed experts' and the shared expert's for MoE."""
        if not self.num_experts:
            return self.intermediate_size
        routed = self.experts_per_token * self.intermediate_size + self.shared_expert_intermediate_size
        return max(routed, self.dense_intermediate_size)


def kv_layer_bytes_per_token(shape: ModelShape, kv_bits: int | None = None, group_size: int = KV_GROUP_SIZE) -> int:
    """K and V bytes one layer caches per token (``kv_bits`` None or 16: unquantized); for latent
    attention the one compressed vector (counted as half of a K-and-V pair of its width)."""
    if shape.kv_latent_dim:
        return kv_bytes_per_token(1, 1, shape.kv_latent_dim, kv_bits, FLOAT_BYTES, group_size) // 2
    return kv_bytes_per_token(1, shape.num_kv_heads, shape.head_dim, kv_bits, FLOAT_BYTES, group_size)


def cached_layers(shape: ModelShape) -> list[tuple[int, int, bool]]:
    """(kv heads, head size, sliding) of each layer that caches keys and values; gemma4's differ by kind, and
    its layers that share an earlier layer's cache none."""
    g = shape.gemma4
    if g is None:
        sliding = [i >= shape.num_layers - shape.sliding_layers for i in range(shape.num_layers)]
        return [(shape.num_kv_heads, shape.head_dim, s) for s in sliding]
    return [(g.kv_heads[i], g.head_dims[i], g.types[i] == "sliding_attention" and bool(shape.sliding_window))
            for i in range(shape.num_layers) if not g.shared[i]]


def kv_bytes_all_layers(shape: ModelShape, kv_bits: int | None = None, group_size: int = KV_GROUP_SIZE) -> int:
    """K and V bytes every caching layer holds per token, together."""
    if shape.gemma4 is None:
        return kv_layer_bytes_per_token(shape, kv_bits, group_size) * shape.num_layers
    return sum(kv_bytes_per_token(1, h, d, kv_bits, FLOAT_BYTES, group_size) for h, d, _ in cached_layers(shape))


def kv_cache_bytes(shape: ModelShape, context: int, batch: int = 1, kv_bits: int | None = None,
                   group_size: int = KV_GROUP_SIZE) -> int:
    """The whole KV cache at ``context`` tokens x ``batch`` sequences; sliding-window layers stop at the window."""
    window = min(context, shape.sliding_window or context)
    if shape.gemma4 is not None:
        return batch * sum(kv_bytes_per_token(1, h, d, kv_bits, FLOAT_BYTES, group_size) * (window if s else context)
                           for h, d, s in cached_layers(shape))
    full_layers = shape.num_layers - shape.sliding_layers
    tokens = full_layers * context + shape.sliding_layers * window  # summed over layers
    return kv_layer_bytes_per_token(shape, kv_bits, group_size) * batch * tokens


def working_bytes(shape: ModelShape, context: int, batch: int = 1) -> int:
    """Working memory of a prefill chunk at ``context``: logits, activations and one layer's attention scores."""
    chunk = min(context, PREFILL_CHUNK)
    activations = 4 * shape.hidden_size + 2 * shape.mlp_width + shape.q_out + 2 * shape.kv_out
    return (
        shape.vocab_size * 4 * batch  # fp32 logits of the last position
        + batch * chunk * activations * FLOAT_BYTES
        + batch * shape.num_heads * chunk * context * FLOAT_BYTES  # attention scores, one layer
    )
