"""`umakit quantize`: a float checkpoint in, an mlx-community-style quantized directory out.

The pipeline only loads and writes: `umakit.load` quantizes on load (the
engine runs the recipe, `umakit.quantize.recipes`), the engine hands back its
weights in checkpoint layout (`Engine.export_weights`), and
`umakit.checkpoint.writer` writes them with config.json and the source's
tokenizer files. Perplexity before and after is measured on request.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

from umakit import checkpoint
from umakit.checkpoint import writer as checkpoint_writer
from umakit.core.affine import DEFAULT_BITS, DEFAULT_GROUP_SIZE
from umakit.backends.base import WeightInfo
from umakit.errors import CheckpointError, InvalidArgumentError
from umakit.core.fsutil import check_destination, check_not_inside, check_writable
from umakit.evaluate.perplexity import PerplexityResult, perplexity
from umakit.api import load
from umakit.quantize.recipes import DEFAULT_RECIPE, get_recipe
from umakit.quantize.tensor import check_bits


@dataclass
class QuantizeReport:
    src: Path
    dst: Path
    bits: int
    group_size: int
    recipe: str
    layers: dict[int, int]  # bits -> number of quantized layers
    float_layers: int  # quantizable layers left float
    notes: list[str]
    source_bytes: int  # weight files on disk
    bytes: int
    weights: WeightInfo
    seconds: float
    ppl_before: PerplexityResult | None = None
    ppl_after: PerplexityResult | None = None
    quantization: dict = field(default_factory=dict)  # the config.json block

    @property
    def bits_per_weight(self) -> float:
        return self.weights.bits_per_weight

    @property
    def ppl_change(self) -> float | None:
        """Relative perplexity change, e.g. 0.03 for +3 %."""
        if self.ppl_before is None or self.ppl_after is None:
            return None
        return self.ppl_after.ppl / self.ppl_before.ppl - 1


def _source_dtype(ckpt: checkpoint.Checkpoint) -> str:
    declared = ckpt.config.get("torch_dtype") or ckpt.config.get("dtype")
    if declared in ("float16", "bfloat16", "float32"):
        return declared
    names = {"F16": "float16", "BF16": "bfloat16", "F32": "float32", "F64": "float32"}
    counts: dict[str, int] = {}
    for t in ckpt.tensors.values():
        counts[names[t.dtype]] = counts.get(names[t.dtype], 0) + t.nbytes
    return max(counts, key=counts.get)


def _check_float(ckpt: checkpoint.Checkpoint) -> None:
    q = ckpt.config.get("quantization") or ckpt.config.get("quantization_config")
    ints = [t for t in ckpt.tensors.values() if t.dtype not in checkpoint.FLOAT_DTYPES]
    if q or ints:
        what = "config.json has a quantization block" if q else f"tensor {ints[0].name} is {ints[0].dtype}"
        raise CheckpointError(f"{ckpt.path} is already quantized ({what}); quantize a float16/bfloat16/float32 checkpoint")


def _layer_counts(block: dict, names) -> tuple[dict[int, int], int]:
    """(bits -> quantized layers, float layers) from the config block and the exported tensor names.

    A quantized layer stores ``<path>.scales``; a quantizable layer left float
    is a 2-D ``<path>.weight`` without them (norms are 1-D).
    """
    per_bits: dict[int, int] = {}
    left = 0
    for name, shape in names.items():
        path, _, leaf = name.rpartition(".")
        if leaf == "scales":
            bits = block.get(path, block)["bits"]
            per_bits[bits] = per_bits.get(bits, 0) + 1
        elif leaf == "weight" and len(shape) == 2 and f"{path}.scales" not in names:
            left += 1
    return dict(sorted(per_bits.items())), left


def quantize(
    src: str | os.PathLike | None,
    dst: str | os.PathLike,
    bits: int = DEFAULT_BITS,
    group_size: int = DEFAULT_GROUP_SIZE,
    recipe: str = DEFAULT_RECIPE,
    force: bool = False,
    eval_text: str | None = None,
) -> QuantizeReport:
    """Quantize the float checkpoint ``src`` into an mlx-community-style directory ``dst``.

    Scales, biases and the layers left float keep the source's float dtype.
    With ``eval_text``, the perplexity of both models on it is measured (default backend).
    Nothing is left at ``dst`` if anything fails.
    """
    check_bits(bits, group_size)
    get_recipe(recipe)
    dst = check_destination(dst, force)
    src_path = checkpoint.resolve(src)
    if dst.resolve() == src_path.resolve():
        raise InvalidArgumentError(f"{dst} is the source checkpoint; write the quantized model elsewhere")
    check_not_inside(src_path, dst)  # with --force, replacing a folder that holds the source would destroy it
    check_writable(dst)
    ckpt = checkpoint.open_checkpoint(src_path).complete()
    _check_float(ckpt)
    before = None
    if eval_text is not None:  # measured first: a bad text fails before anything is written
        before = perplexity(load(src_path), eval_text)
    t0 = time.perf_counter()
    model = load(src_path, backend="mlx", dtype=_source_dtype(ckpt),
                 quantize={"bits": bits, "group_size": group_size, "recipe": recipe})
    engine = model.engine
    block = engine.quantization
    weights = engine.export_weights()
    config = json.loads((src_path / "config.json").read_text())
    config.pop("_name_or_path", None)
    config["quantization"] = block
    config["quantization_config"] = block
    checkpoint_writer.write_model_dir(dst, weights, config, copy_from=src_path, force=force)
    per_bits, float_layers = _layer_counts(block, {k: v.shape for k, v in weights.items()})
    report = QuantizeReport(
        src=src_path, dst=dst, bits=bits, group_size=group_size, recipe=recipe,
        layers=per_bits, float_layers=float_layers, notes=list(engine.load_notes),
        source_bytes=sum(f.stat().st_size for f in ckpt.files),
        bytes=sum(f.stat().st_size for f in dst.glob("*.safetensors")),
        weights=engine.weight_info(), seconds=time.perf_counter() - t0, quantization=block,
    )
    del model, engine, weights
    if before is not None:
        report.ppl_before = before
        report.ppl_after = perplexity(load(dst), eval_text)
    return report
