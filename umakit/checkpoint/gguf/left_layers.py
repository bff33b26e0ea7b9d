"""The quantized layers a first run's import leaves in the GGUF, for the torch engine's CPU kernel to pack from their
blocks.

A GGUF's first run on a CPU imported every quantized layer into MLX's layout (decoded by numpy, 0.2-0.3 GB/s on 2
cores, and written beside the GGUF), then the load read that copy back to pack the kernel's tiles, and no later
CPU load read it again: later loads read the packing. Where the run's engine reads the GGUF's exact groups (the
torch engine on a CPU, the default there), the import now leaves each layer that is one GGUF tensor of an exact
block type (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K) where it is, naming it in config.json
(``umakit.gguf_layers``: the GGUF's path, size and modification time, and each layer's tensor, type, offset and
shape), and the first load packs it from the GGUF's blocks (backends/torch/load/gguf_layers.py). An engine that
reads MLX's layout (MLX, CUDA, a float ``--dtype``, the transformers engine) has `Checkpoint.complete` make them
once, into `LAYERS_FILE`, with the import's own converters: the bytes `umakit import` writes for those layers.
Either needs the GGUF where it was, unchanged; a later CPU load that finds its packing does not.
"""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path
from typing import Callable

from umakit.checkpoint.writer import StreamedSafetensors
from umakit.core.fsutil import locked, new_temp_dir, writing
from umakit.errors import BusyError, CheckpointError

LAYERS_FILE = "gguf/layers.safetensors"  # the left layers in MLX's layout, once an engine that reads it needs them
WAIT_S = 0.2  # between looks at another process's writing
# The block types whose groups are exact affine ones (quants.EXACT, quants.EXACT16): ggml's id, bits, group size.
FORMS = {"Q4_0": (2, 4, 32), "Q4_1": (3, 4, 32), "Q5_0": (6, 5, 32), "Q5_1": (7, 5, 32), "Q8_0": (8, 8, 32),
         "Q4_K": (12, 4, 32), "Q5_K": (13, 5, 32), "Q6_K": (14, 6, 16)}


def leaves(t, module: str, config: dict) -> bool:
    """Whether the import may leave the GGUF tensor ``t``, module ``module`` of a model of ``config``, in the GGUF:
    one tensor of the file, 2-D, of an exact block type, and a linear layer (the CPU kernel's packing holds those; a
    table of lookups, but a tied one, which the head's packing serves, reads its own codes)."""
    table = "embed" in module and not (module.endswith(".embed_tokens") and config.get("tie_word_embeddings"))
    return hasattr(t, "data_offset") and len(t.shape) == 2 and t.tensor_type.name in FORMS and not table


def entry(t, qk: bool) -> dict:
    """config.json's record of the left tensor ``t``; ``qk``: its rows are llama.cpp's permuted Q or K rows."""
    cols, rows = (int(d) for d in t.shape)
    return {"tensor": t.name, "type": t.tensor_type.name, "offset": int(t.data_offset), "bytes": int(t.n_bytes),
            "rows": rows, "cols": cols, "qk": qk}


def record(gguf: Path, layers: dict[str, dict]) -> dict:
    """config.json's ``umakit.gguf_layers`` for ``layers`` (module path -> `entry`) left in ``gguf``."""
    stat = gguf.stat()
    return {"gguf": str(gguf), "size": stat.st_size, "mtime_ns": stat.st_mtime_ns, "file": LAYERS_FILE,
            "layers": layers}


def left(config: dict) -> dict[str, dict]:
    """The layers an import left in its GGUF (module path -> `entry`); empty for any other checkpoint."""
    meta = config.get("umakit")
    held = meta.get("gguf_layers") if isinstance(meta, dict) else None
    return dict(held["layers"]) if isinstance(held, dict) and isinstance(held.get("layers"), dict) else {}


def form(e: dict) -> tuple[int, int]:
    """(bits, group size) of a left layer as the CPU kernel reads it: its block type's exact groups."""
    return FORMS[e["type"]][1:]


def gguf_of(model_dir: Path, config: dict) -> Path:
    """The GGUF an import left layers in, checked to be the file it read; `CheckpointError` saying what to do if
    it moved or changed."""
    meta = config["umakit"]["gguf_layers"]
    path = Path(meta["gguf"])
    try:
        stat = path.stat()
    except OSError:
        stat = None
    if stat is None or (stat.st_size, stat.st_mtime_ns) != (meta["size"], meta["mtime_ns"]):
        how = "is gone" if stat is None else "has changed"
        raise CheckpointError(f"{model_dir} reads its quantized layers from {path}, which {how} since it was "
                              f"imported: give umakit the GGUF as it is now (it is imported again), or "
                              f"`umakit rm {Path(model_dir).name}`")
    return path


def deferred_file(model_dir: Path, config: dict) -> Path | None:
    """Where the left layers go in MLX's layout once made; None where the import left none."""
    return Path(model_dir) / LAYERS_FILE if left(config) else None


def blocks(mapped, e: dict):
    """A left layer's blocks, (rows, bytes a row) uint8 numpy, from the GGUF's map ``mapped``."""
    import numpy as np

    if e["offset"] + e["bytes"] > len(mapped):
        raise CheckpointError(f"the GGUF is shorter than its tensor {e['tensor']} (import it again)")
    return np.frombuffer(mapped, dtype=np.uint8, count=e["bytes"], offset=e["offset"]).reshape(e["rows"], -1)


def write(model_dir: Path, config: dict, progress: Callable[[int, int], None] | None = None) -> Path:
    """Write the left layers in MLX's layout into `LAYERS_FILE`, whole or not at all, as `umakit import` writes
    them (Q6_K's as their 8-bit copies); ``progress(done, total)`` hears the GGUF's bytes done."""
    dest = Path(model_dir) / LAYERS_FILE
    with writing(dest):
        dest.parent.mkdir(exist_ok=True)
    while True:  # ranks of one run (mlx.launch, torchrun) load at once: one writes, the others wait for it
        try:
            with locked(dest):
                if not dest.is_file():  # else another process made it while this one waited
                    _write(dest, Path(model_dir), config, progress)
                return dest
        except BusyError:
            time.sleep(WAIT_S)


def _write(dest: Path, model_dir: Path, config: dict, progress) -> None:
    from umakit.checkpoint.gguf import quants, tensors
    from umakit.checkpoint.gguf.arch import qk_row_order
    from umakit.checkpoint.gguf.reader import open_gguf

    layers, gf = left(config), open_gguf(gguf_of(model_dir, config))
    total, done = sum(e["bytes"] for e in layers.values()), 0
    tmp = new_temp_dir(dest)
    part = tmp / dest.name
    try:
        with writing(dest):
            out = StreamedSafetensors(part, (1 << 12) + 512 * len(layers), metadata={"format": "mlx"})
            try:
                for module, e in layers.items():
                    t = gf.tensors[e["tensor"]]
                    order = qk_row_order(f"{module}.weight", e["rows"], config) if e["qk"] else None
                    if t.tensor_type in quants.EXACT:
                        arrays, _, _ = tensors.exact(t, order)
                    else:
                        (held, codes), bits = tensors.exact16(t, order), quants.EXACT16[t.tensor_type][1]
                        arrays, _, _ = tensors.requantized16(codes, held["scales"], bits)
                    out.update(dict(zip((f"{module}.weight", f"{module}.scales", f"{module}.biases"), arrays)))
                    gf.release([e["tensor"]])
                    done += e["bytes"]
                    if progress:
                        progress(done, total)
            except BaseException:
                out.abort()
                raise
            out.close()
            os.replace(part, dest)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # the part, where it was not installed

