"""The layers a first run's import left in the GGUF (checkpoint/gguf/left_layers.py), read by the CPU kernel's loads.

The loader leaves those layers unbuilt (meta). A first load gives each a `QuantizedLinear.tiled` (and a
`source`), which the CPU kernel's packing calls when it packs the layer (quant/forms.py): it decodes the layer's
blocks from the GGUF's map in C++ (csrc/gguf_blocks.cpp: the bits the import's numpy decoders give, 4-6x as
fast) straight into the kernel's tiles (`affine_planes`' of MLX's packing of them, byte for byte; `source` gives
MLX's layout, for a layer packed otherwise, stacked with others, say), Q and K rows put back in Hugging Face's
order as the import would, and lets go of their pages; so memory holds one decoded layer at a time, as it held
one layer of an import's map. A later load whose packing is kept
(load/packed.py) reads none of them: the packing fills them, and a layer it did not fill is refused
(`affine_kernel.Unpacked`), so the engine packs again from the GGUF.
"""

from __future__ import annotations

import functools
import mmap

import torch

from umakit.checkpoint.files import Checkpoint
from umakit.checkpoint.gguf import left_layers


def substitute(ckpt: Checkpoint, config: dict, shapes: dict, kept: bool) -> tuple[dict, dict, dict]:
    """``config`` and ``shapes`` with the layers ``ckpt``'s import left in its GGUF, their quantization and shapes
    as the CPU kernel reads them (the block type's exact groups); and, unless the packing is ``kept``, what makes
    each one's tensors from the GGUF's blocks (module path -> `QuantizedLinear.source`), which the packing calls
    a layer at a time. Unchanged, and no sources, for any other checkpoint."""
    left = left_layers.left(ckpt.config)
    if not left:
        return config, shapes, {}
    quantization, shapes = dict(config.get("quantization") or {}), dict(shapes)
    for module, e in left.items():
        bits, group = left_layers.form(e)
        quantization[module] = {"bits": bits, "group_size": group}
        shapes[f"{module}.weight"] = (e["rows"], e["cols"] * bits // 32)
        shapes[f"{module}.scales"] = shapes[f"{module}.biases"] = (e["rows"], e["cols"] // group)
    config = {**config, "quantization": quantization}
    if kept:
        return config, shapes, {}
    with open(left_layers.gguf_of(ckpt.path, ckpt.config), "rb") as f:  # copy-on-write: writable arrays to torch
        mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
    return config, shapes, {m: (functools.partial(decode, mapped, m, e, ckpt.config, False),
                                 functools.partial(decode, mapped, m, e, ckpt.config, True)) for m, e in left.items()}


def decode(mapped: mmap.mmap, module: str, e: dict, config: dict, tiled: bool) -> tuple[torch.Tensor, ...]:
    """A left layer's (weight, scales, biases) in MLX's layout, or with ``tiled`` its codes in the CPU kernel's
    tiles (rows padded to 8) in place of the weight, from the GGUF's map ``mapped`` (its pages let go of once
    read)."""
    from umakit.checkpoint.gguf.arch import qk_row_order

    blocks, ggml = torch.from_numpy(left_layers.blocks(mapped, e)), left_layers.FORMS[e["type"]][0]
    order = torch.from_numpy(qk_row_order(f"{module}.weight", e["rows"], config)) if e["qk"] else None
    if tiled:
        made = torch.ops.umakit.gguf_tiles(blocks, ggml, order)
    else:
        made = torch.ops.umakit.gguf_affine(blocks, ggml)
        if order is not None:
            made = tuple(t.index_select(0, order) for t in made)
        made = (made[0].view(torch.uint32), *made[1:])
    start = e["offset"] // mmap.PAGESIZE * mmap.PAGESIZE
    mapped.madvise(mmap.MADV_DONTNEED, start, e["offset"] + e["bytes"] - start)
    return made


def nbytes(ckpt: Checkpoint) -> int:
    """The GGUF bytes of the layers ``ckpt``'s import left in it (a first load's progress counts them)."""
    return sum(e["bytes"] for e in left_layers.left(ckpt.config).values())

