"""A GGUF import's exact groups of 16 (checkpoint/gguf: its Q6_K tensors), read by umakit's CPU kernel.

The import holds a Q6_K tensor (a scale per 16 weights) exactly: its 6-bit codes and scales in groups of 16
(`EXACT16_FILE`). Where the torch engine runs umakit's affine kernel (CPU, packed), those layers load from there:
6.5625 bits a weight with the scales held as codes (cpu/scale_codes.py), the GGUF's own size and values.
Elsewhere (CUDA, dequantized forms) the engine loads their 8-bit copies for MLX's groups of 32 or more, 8.5 bits a
weight, which `Checkpoint.complete` makes on that first load (checkpoint/gguf/requantized.py).
"""

from __future__ import annotations

from pathlib import Path

from umakit.checkpoint.files import Checkpoint, read_safetensors_header
from umakit.checkpoint.gguf.finished import EXACT16_FILE
from umakit.errors import CheckpointError

PARTS = ("weight", "scales", "biases")


def layers(ckpt: Checkpoint) -> dict[str, dict]:
    """The module paths the import holds exactly in groups of 16, with their bits and group size; empty where
    the checkpoint has none (not a GGUF import, or one made before they were kept)."""
    meta = (ckpt.config.get("umakit") or {}).get("exact_groups") or {}
    return dict(meta.get("layers") or {}) if (Path(ckpt.path) / EXACT16_FILE).is_file() else {}


def file_of(ckpt: Checkpoint) -> Path:
    return Path(ckpt.path) / EXACT16_FILE


def opened(ckpt: Checkpoint):
    """`EXACT16_FILE` of ``ckpt`` open for `read` (a context manager)."""
    from safetensors import safe_open

    return safe_open(str(file_of(ckpt)), framework="pt")


def read(f, module: str, bits: int) -> tuple:
    """(codes, scales, biases) of the exact layer ``module`` from the open file ``f``: symmetric, as the GGUF's
    are."""
    scales = f.get_tensor(f"{module}.scales")
    return f.get_tensor(f"{module}.weight"), scales, scales * -(2 ** (bits - 1))


def substitute(ckpt: Checkpoint, config: dict, shapes: dict, source):
    """``config``, ``shapes`` and ``source`` with the exact layers' tensors in place of the re-quantized ones: their
    quantization, shapes and tensors from `EXACT16_FILE`. ``source(skip)`` gives the checkpoint's (name, tensor)
    pairs, reading none of those named in ``skip`` (the re-quantized tensors replaced here: on the Q6_K file of
    Qwen2.5-1.5B's shapes, 1.3 of its 1.7 GB)."""
    exact = layers(ckpt)
    if not exact:
        return config, shapes, source
    file = Path(ckpt.path) / EXACT16_FILE
    header = read_safetensors_header(file)
    missing = [f"{m}.{p}" for m in exact for p in PARTS[:2] if f"{m}.{p}" not in header]
    if missing:
        raise CheckpointError(f"{file} lacks {', '.join(missing[:3])}: import the GGUF again")
    quantization = dict(config.get("quantization") or {})
    shapes = dict(shapes)
    for module, spec in exact.items():
        quantization[module] = {"bits": spec["bits"], "group_size": spec["group_size"]}
        shapes[f"{module}.weight"] = tuple(header[f"{module}.weight"].shape)
        shapes[f"{module}.scales"] = shapes[f"{module}.biases"] = tuple(header[f"{module}.scales"].shape)
    replaced = {f"{m}.{p}" for m in exact for p in PARTS}

    def stream():
        yield from source(frozenset(replaced))
        with opened(ckpt) as f:
            for module, spec in exact.items():
                codes, scales, biases = read(f, module, spec["bits"])
                yield f"{module}.weight", codes
                yield f"{module}.scales", scales
                yield f"{module}.biases", biases

    return {**config, "quantization": quantization}, shapes, stream
