"""A GGUF import's 8-bit copies of the layers it holds exactly in groups of 16 (its Q6_K), made on first use.

MLX's groups are 32, 64 or 128 weights, so an engine that reads MLX's layout (MLX, the torch engine on CUDA or in
a float dtype, the transformers engine) reads such a layer re-quantized to 8 bits. The torch engine's CPU kernel,
the default on a CPU, reads the exact groups (backends/torch/load/exact.py) and never those copies. An import
therefore writes the exact groups alone, and the first load that needs the copies makes them here, from those
groups, into `REQUANTIZED_FILE` beside them: the same bytes the import made before it left them to this (the
values are the gguf package's products either way). On the 1.5B Q6_K file that was 1.7 GB and most of a first
run's time on a CPU, for a copy the CPU default never reads.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path
from typing import Callable

from umakit.checkpoint.gguf import quants, tensors
from umakit.checkpoint.gguf.finished import EXACT16_FILE, REQUANTIZED_FILE
from umakit.checkpoint.writer import StreamedSafetensors
from umakit.core.fsutil import locked, new_temp_dir, writing
from umakit.errors import BusyError, CheckpointError

WAIT_S = 0.2  # between looks at another process's writing


def write(model_dir: Path, config: dict, progress: Callable[[int, int], None] | None = None) -> Path:
    """Write the 8-bit copies of ``model_dir``'s exact layers (config.json's umakit.exact_groups) into
    `REQUANTIZED_FILE`, whole or not at all; ``progress(done, total)`` hears the exact groups' bytes done."""
    dest = Path(model_dir) / REQUANTIZED_FILE
    layers = config["umakit"]["exact_groups"].get("layers")
    if not isinstance(layers, dict) or not (Path(model_dir) / EXACT16_FILE).is_file():
        raise CheckpointError(f"{model_dir} lacks the exact groups its config names ({EXACT16_FILE}, "
                              "umakit.exact_groups.layers): import the GGUF again")
    while True:  # ranks of one run (mlx.launch, torchrun) load at once: one writes, the others wait for it
        try:
            return _write(dest, model_dir, layers, progress)
        except BusyError:
            time.sleep(WAIT_S)


def _write(dest: Path, model_dir: Path, layers: dict, progress) -> Path:
    from safetensors import safe_open

    with locked(dest):
        if dest.is_file():  # another process made them while this one waited
            return dest
        tmp = new_temp_dir(dest)
        part = tmp / dest.name
        errors, meta = {}, {"format": "mlx"}
        try:
            with writing(dest), safe_open(str(Path(model_dir) / EXACT16_FILE), framework="numpy") as f:
                sizes = {m: f.get_slice(f"{m}.weight").get_shape() for m in layers}
                total, done = sum(rows * words * 4 for rows, words in sizes.values()), 0
                out = StreamedSafetensors(part, (1 << 12) + 512 * len(layers), metadata=meta)
                try:
                    for module, spec in layers.items():
                        weight, scales = f.get_tensor(f"{module}.weight"), f.get_tensor(f"{module}.scales")
                        codes = quants.unpack(weight, spec["bits"], scales.shape[1] * quants.EXACT16_GROUP)
                        arrays, _, errors[module] = tensors.requantized16(codes, scales, spec["bits"])
                        out.update(dict(zip((f"{module}.weight", f"{module}.scales", f"{module}.biases"), arrays)))
                        done += weight.nbytes
                        if progress:
                            progress(done, total)
                except BaseException:
                    out.abort()
                    raise
                meta["max_abs_err"] = json.dumps(errors)  # each copy's largest error, read by close
                out.close()
                os.replace(part, dest)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)  # the part, where it was not installed
    return dest
