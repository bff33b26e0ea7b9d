"""gemma4's per-layer shapes, read from its text config: what differs from one layer to the next (head sizes and
counts, shared keys and values, MLP widths, per-layer inputs, RoPE per layer kind). Read by the torch engine's
model (backends/torch/model/gemma.py, gemma4.py) and by `umakit plan` (plan/shapes.py): pure data, no torch."""

from __future__ import annotations

from dataclasses import dataclass

from umakit.errors import UnsupportedModelError

GEMMA4 = "gemma4_text"
SLIDING, FULL = "sliding_attention", "full_attention"  # transformers' layer_types (as checkpoint/config.py's)


@dataclass(frozen=True)
class Gemma4Layers:
    """What differs from one gemma4 layer to the next, read from its config.

    Global layers have heads of their own size and count (``per_layer_config``) and may take their values from
    the keys' projection (``attention_k_eq_v``); the last ``num_kv_shared_layers`` layers compute no keys or
    values but attend to those of the last earlier layer of their kind, whose cache slot they name here, and may
    have an MLP twice as wide. Every layer may add a per-layer input (``hidden_size_per_layer_input``).
    """

    types: tuple[str, ...]  # each layer's kind (transformers' layer_types)
    head_dims: tuple[int, ...]
    kv_heads: tuple[int, ...]
    slots: tuple[int, ...]  # the cache slot a layer writes (its own) or reads (a shared layer: its source's)
    shared: tuple[bool, ...]  # computes no keys or values of its own
    k_eq_v: tuple[bool, ...]  # values are the keys' projection (before the keys' norm and RoPE)
    mlp_sizes: tuple[int, ...]
    per_layer_input: int  # 0: none
    vocab_per_layer: int
    rope: dict  # layer type -> (theta, rotated fraction, factor) of transformers' "default"/"proportional" RoPE

    @property
    def cache_shapes(self) -> list[tuple[int, int]]:
        """(kv heads, head size) of each cache slot, the layers that write one in order."""
        return [(self.kv_heads[i], self.head_dims[i]) for i in range(len(self.slots)) if not self.shared[i]]


def gemma4_layers(c: dict) -> Gemma4Layers:
    """The per-layer shapes of a gemma4 text config (``text_config``'s, normalized), as transformers derives
    them; what no umakit code runs (bidirectional attention over all tokens) is refused by name."""
    if c.get("use_bidirectional_attention") == "all":
        raise UnsupportedModelError("gemma4 with use_bidirectional_attention 'all' (no causal mask) is not "
                                    "supported here")
    n, hd, nkv = c["num_hidden_layers"], c["head_dim"], c.get("num_key_value_heads") or c["num_attention_heads"]
    types = list(c.get("layer_types") or [FULL if (i + 1) % 6 == 0 else SLIDING for i in range(n)])
    if len(types) != n or set(types) - {FULL, SLIDING}:
        raise UnsupportedModelError(f"layer_types must name {n} layers, each {FULL!r} or {SLIDING!r}")
    overrides = c.get("per_layer_config")
    if overrides is None:  # transformers' own derivation, where a config names the global size only
        glob = {"head_dim": c.get("global_head_dim") or 512}
        if c.get("num_global_key_value_heads") and c.get("attention_k_eq_v", True):
            glob["num_key_value_heads"] = c["num_global_key_value_heads"]
        overrides = {str(i): glob for i, t in enumerate(types) if t == FULL}
    per = [overrides.get(str(i)) or overrides.get(i) or {} for i in range(n)]
    unknown = {k for o in per for k in o} - {"head_dim", "num_key_value_heads"}
    if unknown:
        raise UnsupportedModelError(f"gemma4's per_layer_config sets {', '.join(sorted(unknown))}, which umakit "
                                    "does not read")
    head_dims = tuple(int(o.get("head_dim", hd)) for o in per)
    kv_heads = tuple(int(o.get("num_key_value_heads", nkv)) for o in per)
    first_shared = n - int(c.get("num_kv_shared_layers") or 0)
    slots, shared = [], []
    for i, t in enumerate(types):
        if i < first_shared:
            slots.append(i)
            shared.append(False)
            continue
        sources = [j for j in range(first_shared) if types[j] == t]
        if not sources:
            raise UnsupportedModelError(f"gemma4 layer {i} shares the keys of no earlier {t} layer")
        slots.append(slots[sources[-1]])
        shared.append(True)
    rope = {}
    for t in set(types):
        p = (c.get("rope_parameters") or {}).get(t) or {}
        kind = p.get("rope_type", "default")
        if kind not in ("default", "proportional"):
            raise UnsupportedModelError(f"gemma4's {t} layers take {kind!r} RoPE, which umakit does not compute")
        dims = {head_dims[i] for i in range(n) if types[i] == t}
        if len(dims) > 1:
            raise UnsupportedModelError(f"gemma4's {t} layers have heads of several sizes: {sorted(dims)}")
        rope[t] = (float(p.get("rope_theta", 10000.0)), float(p.get("partial_rotary_factor", 1.0))
                   if kind == "proportional" else 1.0, float(p.get("factor", 1.0)) if kind == "proportional"
                   else 1.0)
    wide = 2 if c.get("use_double_wide_mlp") else 1
    return Gemma4Layers(
        types=tuple(types), head_dims=head_dims, kv_heads=kv_heads, slots=tuple(slots), shared=tuple(shared),
        k_eq_v=tuple(bool(c.get("attention_k_eq_v")) and t == FULL for t in types),
        mlp_sizes=tuple(c["intermediate_size"] * (wide if s else 1) for s in shared),
        per_layer_input=int(c.get("hidden_size_per_layer_input") or 0),
        vocab_per_layer=int(c.get("vocab_size_per_layer_input") or c["vocab_size"]), rope=rope)
