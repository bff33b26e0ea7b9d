"""A compact Llama-family transformer in PyTorch (llama, mistral, qwen2, qwen3, smollm3, gemma3, mixtral,
qwen3_moe, gpt_oss; gemma4 extends it in model/gemma4.py).

Parameter names equal the Hugging Face checkpoint's, so loading is a plain assignment; `fuse_projections` then
joins q/k/v and gate/up into one matmul each, which is what runs. The KV cache is passed to every layer. gemma3's
differences are fields from model/gemma.py, mixture-of-experts layers model/moe.py's, gpt-oss's model/openai_moe.py's.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from umakit.checkpoint.config import SLIDING, context_length, normalized, rope_kind, text_config
from umakit.backends.torch.model.rope import (apply_rope, dynamic_inv_freq, is_dynamic, nope_layers,
                                              rope_attention_factor, rope_cos_sin, rope_inv_freq, rope_original)
from umakit.errors import UnsupportedModelError
from umakit.backends.torch import ARCHITECTURES as SUPPORTED, crossover
from umakit.core.gemma4_layers import Gemma4Layers
from umakit.backends.torch.model.gemma import gemma4_fields, gemma_fields, softcap
from umakit.backends.torch.model.moe import SparseMoE, moe_fields
from umakit.backends.torch.model.norm import GemmaRMSNorm, RMSNorm
from umakit.backends.torch.model.openai_moe import GptOssMoE, gpt_oss_fields, sink_attention
from umakit.backends.torch.model.step import Mixed, MixedCache, Step, attention_mask, each_row

ACTIVATIONS = {"silu": F.silu, "gelu_pytorch_tanh": functools.partial(F.gelu, approximate="tanh")}


@dataclass
class ModelArgs:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    max_position_embeddings: int = 4096  # the context a cache holds (dynamic RoPE: the original times its factor)
    rope_original: int = 0  # dynamic RoPE: the original context, past which its frequencies stretch
    nope_layers: tuple[int, ...] = ()  # layers whose attention takes no RoPE (smollm3's every fourth)
    tie_word_embeddings: bool = False
    qkv_bias: bool = False  # qwen2: biases on q/k/v only
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False  # qwen3, gemma3: RMSNorm on each head of q and k before RoPE
    sliding_window: int | None = None  # every layer's, or (with layer_types) the sliding layers'
    hidden_act: str = "silu"
    # gemma3 (model/gemma.py):
    layer_types: tuple[str, ...] = ()  # per layer "sliding_attention" or "full_attention"; (): all alike
    rope_local_theta: float | None = None  # the sliding layers' RoPE base (unscaled)
    attn_scale: float | None = None  # None: head_dim ** -0.5
    embed_scale: float | None = None
    final_logit_softcapping: float | None = None
    gemma_norms: bool = False  # (1 + w) RMSNorms, and norms after attention and the MLP too
    # mixture of experts (model/moe.py):
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True
    moe_layers: tuple[int, ...] = ()  # the layers whose MLP is sparse
    ffn_name: str = "mlp"  # the checkpoint's name of a layer's feed-forward module (mixtral: block_sparse_moe)
    # gpt-oss (model/openai_moe.py):
    attn_sinks: bool = False  # a learned logit per head beside the keys'
    swiglu: tuple[float, float] | None = None  # its experts' clamped SwiGLU (alpha, limit)
    gemma4: Gemma4Layers | None = None  # gemma4's per-layer shapes and sharing (model/gemma.py, model/gemma4.py)

    @property
    def kv_shapes(self) -> list[tuple[int, int]]:
        """(kv heads, head size) of each layer's cache slot; gemma4's differ, and its shared layers have none."""
        g = self.gemma4
        return g.cache_shapes if g is not None else [(self.num_key_value_heads, self.head_dim)] * self.num_hidden_layers

    @property
    def rope_dynamic(self) -> bool:
        """Dynamic NTK or longrope: the frequencies depend on the sequence's length (rope.py `dynamic_inv_freq`)."""
        return is_dynamic(self.rope_scaling)

    def sliding(self, layer: int) -> bool:
        """Whether ``layer`` attends within the window while others do not (gemma3's sliding layers)."""
        return bool(self.layer_types) and self.layer_types[layer] == SLIDING

    @classmethod
    def from_config(cls, config: dict) -> "ModelArgs":
        """Build from a Hugging Face config.json as is; refuse what this model cannot run."""
        c = text_config(normalized(config))
        kind = c["model_type"]
        if kind not in SUPPORTED:
            raise UnsupportedModelError(
                f"model_type {kind!r} is not supported by the torch backend; supported: {', '.join(SUPPORTED)}"
            )
        act = c.get("hidden_activation") or c.get("hidden_act") or "silu"
        if act not in ACTIVATIONS:
            raise UnsupportedModelError(f"hidden_act {act!r} is not supported; supported: {', '.join(ACTIVATIONS)}")
        window = c.get("sliding_window")
        if kind in ("qwen2", "qwen3", "qwen3_moe", "smollm3"):
            if c.get("use_sliding_window"):
                raise UnsupportedModelError(f"{kind} with use_sliding_window is not supported by the torch backend")
            window = None
        try:
            heads = c["num_attention_heads"]
            bias = bool(c.get("attention_bias", False))
            fields = dict(
                model_type=kind,
                vocab_size=c["vocab_size"],
                hidden_size=c["hidden_size"],
                intermediate_size=c["intermediate_size"],
                num_hidden_layers=c["num_hidden_layers"],
                num_attention_heads=heads,
                num_key_value_heads=c.get("num_key_value_heads") or heads,
                head_dim=c.get("head_dim") or c["hidden_size"] // heads,
                rms_norm_eps=c.get("rms_norm_eps", 1e-6),
                rope_theta=c.get("rope_theta", 10000.0),
                rope_scaling=c.get("rope_scaling"),
                max_position_embeddings=c.get("max_position_embeddings") or 4096,
                tie_word_embeddings=bool(c.get("tie_word_embeddings", False)),
                qkv_bias=bias or kind == "qwen2", o_bias=bias,
                mlp_bias=bool(c.get("mlp_bias", False)),
                nope_layers=nope_layers(c) if kind == "smollm3" else (),
                qk_norm=kind in ("qwen3", "qwen3_moe"),
                sliding_window=window,
                hidden_act=act,
            )
            made = cls(**{**fields, **gemma_fields(c), **gemma4_fields(c), **moe_fields(c), **gpt_oss_fields(c)})
        except KeyError as e:
            raise UnsupportedModelError(f"config.json lacks {e.args[0]!r}, which a {kind} model needs") from e
        made.rope_original = rope_original(c, made.max_position_embeddings)
        if rope_kind(c) == "longrope":  # the original beside its factors, where rope_attention_factor reads it
            made.rope_scaling = {**made.rope_scaling, "original_max_position_embeddings": made.rope_original}
        elif made.rope_dynamic:
            made.max_position_embeddings = context_length(c)
        factor = rope_attention_factor(made.rope_scaling, made.max_position_embeddings)
        if factor != 1.0:
            if made.rope_local_theta is not None:
                raise UnsupportedModelError("yarn or longrope RoPE on a model with sliding layers of their own RoPE "
                                            "base is not supported on the torch engine")
            # yarn scales cos and sin by the factor, so q.k by its square: folded into the attention's scale, which
            # every path (eager, fused, CUDA) already takes
            made.attn_scale = (made.attn_scale or made.head_dim ** -0.5) * factor ** 2
        return made


# -- blocks -----------------------------------------------------------------------
class Attention(nn.Module):
    def __init__(self, a: ModelArgs, layer: int):
        super().__init__()
        self.n_heads, self.n_kv, self.head_dim = a.num_attention_heads, a.num_key_value_heads, a.head_dim
        self.scale, self.sliding, self.rope = a.attn_scale, a.sliding(layer), layer not in a.nope_layers
        q, kv = self.n_heads * self.head_dim, self.n_kv * self.head_dim
        self.q_proj = nn.Linear(a.hidden_size, q, bias=a.qkv_bias)
        self.k_proj = nn.Linear(a.hidden_size, kv, bias=a.qkv_bias)
        self.v_proj = nn.Linear(a.hidden_size, kv, bias=a.qkv_bias)
        self.o_proj = nn.Linear(q, a.hidden_size, bias=a.o_bias)
        if a.qk_norm:
            self.q_norm = make_norm(a, self.head_dim)
            self.k_norm = make_norm(a, self.head_dim)
        if a.attn_sinks:
            self.sinks = nn.Parameter(torch.empty(self.n_heads))
        self.qkv_proj = None  # set by fuse_projections

    def forward(self, x, step: Step | Mixed, cache, layer: int):
        qk, v = self.project(x)
        if isinstance(step, Mixed):  # the rows and the prompt attend apart, each over its own cache
            n = step.split
            rows = self.attend(qk[:n], v[:n], step.rows, cache.rows, layer)  # (n, 1, nh * hd)
            prompt = self.attend(qk[n:].transpose(0, 1), v[n:].transpose(0, 1), step.prompt, cache.prompt, layer)
            return self.o_proj(torch.cat([rows, prompt.transpose(0, 1)]))
        return self.o_proj(self.attend(qk, v, step, cache, layer))

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q and k (B, T, nh + nkv, hd), normed where the family norms them, and v (B, T, nkv, hd)."""
        B, T, _ = x.shape
        nh, nkv = self.n_heads, self.n_kv
        qkv = self.qkv_proj(x).view(B, T, nh + 2 * nkv, self.head_dim)
        if hasattr(self, "q_norm"):
            q, k, v = qkv.split([nh, nkv, nkv], dim=2)
            return torch.cat([self.q_norm(q), self.k_norm(k)], dim=2), v
        qk, v = qkv.split([nh + nkv, nkv], dim=2)
        return qk, v

    def attend(self, qk: torch.Tensor, v: torch.Tensor, step: Step, cache, layer: int) -> torch.Tensor:
        """Attention (B, T, nh * hd) of `project`'s output over ``cache``, the new keys written into it."""
        B, T = qk.shape[:2]
        nh, nkv = self.n_heads, self.n_kv
        cos, sin, mask = step.local if self.sliding and step.local else (step.cos, step.sin, step.mask)
        qk = qk.transpose(1, 2)  # (B, nh+nkv, T, hd): q and k rotated in one go
        if self.rope:
            qk = apply_rope(qk, cos, sin)
        q, k = qk.split([nh, nkv], dim=1)
        k, v = cache.update(layer, k, v.transpose(1, 2), step.positions, step.static)  # (B, nkv, S, hd)
        rows = each_row(q, k, v, mask, step.positions, self._scores)
        return rows if rows is not None else self._scores(q, k, v, mask)

    def _scores(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        B, nh, T = q.shape[:3]
        nkv = self.n_kv
        if hasattr(self, "sinks"):
            out = sink_attention(q, k, v, mask, self.scale or self.head_dim ** -0.5, self.sinks)
        elif T == 1:
            # One query per head, all at the same position: fold each kv group's
            # queries into the time axis, so the cache is read once per kv head.
            q = q.reshape(B, nkv, nh // nkv, self.head_dim)
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.scale)  # mask (1|B, 1, 1, S)
        else:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.scale, enable_gqa=nh != nkv)
            out = out.transpose(1, 2)  # (B, T, nh, hd)
        return out.reshape(B, T, nh * self.head_dim)


class MLP(nn.Module):
    def __init__(self, a: ModelArgs):
        super().__init__()
        self.act = ACTIVATIONS[a.hidden_act]
        self.gate_proj = nn.Linear(a.hidden_size, a.intermediate_size, bias=a.mlp_bias)
        self.up_proj = nn.Linear(a.hidden_size, a.intermediate_size, bias=a.mlp_bias)
        self.down_proj = nn.Linear(a.intermediate_size, a.hidden_size, bias=a.mlp_bias)
        self.gate_up_proj = None  # set by fuse_projections

    def forward(self, x):
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(crossover.each_row(self.act, gate) * up)


def make_norm(a: ModelArgs, dim: int) -> nn.Module:
    return GemmaRMSNorm(dim, a.rms_norm_eps) if a.gemma_norms else RMSNorm(dim, a.rms_norm_eps)


class Block(nn.Module):
    def __init__(self, a: ModelArgs, layer: int):
        super().__init__()
        self.self_attn = Attention(a, layer)
        if layer in a.moe_layers and a.swiglu:
            ffn = GptOssMoE(a)
        elif layer in a.moe_layers:
            ffn = SparseMoE(a.hidden_size, a.moe_intermediate_size, a.num_experts, a.num_experts_per_tok,
                            a.norm_topk_prob, ACTIVATIONS[a.hidden_act])
        else:
            ffn = MLP(a)
        self.ffn_name = a.ffn_name if layer in a.moe_layers else "mlp"
        self.add_module(self.ffn_name, ffn)  # named as the checkpoint names it
        self.input_layernorm = make_norm(a, a.hidden_size)
        self.post_attention_layernorm = make_norm(a, a.hidden_size)
        self.sandwich = a.gemma_norms  # gemma3: norms after attention and the MLP, and before the MLP
        if self.sandwich:
            self.pre_feedforward_layernorm = make_norm(a, a.hidden_size)
            self.post_feedforward_layernorm = make_norm(a, a.hidden_size)

    def forward(self, x, step: Step, cache, layer: int):
        ffn = self._modules[self.ffn_name]
        attn = self.self_attn(self.input_layernorm(x), step, cache, layer)
        if not self.sandwich:
            h = x + attn
            return h + ffn(self.post_attention_layernorm(h))
        h = x + self.post_attention_layernorm(attn)
        return h + self.post_feedforward_layernorm(ffn(self.pre_feedforward_layernorm(h)))


class Inner(nn.Module):
    def __init__(self, a: ModelArgs, block: type[nn.Module]):
        super().__init__()
        # _weight skips the random init: on the meta device its normal_ imports torch._dynamo (1.5 s)
        self.embed_tokens = nn.Embedding(a.vocab_size, a.hidden_size, _weight=torch.empty(a.vocab_size, a.hidden_size))
        self.layers = nn.ModuleList(block(a, i) for i in range(a.num_hidden_layers))
        self.norm = make_norm(a, a.hidden_size)


class Transformer(nn.Module):
    block: type[nn.Module] = Block  # a layer of the model (model/gemma4.py's own)
    mixes = True  # `mixed` runs on its layers (not on gemma4's)

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.model = Inner(args, self.block)
        # A tied head is made at load time from the embedding table (see the engine's loader).
        self.lm_head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)
        self.register_buffer("inv_freq", rope_inv_freq(args), persistent=False)
        self.streamer = None  # a LayerStreamer when some layers are offloaded

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, cache, static: int = 0,
                head: bool = True) -> torch.Tensor:
        """Logits (B, T, V) for ``tokens`` (B, T) at ``positions`` (T,), written into ``cache``.

        ``static`` > 0: attend to that many cache slots under a mask built from
        ``positions`` (a device tensor), so that a decode step has the same shapes
        at every position (CUDA graphs); the caller advances the cache. Otherwise
        attend to the filled part only. ``head=False`` skips the output head.
        """
        T = tokens.shape[1]
        if not static:
            cache.reserve(T)
        x = self._embed(tokens)
        # A mask always under a static span or for a prompt; for one new token only past a window.
        step = self._step(positions, static or cache.offset + T, x.dtype, static > 0 or T > 1, static)
        x = self._blocks(x, step, cache, self._layer_inputs(tokens, x))
        if not static:
            cache.advance(T)
        return self._head(x) if head else x

    def decode_rows(self, tokens: torch.Tensor, positions: torch.Tensor, cache, span: int,
                    head: bool = True) -> torch.Tensor | None:
        """Logits (B, V) for one token per row, ``tokens`` (B, 1), each at its own position (B,); without
        ``head``, None (the rows only written into the cache).

        ``cache`` is a batch cache that writes row b's key at ``positions[b]`` and
        returns its first ``span`` slots; each row sees its keys up to its position.
        """
        x = self._embed(tokens)
        step = self._step(positions, span, x.dtype, True, span, rows=True)
        x = self._blocks(x, step, cache, self._layer_inputs(tokens, x))
        return self._head(x)[:, -1] if head else None

    def mixed(self, tokens: torch.Tensor, positions: torch.Tensor, cache, span: int, prompt: torch.Tensor,
              prompt_cache) -> torch.Tensor:
        """`decode_rows`'s logits (B, V), and in the same pass ``prompt`` (T,) appended to ``prompt_cache`` as
        `forward` appends it: every layer's weights read once for both (`Mixed`)."""
        B, T, at = tokens.shape[0], prompt.shape[0], prompt_cache.offset
        prompt_cache.reserve(T)
        x = self._embed(torch.cat([tokens[:, 0], prompt])[:, None])  # (B + T, 1, d): a token a row
        rows = self._step(positions, span, x.dtype, True, span, rows=True)
        part = self._step(torch.arange(at, at + T, device=x.device), at + T, x.dtype, T > 1, 0)
        x = self._blocks(x, Mixed(rows, part, B), MixedCache(cache, prompt_cache))
        prompt_cache.advance(T)
        return self._head(x[:B])[:, -1]

    def _embed(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.model.embed_tokens(tokens)
        scale = self.args.embed_scale
        # The scale rounded to the activations' dtype, as transformers does; a Python float keeps CUDA graphs simple.
        return x if scale is None else x * float(torch.tensor(scale, dtype=x.dtype))

    def _head(self, x: torch.Tensor) -> torch.Tensor:
        return softcap(self.lm_head(self.model.norm(x)), self.args.final_logit_softcapping)

    def _step(self, positions: torch.Tensor, key_len: int, dtype: torch.dtype, masked: bool, static: int,
              rows: bool = False) -> Step:
        """RoPE and masks for tokens at ``positions`` over ``key_len`` keys; ``rows``: one position per row."""
        a = self.args

        def view(inv_freq: torch.Tensor, window: int | None):
            cos, sin = rope_cos_sin(inv_freq, positions, dtype)  # (T or B, hd)
            mask = attention_mask(positions, key_len, window) if masked or (window and key_len > window) else None
            if rows:  # (B, 1, 1, hd) rotates each row's (B, H, 1, hd) at its position; (B, 1, 1, S) masks its keys
                return cos[:, None, None], sin[:, None, None], mask[:, None, None]
            return cos, sin, mask

        inv_freq, local = self._rope_tables()
        if a.rope_dynamic:
            inv_freq = dynamic_inv_freq(a, inv_freq, positions, rows)
        if not a.layer_types:  # every layer alike (mistral: all within its window)
            cos, sin, mask = view(inv_freq, a.sliding_window)
            return Step(cos, sin, positions, mask, static)
        cos, sin, mask = view(inv_freq, None)
        return Step(cos, sin, positions, mask, static, local=view(local, a.sliding_window))

    def _rope_tables(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Inverse frequencies of the global layers and of the sliding ones (rope.rope_inv_freq's rows)."""
        return self.inv_freq[0], self.inv_freq[-1]

    def _layer_inputs(self, tokens: torch.Tensor, x: torch.Tensor) -> torch.Tensor | None:
        return None  # what each layer takes besides the hidden state: gemma4's per-layer inputs (model/gemma4.py)

    def _blocks(self, x: torch.Tensor, step: Step, cache, extra: torch.Tensor | None = None) -> torch.Tensor:
        streamer = self.streamer  # offloaded layers' weights arrive through it (offload/layers.py)
        for i, layer in enumerate(self.model.layers):
            if streamer is not None:
                streamer.before(i)
            x = layer(x, step, cache, i)
            if streamer is not None:
                streamer.after(i)
        return x


def fuse_projections(model: Transformer, concat) -> None:
    """Join q/k/v and gate/up into one linear each; ``concat(modules)`` builds the joined module."""
    for block in model.model.layers:
        if hasattr(block, "fuse"):  # a family that joins its own (model/gemma4.py)
            block.fuse(concat)
            continue
        a, m = block.self_attn, block._modules[block.ffn_name]
        a.qkv_proj = concat([a.q_proj, a.k_proj, a.v_proj])
        del a.q_proj, a.k_proj, a.v_proj
        if isinstance(m, MLP):  # experts stay apart: each token reads only its own
            m.gate_up_proj = concat([m.gate_proj, m.up_proj])
            del m.gate_proj, m.up_proj
