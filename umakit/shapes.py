"""A decoder-only transformer's shapes from its config.json, and the memory they set besides the
weights: the KV cache and the working memory of a prefill chunk. `umakit plan` and the offload
planner (what an engine keeps in VRAM next to the weights) count them with these functions.

Formulas (sizes in bytes, B = batch, everything 16-bit unless said):

* KV cache: 2 x L x H_kv x D x bytes per element x context x B; layers with a
  sliding window keep at most ``window`` tokens.
* working memory (an upper bound; fused attention kernels need less):
  fp32 logits (vocab x 4 x B) + four hidden-size buffers, q/k/v and the MLP
  gate/up activations for a prefill chunk of `PREFILL_CHUNK` tokens + the
  attention scores of one layer for that chunk against the whole context
  (what an unfused attention materialises; fused kernels need no score matrix).
"""

from __future__ import annotations

from dataclasses import dataclass

from .affine import KV_GROUP_SIZE
from .errors import ConfigError, UnsupportedModelError
from .roofline import kv_bytes_per_token

PREFILL_CHUNK = 512  # tokens per prefill chunk, every engine: bounds attention memory on long prompts
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

    @classmethod
    def from_config(cls, config: dict) -> ModelShape:
        cfg = {**config, **(config.get("text_config") or {})}
        model_type = str(cfg.get("model_type", ""))
        cfg = {**_TYPE_DEFAULTS.get(model_type, {}), **{k: v for k, v in cfg.items() if v is not None}}
        if "kv_lora_rank" in cfg:
            raise UnsupportedModelError("plan does not model multi-head latent attention (DeepSeek-style) yet")

        def need(*keys):
            for key in keys:
                if isinstance(cfg.get(key), int) and cfg[key] > 0:
                    return cfg[key]
            raise ConfigError(
                f"config.json has no positive integer {keys[0]}; plan needs a decoder-only transformer config"
            )

        hidden, layers, heads = need("hidden_size"), need("num_hidden_layers"), need("num_attention_heads")
        experts = int(cfg.get("num_local_experts") or cfg.get("num_experts") or 0)
        experts = experts if experts > 1 else 0
        window = cfg.get("sliding_window") if cfg.get("use_sliding_window", True) else None
        if window:
            if isinstance(cfg.get("layer_types"), list):
                sliding = sum(t == "sliding_attention" for t in cfg["layer_types"])
            elif cfg.get("sliding_window_pattern"):
                sliding = layers - layers // int(cfg["sliding_window_pattern"])
            else:
                sliding = layers
        return cls(
            model_type=model_type,
            hidden_size=hidden,
            num_layers=layers,
            num_heads=heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(cfg.get("head_dim") or hidden // heads),
            intermediate_size=need(*(("moe_intermediate_size",) if experts else ()), "intermediate_size"),
            vocab_size=need("vocab_size"),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            num_experts=experts,
            experts_per_token=int(cfg.get("num_experts_per_tok") or 0) if experts else 0,
            shared_expert_intermediate_size=int(cfg.get("shared_expert_intermediate_size") or 0),
            qkv_bias=bool(cfg.get("attention_bias")) or model_type in _QKV_BIAS_TYPES,
            o_bias=bool(cfg.get("attention_bias")),
            norms_per_layer=4 if model_type in _FOUR_NORM_TYPES else 2,
            qk_norm=model_type in _QK_NORM_TYPES,
            sliding_window=int(window) if window else None,
            sliding_layers=sliding if window else 0,
        )

    @property
    def q_out(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_out(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def mlp_width(self) -> int:
        """Intermediate activations per token: the routed experts' and the shared expert's for MoE."""
        if not self.num_experts:
            return self.intermediate_size
        return self.experts_per_token * self.intermediate_size + self.shared_expert_intermediate_size


def kv_layer_bytes_per_token(shape: ModelShape, kv_bits: int | None = None, group_size: int = KV_GROUP_SIZE) -> int:
    """K and V bytes one layer caches per token (``kv_bits`` None or 16: unquantized)."""
    return kv_bytes_per_token(1, shape.num_kv_heads, shape.head_dim, kv_bits, FLOAT_BYTES, group_size)


def kv_cache_bytes(shape: ModelShape, context: int, batch: int = 1, kv_bits: int | None = None,
                   group_size: int = KV_GROUP_SIZE) -> int:
    """The whole KV cache at ``context`` tokens x ``batch`` sequences; sliding-window layers stop at the window."""
    window = min(context, shape.sliding_window or context)
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
