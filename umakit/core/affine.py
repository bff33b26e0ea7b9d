"""MLX's affine quantization format in numbers: the widths and group sizes its
kernels support, umakit's defaults, and the config.json block that describes
a quantized checkpoint. Pure constants and arithmetic (no framework), so every
layer of umakit, engines included, takes them from here.
"""

from __future__ import annotations

MODE = "affine"
BITS = (2, 3, 4, 5, 6, 8)  # every affine width MLX's kernels support except 1
GROUP_SIZES = (32, 64, 128)
DEFAULT_BITS = 4  # what `umakit quantize` writes unless told
DEFAULT_GROUP_SIZE = 64
HIGH_BITS = 8  # embeddings, output head and the mixed recipe's sensitive layers
KV_BITS = (4, 8)  # quantized KV cache widths the engines offer (--kv-bits)
KV_GROUP_SIZE = 64
FLOAT_BITS = 16  # an unquantized 16-bit weight, as `umakit plan` counts it


def bits_per_weight(bits: int, group_size: int, scale_bytes: int = 2) -> float:
    """Stored bits per weight of affine group quantization.

    Each group of ``group_size`` weights carries one scale and one bias of
    ``scale_bytes`` each: 4-bit, group 64, fp16 scale+bias -> 4 + 32/64 = 4.5.
    """
    if bits <= 0 or group_size <= 0 or scale_bytes <= 0:
        from umakit.errors import InvalidArgumentError

        raise InvalidArgumentError(
            f"bits, group size and scale bytes must be positive (got {bits}, {group_size}, {scale_bytes})"
        )
    return bits + 2 * scale_bytes * 8 / group_size


def quantization_block(layers: dict[str, tuple[int, int]], group_size: int | None = None,
                       bits: int | None = None, layer_mode: bool = True) -> dict:
    """mlx-lm's config.json ``quantization`` block for ``layers`` (module path -> (group size, bits)).

    The top-level ``group_size``/``bits`` are the given ones, else the most
    common pair; every layer that differs gets its own entry, keyed by path.
    Layers not listed stay float (loaders quantize only layers with scales).
    ``layer_mode`` writes "mode" into the per-layer entries too (mlx-lm reads both forms).
    """
    if group_size is None or bits is None:
        counts: dict[tuple[int, int], int] = {}
        for pair in layers.values():
            counts[pair] = counts.get(pair, 0) + 1
        group_size, bits = max(counts, key=counts.get) if counts else (DEFAULT_GROUP_SIZE, DEFAULT_BITS)
    block: dict = {"group_size": group_size, "bits": bits, "mode": MODE}
    for path, (g, b) in sorted(layers.items()):
        if (g, b) != (group_size, bits):
            block[path] = {"group_size": g, "bits": b, **({"mode": MODE} if layer_mode else {})}
    return block


def describe(block: dict | None) -> str:
    """One line for a config's quantization block: "4-bit g64" or "4-bit g32, some layers 8-bit"."""
    if not block:
        return "none"
    overrides = {v["bits"] for v in block.values() if isinstance(v, dict) and "bits" in v}
    extra = f", some layers {'/'.join(map(str, sorted(overrides)))}-bit" if overrides - {block["bits"]} else ""
    mode = block.get("mode", MODE)
    return f"{block['bits']}-bit g{block['group_size']}{extra}" if mode == MODE else f"{mode} g{block['group_size']}"
