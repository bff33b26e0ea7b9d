"""RoPE for the torch engine's models: inverse frequencies for each kind a checkpoint may name (default, linear,
llama3, yarn, dynamic, longrope), and the rotation itself, in the Hugging Face (non-interleaved) layout. Pure functions;
transformers' own ``rope_init_fn`` results are the oracle (tests/engines/test_torch_rope.py)."""

from __future__ import annotations

import math

import torch

from umakit.backends.torch import ROPE_KINDS
from umakit.checkpoint.config import rope_kind
from umakit.errors import UnsupportedModelError


def rope_inv_freq(args) -> torch.Tensor:
    """Inverse frequencies (kinds, head_dim/2), float32: row 0 with the config's rope scaling (global
    layers), row 1, where the model has sliding layers of their own base, for those. gemma4's two kinds have
    heads of two sizes: each row is zero-padded to the longer (`gemma4_inv_freq`)."""
    if args.gemma4 is not None:
        return gemma4_inv_freq(args.gemma4, args.layer_types)
    rows = [_inv_freq(args.head_dim, args.rope_theta, args.rope_scaling, args.max_position_embeddings)]
    if args.rope_local_theta is not None:
        rows.append(_inv_freq(args.head_dim, args.rope_local_theta, None))
    return torch.stack(rows)


def gemma4_inv_freq(layers, types: tuple[str, ...]) -> torch.Tensor:
    """(2, longest head/2): the global layers' frequencies, then the sliding layers', each for its own head size,
    zero-padded to the longer."""
    rows = []
    for kind in ("full_attention", "sliding_attention"):
        d = layers.head_dims[types.index(kind)] if kind in types else 2
        rows.append(_proportional(d, *layers.rope.get(kind, (1.0, 0.0, 1.0))))
    width = max(len(r) for r in rows)
    return torch.stack([torch.cat([r, torch.zeros(width - len(r), device="cpu")]) for r in rows])


def _proportional(d: int, theta: float, partial: float, factor: float) -> torch.Tensor:
    """transformers' "proportional" RoPE (gemma4's global layers), in float32 as it computes it: the first
    ``partial`` of a head's pairs turn at base ** (-2i / d), the exponent over the whole head, the others not
    at all (frequency 0); then divided by ``factor``. Partial 1 is the default RoPE."""
    turned = int(partial * d // 2)
    freq = torch.zeros(d // 2, device="cpu")  # on the CPU even under a meta device
    freq[:turned] = 1.0 / theta ** (torch.arange(0, 2 * turned, 2, dtype=torch.float32, device="cpu") / d)
    return freq / factor


def rope_attention_factor(scaling: dict | None, max_positions: int) -> float:
    """yarn's and longrope's factor on cos and sin (1.0 for every other kind), as transformers computes it."""
    s = scaling or {}
    kind = s.get("rope_type", s.get("type"))
    if kind == "longrope":
        if s.get("attention_factor") is not None:
            return float(s["attention_factor"])
        factor, old = s.get("factor") or max_positions / s["original_max_position_embeddings"], \
            s["original_max_position_embeddings"]
        return 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(old))
    if kind != "yarn":
        return 1.0
    if s.get("attention_factor") is not None:
        return float(s["attention_factor"])
    factor = _yarn_factor(s, max_positions)

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    if s.get("mscale") and s.get("mscale_all_dim"):
        return mscale(factor, s["mscale"]) / mscale(factor, s["mscale_all_dim"])
    return mscale(factor)


def _yarn_factor(s: dict, max_positions: int) -> float:
    return s.get("factor") or max_positions / s["original_max_position_embeddings"]


def _yarn(d: int, theta: float, s: dict, max_positions: int) -> torch.Tensor:
    """yarn's inverse frequencies: interpolated (divided by the factor) for the slow dimensions, kept for the fast
    ones, blended by a linear ramp between the dimensions that turn ``beta_fast`` and ``beta_slow`` times over
    the original context."""
    factor, old = _yarn_factor(s, max_positions), s["original_max_position_embeddings"]
    fast, slow = s.get("beta_fast") or 32, s.get("beta_slow") or 1

    def dim_of(rotations: float) -> float:
        return d * math.log(old / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = dim_of(fast), dim_of(slow)
    if s.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, d - 1)
    high = high + 0.001 if low == high else high
    ramp = ((torch.arange(d // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    base = theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d)
    keep = 1 - ramp  # 1: extrapolate (the fast dimensions), 0: interpolate
    return (1.0 / (factor * base)) * (1 - keep) + (1.0 / base) * keep


def _inv_freq(d: int, theta: float, scaling: dict | None, max_positions: int = 0) -> torch.Tensor:
    # Always on the CPU: under the meta-device context of model building, arange
    # would import torch._dynamo (about a second).
    inv = 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.float64, device="cpu") / d))
    s = scaling or {}
    kind = s.get("rope_type", s.get("type", "default"))
    if kind == "linear":
        inv = inv / s["factor"]
    elif kind == "llama3":
        low, high = s["low_freq_factor"], s["high_freq_factor"]
        old = s["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv
        smooth = (old / wavelen - low) / (high - low)
        mid = (1 - smooth) * inv / s["factor"] + smooth * inv
        inv = torch.where(wavelen > old / low, inv / s["factor"], torch.where(wavelen < old / high, inv, mid))
    elif kind == "yarn":
        return _yarn(d, theta, s, max_positions)
    elif kind == "proportional":
        return _proportional(d, theta, s.get("partial_rotary_factor", 1.0), s.get("factor", 1.0))
    elif kind == "longrope":  # its short factors within the original context (`dynamic_inv_freq`)
        return _longrope(d, theta, s["short_factor"])
    elif kind not in ("default", "dynamic"):  # dynamic: the default within the original context (`dynamic_inv_freq`)
        raise UnsupportedModelError(f"rope_scaling type {kind!r} is not supported on the torch engine; supported: "
                                    f"{', '.join(ROPE_KINDS)}")
    return inv.float()


def is_dynamic(scaling: dict | None) -> bool:
    """Whether the frequencies follow the sequence's length: dynamic NTK, and longrope's short and long factors."""
    s = scaling or {}
    return s.get("rope_type", s.get("type")) in ("dynamic", "longrope")


def _longrope(d: int, theta: float, factors) -> torch.Tensor:
    exponents = torch.arange(0, d, 2, dtype=torch.int64).float() / d
    return 1.0 / (torch.tensor(factors, dtype=torch.float32) * theta ** exponents)


def dynamic_inv_freq(args, inv_freq: torch.Tensor, positions: torch.Tensor, rows: bool) -> torch.Tensor:
    """Dynamic NTK RoPE: past the original context the base grows with the sequence, as transformers grows it,
    to theta * (factor * n / original - (factor - 1)) ^ (d / (d - 2)) for a sequence of n tokens.
    transformers takes n as the forward pass's last position + 1 (every token of a prompt rotated for the whole
    prompt, a decode step for its own length; keys already cached keep the rotation they were written with); so
    does this for ``positions`` (T,), and, for ``rows`` (one position per row of a batch), each row as its own
    decode step would: (T or B, head_dim/2) then, or ``inv_freq`` itself while every length is within the
    original context. Unlike transformers it keeps no memory of earlier, longer calls. longrope the same way:
    its long factors for a length past the original context, its short ones within."""
    limit = args.rope_original
    lengths = positions.to(torch.float64) + 1 if rows else positions.max().to(torch.float64)[None] + 1
    if float(lengths.max()) <= limit:
        return inv_freq
    s = args.rope_scaling
    if s.get("rope_type", s.get("type")) == "longrope":  # its long factors past the original context, else short
        long = _longrope(args.head_dim, args.rope_theta, s["long_factor"]).to(inv_freq.device)
        return torch.where((lengths > limit)[:, None], long[None], inv_freq[None])
    factor, d = float(args.rope_scaling["factor"]), args.head_dim
    base = args.rope_theta * (factor * lengths.clamp(min=limit) / limit - (factor - 1)) ** (d / (d - 2))
    exponents = torch.arange(0, d, 2, dtype=torch.float64, device=positions.device) / d
    return (1.0 / base[:, None] ** exponents[None, :]).float()


def rope_cos_sin(inv_freq: torch.Tensor, positions: torch.Tensor, dtype: torch.dtype):
    """cos and signed sin, each (T, head_dim), for integer ``positions`` (T,); ``inv_freq`` (head_dim/2,), or
    one row per position or one for all (`dynamic_inv_freq`).

    transformers rotates pairs (i, i + hd/2): x * cos + cat(-x2, x1) * sin. With
    the sign folded into the first half of sin, cat(-x2, x1) * sin becomes
    roll(x) * signed_sin, one op fewer per call.
    """
    freqs = positions.float()[:, None] * (inv_freq if inv_freq.dim() == 2 else inv_freq[None, :])  # (T, hd/2)
    cos, sin = freqs.cos(), freqs.sin()
    return torch.cat((cos, cos), dim=-1).to(dtype), torch.cat((-sin, sin), dim=-1).to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """Rotate x (B, H, T, hd) in the Hugging Face (non-interleaved) layout."""
    return torch.addcmul(x * cos, x.roll(x.shape[-1] // 2, dims=-1), signed_sin)


def rope_original(c: dict, max_positions: int) -> int:
    """The original context of a RoPE whose frequencies follow the sequence's length (0 for the other kinds):
    dynamic's ``max_position_embeddings``; longrope's ``original_max_position_embeddings``, beside its factors or,
    in older configs (Phi-3's), at the top level. What they need and lack is refused here, at load."""
    kind, s = rope_kind(c), c.get("rope_scaling") or {}
    if kind == "dynamic":
        if not isinstance(s.get("factor"), (int, float)):
            raise UnsupportedModelError("dynamic RoPE scaling without a numeric 'factor' is not supported")
        return max_positions
    if kind == "longrope":
        original = s.get("original_max_position_embeddings") or c.get("original_max_position_embeddings")
        missing = [k for k in ("short_factor", "long_factor") if not s.get(k)] + ([] if original else
                                                                                 ["original_max_position_embeddings"])
        if missing:
            raise UnsupportedModelError(f"longrope RoPE scaling without {', '.join(missing)} is not supported")
        return int(original)
    return 0


def nope_layers(c: dict) -> tuple[int, ...]:
    """smollm3's layers without RoPE: its ``no_rope_layers`` (1: RoPE, 0: none), or, where a config leaves that
    out, every ``no_rope_layer_interval``-th layer (default 4), as transformers derives it."""
    flags = c.get("no_rope_layers")
    if flags is None:
        interval = c.get("no_rope_layer_interval") or 4
        flags = [int((i + 1) % interval != 0) for i in range(c["num_hidden_layers"])]
    if len(flags) < c["num_hidden_layers"]:
        raise UnsupportedModelError(f"no_rope_layers names {len(flags)} layers of {c['num_hidden_layers']}")
    return tuple(i for i in range(c["num_hidden_layers"]) if not flags[i])
