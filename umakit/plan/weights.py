"""The weights half of `umakit plan`: every matrix of a config's shapes, the bits it is stored at,
and the bytes that gives per category and per layer.

Matrices are named by the module paths mlx-lm gives them (``model.layers.3.mlp.down_proj``,
``...switch_mlp.gate_proj`` for a layer's stacked experts), so one lookup serves the two
sources of bits:

* a real checkpoint's ``quantization`` block: its top-level bits and group size,
  overridden per module path (``false``: left float);
* ``--bits N`` with a recipe: the bits `umakit quantize` would choose
  (`umakit.quantize.recipes`: embeddings and head at 8 bits by default).

Either way a matrix whose input width is not a multiple of the group size stays
float, as the quantizer leaves it. Quantized matrices carry an fp16 scale and bias
per group (4-bit, group 64 -> 4.5 bits); norms, biases and unquantizable routers
stay 16-bit.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from umakit.core.affine import FLOAT_BITS, MODE, bits_per_weight
from umakit.errors import ConfigError, UnsupportedModelError
from umakit.plan.placement import LayerBytes
from umakit.plan.shapes import FLOAT_BYTES, ModelShape

CATEGORIES = ("embedding", "attention", "mlp", "head", "norms")
_PREFIXES = ("language_model.",)  # multimodal checkpoints nest the text model here


@dataclass(frozen=True)
class Matrix:
    """One quantizable weight (``count`` stacked copies for a layer's experts)."""

    path: str
    kind: str  # "linear", "embedding" or "head", as the recipes see it
    category: str
    block: int | None
    width: int  # input features (the quantized axis)
    out: int
    count: int = 1
    role: str = "dense"  # "dense" (every token reads it) or "expert" (routed)

    @property
    def params(self) -> int:
        return self.count * self.width * self.out


# (bits, group size) of a matrix, or None when it stays float
BitsOf = Callable[[Matrix], "tuple[int, int] | None"]


def _attention(s: ModelShape, p: str, i: int) -> tuple[list[Matrix], int]:
    """Layer ``i``'s attention matrices and its 16-bit biases."""
    H = s.hidden_size

    def lin(name, width, out):
        return Matrix(f"{p}.self_attn.{name}", "linear", "attention", i, width, out)

    if s.kv_lora_rank:
        heads, qk = s.num_heads, s.qk_nope_head_dim + s.qk_rope_head_dim
        q = ([lin("q_a_proj", H, s.q_lora_rank), lin("q_b_proj", s.q_lora_rank, heads * qk)] if s.q_lora_rank
             else [lin("q_proj", H, heads * qk)])
        # mlx-lm splits kv_b_proj per head into embed_q (keys' nope part, applied to the query) and
        # unembed_out (values): the same parameters, quantized along nope and kv_lora_rank.
        mats = q + [lin("kv_a_proj_with_mqa", H, s.kv_lora_rank + s.qk_rope_head_dim),
                    Matrix(f"{p}.self_attn.embed_q", "linear", "attention", i, s.qk_nope_head_dim, s.kv_lora_rank,
                           heads),
                    Matrix(f"{p}.self_attn.unembed_out", "linear", "attention", i, s.kv_lora_rank, s.v_head_dim,
                           heads),
                    lin("o_proj", heads * s.v_head_dim, H)]
        return mats, 0
    if s.gemma4 is not None:  # heads of the layer's kind; k only where v is k; neither where shared
        g = s.gemma4
        q, kv = s.num_heads * g.head_dims[i], g.kv_heads[i] * g.head_dims[i]
        own = [] if g.shared[i] else [lin("k_proj", H, kv)] + ([] if g.k_eq_v[i] else [lin("v_proj", H, kv)])
        return [lin("q_proj", H, q), *own, lin("o_proj", q, H)], 0
    mats = [lin("q_proj", H, s.q_out), lin("k_proj", H, s.kv_out), lin("v_proj", H, s.kv_out),
            lin("o_proj", s.q_out, H)]
    return mats, (s.q_out + 2 * s.kv_out if s.qkv_bias else 0) + (H if s.o_bias else 0)


def _mlp(s: ModelShape, p: str, i: int) -> tuple[list[Matrix], int]:
    """Layer ``i``'s MLP matrices and its 16-bit extras (a router that is not a linear layer)."""
    H = s.hidden_size

    def lin(name, width, out, count=1, role="dense"):
        return Matrix(f"{p}.{name}", "linear", "mlp", i, width, out, count, role)

    def ffn(prefix, inter, count=1, role="dense"):
        return [lin(f"{prefix}.gate_proj", H, inter, count, role), lin(f"{prefix}.up_proj", H, inter, count, role),
                lin(f"{prefix}.down_proj", inter, H, count, role)]

    if s.gemma4 is not None:  # a dense MLP (twice as wide where the config says), experts beside it, the
        g = s.gemma4  # per-layer input's gate and projection
        mats = ffn("mlp", g.mlp_sizes[i])
        if g.per_layer_input:
            mats += [lin("per_layer_input_gate", H, g.per_layer_input),
                     lin("per_layer_projection", g.per_layer_input, H)]
        if not s.num_experts:
            return mats, 0
        E = s.num_experts
        return mats + ffn("experts.switch_glu", s.intermediate_size, E, "expert") + [lin("router.proj", H, E)], H + E
    if not s.num_experts or i < s.dense_layers:
        return ffn("mlp", s.dense_intermediate_size or s.intermediate_size), 0
    E, inter = s.num_experts, s.intermediate_size
    moe = "block_sparse_moe" if s.model_type == "mixtral" else "mlp"
    mats = ffn(f"{moe}.switch_mlp", inter, E, "expert")
    extras = 0
    if s.router_bias:  # deepseek_v3's gate is a bare weight with a score correction bias: never quantized
        extras += E * H + E
    else:
        mats.append(lin(f"{moe}.gate", H, E))
    if s.shared_expert_intermediate_size:
        shared = "shared_experts" if s.router_bias else "shared_expert"
        mats += ffn(f"{moe}.{shared}", s.shared_expert_intermediate_size)
        if s.shared_expert_gate:
            mats.append(lin(f"{moe}.shared_expert_gate", H, 1))
    return mats, extras


@dataclass(frozen=True)
class LayerWeights:
    matrices: tuple[Matrix, ...]
    attention_extras: int  # 16-bit biases
    mlp_extras: int  # 16-bit routers that are not linear layers
    norms: int  # 16-bit norm weights (their own category)


def model_matrices(s: ModelShape) -> tuple[list[Matrix], list[LayerWeights]]:
    """(matrices outside the layers, each layer's weights) for the shapes ``s``."""
    H, V = s.hidden_size, s.vocab_size
    outer = [Matrix("model.embed_tokens", "embedding", "embedding", None, H, V)]
    if not s.tie_word_embeddings:
        outer.append(Matrix("lm_head", "head", "head", None, H, V))
    g = s.gemma4
    if g is not None and g.per_layer_input:  # gemma4's per-layer inputs: a second table, a projection of the input
        width = s.num_layers * g.per_layer_input
        outer += [Matrix("model.embed_tokens_per_layer", "embedding", "embedding", None, width, g.vocab_per_layer),
                  Matrix("model.per_layer_model_projection", "linear", "mlp", None, H, width)]
    layers = []
    for i in range(s.num_layers):
        p = f"model.layers.{i}"
        attn, attn_extra = _attention(s, p, i)
        mlp, mlp_extra = _mlp(s, p, i)
        latent_norms = s.q_lora_rank + s.kv_lora_rank  # MLA normalises its compressed q and kv
        qk_norms = 2 * s.head_dim if s.qk_norm else 0
        norms = s.norms_per_layer * H + latent_norms + qk_norms
        if g is not None:  # four norms, q's and k's per head, the per-layer input's, the experts' three, a scalar
            norms = (4 + bool(g.per_layer_input) + 3 * bool(s.num_experts)) * H + g.head_dims[i] * (
                1 + (not g.shared[i])) + 1
        layers.append(LayerWeights(tuple(attn + mlp), attn_extra, mlp_extra, norms))
    return outer, layers


def checkpoint_bits(block: dict) -> BitsOf:
    """The bits of each matrix as a checkpoint's ``quantization`` block stores them."""
    mode = block.get("mode", MODE)
    if mode != MODE:
        raise UnsupportedModelError(f"plan reads {MODE} quantization only; this checkpoint is {mode!r}")
    try:
        top = (int(block["bits"]), int(block["group_size"]))
    except (KeyError, TypeError, ValueError) as e:
        raise ConfigError(f"the config's quantization block lacks bits or group_size: {block}") from e
    overrides: dict[str, tuple[int, int] | None] = {}
    for key, value in block.items():
        if isinstance(value, dict) and "bits" in value:
            overrides[_normal(key)] = (int(value["bits"]), int(value.get("group_size", top[1])))
        elif value is False:
            overrides[_normal(key)] = None

    def bits_of(m: Matrix):
        found = overrides.get(m.path, top)
        return _divisible(m, found)

    return bits_of


def recipe_bits(bits: int, group_size: int, recipe: str, n_blocks: int, embed_bits: int | None = None) -> BitsOf:
    """The bits `umakit quantize --bits bits --recipe recipe` gives each matrix (16: none quantized);
    ``embed_bits`` sets the embedding and head instead."""
    choose = None
    if bits != FLOAT_BITS:
        from umakit.quantize.recipes import Layer, get_recipe

        r = get_recipe(recipe)
        choose = lambda m: r.bits_for(Layer(m.path, m.kind, m.block, n_blocks), bits)  # noqa: E731

    def bits_of(m: Matrix):
        b = embed_bits if embed_bits is not None and m.kind != "linear" else choose(m) if choose else None
        return None if b is None or b == FLOAT_BITS else _divisible(m, (b, group_size))

    return bits_of


def _divisible(m: Matrix, pair):
    return None if pair is None or m.width % pair[1] else pair


def _normal(path: str) -> str:
    for prefix in _PREFIXES:
        path = path.removeprefix(prefix)
    return path


def stored_bits(pair) -> float:
    """Stored bits per weight of a matrix at ``pair`` (None: 16-bit float)."""
    return float(FLOAT_BITS) if pair is None else bits_per_weight(pair[0], pair[1], FLOAT_BYTES)


@dataclass(frozen=True)
class Weights:
    """Parameters and bytes of a model's weights, by category and by layer."""

    params: dict[str, int]
    matrix_params: dict[str, int]  # of params, those in quantizable matrices
    bytes: dict[str, float]
    matrix_bytes: dict[str, float]
    layers: tuple[LayerBytes, ...]
    expert_matrix_bytes: float  # every layer's routed experts together
    embed_pair: tuple[int, int] | None


def count_weights(s: ModelShape, bits_of: BitsOf) -> Weights:
    """Sum every matrix at the bits ``bits_of`` gives it."""
    outer, layers = model_matrices(s)
    params = dict.fromkeys(CATEGORIES, 0)
    matrix_params = dict.fromkeys(CATEGORIES, 0)
    size = dict.fromkeys(CATEGORIES, 0.0)
    matrix_size = dict.fromkeys(CATEGORIES, 0.0)

    def add(m: Matrix) -> float:
        b = m.params * stored_bits(bits_of(m)) / 8
        params[m.category] += m.params
        matrix_params[m.category] += m.params
        size[m.category] += b
        matrix_size[m.category] += b
        return b

    for m in outer:
        add(m)
    per_layer, experts_total = [], 0.0
    for lw in layers:
        dense, expert, count = 0.0, 0.0, 0
        for m in lw.matrices:
            b = add(m)
            if m.role == "expert":
                expert, count = expert + b / m.count, m.count
            else:
                dense += b
        experts_total += expert * count
        for cat, n in (("attention", lw.attention_extras), ("mlp", lw.mlp_extras), ("norms", lw.norms)):
            params[cat] += n
            size[cat] += n * FLOAT_BYTES
            dense += n * FLOAT_BYTES
        per_layer.append(LayerBytes(round(dense), round(expert), count))
    final = s.hidden_size + (s.gemma4.per_layer_input if s.gemma4 is not None else 0)  # and gemma4's input norm
    params["norms"] += final
    size["norms"] += final * FLOAT_BYTES
    return Weights(params, matrix_params, size, matrix_size, tuple(per_layer), experts_total,
                   bits_of(outer[0]))
