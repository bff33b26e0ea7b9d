"""A GPTQ, AWQ or compressed-tensors checkpoint read (`plan_import`) and written as an MLX-layout model directory
(`write`), every quantized layer exactly (layouts.py), every other tensor as it is.

What no exact form holds is refused by name before anything is written: act-order GPTQ, AWQ's other kernels'
layouts, compressed-tensors' float and activation-quantized schemes, groups MLX cannot express.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from umakit.checkpoint.files import TensorInfo, read_safetensors_header, weight_files
from umakit.checkpoint.gguf.quants import pick_dtype
from umakit.checkpoint.writer import fill_model_dir_streamed
from umakit.checkpoint.hfquant import layouts
from umakit.checkpoint.hfquant.detect import IMPORT_FORMAT, method_of, with_side_file
from umakit.core.affine import BITS, quantization_block
from umakit.errors import CheckpointError, UnsupportedModelError

# per method: the suffixes of a quantized module's tensors, the first one marking it
TENSORS = {
    "gptq": ("qweight", "qzeros", "scales", "g_idx"),
    "awq": ("qweight", "qzeros", "scales"),
    "compressed-tensors": ("weight_packed", "weight_scale", "weight_zero_point", "weight_shape", "weight_g_idx"),
}
SHARD_BYTES = 2 << 30  # an import holds one shard in memory at a time
_NUMPY = {"F16": np.float16, "F32": np.float32, "BF16": np.uint16, "I32": np.int32, "U32": np.uint32,
          "I64": np.int64, "I8": np.int8, "U8": np.uint8, "I16": np.int16, "F64": np.float64}


@dataclass
class Scheme:
    """How the checkpoint's quantized layers are stored."""

    method: str
    bits: int
    group: int  # -1 or 0: one group a row
    symmetric: bool = True
    zeros_offset: int = 1  # GPTQ: zeros stored less one


@dataclass
class ImportPlan:
    path: Path
    config: dict
    scheme: Scheme
    tensors: dict[str, TensorInfo]
    modules: list[str]  # the quantized modules' paths


def _scheme(config: dict, where: str) -> Scheme:
    q = config["quantization_config"]
    method = q["quant_method"]
    if method == "gptq":
        fmt = q.get("checkpoint_format", "gptq")
        if fmt not in ("gptq", "gptq_v2"):
            raise UnsupportedModelError(f"{where}: GPTQ checkpoint_format {fmt!r} is not supported (gptq, gptq_v2)")
        return Scheme(method, int(q.get("bits", 4)), int(q.get("group_size", 128)), bool(q.get("sym", True)),
                      1 if fmt == "gptq" else 0)
    if method == "awq":
        version = str(q.get("version", "gemm")).lower()
        if version != "gemm" or int(q.get("bits", q.get("w_bit", 4))) != 4:
            raise UnsupportedModelError(f"{where}: AWQ {version!r} layout at {q.get('bits', 4)} bits is not "
                                        "supported (AutoAWQ's 4-bit GEMM layout is)")
        return Scheme(method, 4, int(q.get("group_size", q.get("q_group_size", 128))), False, 0)
    fmt = q.get("format")
    groups = q.get("config_groups") or {}
    if q.get("kv_cache_scheme"):
        raise UnsupportedModelError(f"{where}: its KV cache is quantized too (kv_cache_scheme), which umakit does "
                                    "not run as compressed-tensors does; weight-only schemes are")
    if fmt != "pack-quantized" or len(groups) != 1:
        raise UnsupportedModelError(f"{where}: compressed-tensors format {fmt!r} with {len(groups)} scheme(s) is "
                                    "not supported (one pack-quantized scheme of integer weights is)")
    scheme = next(iter(groups.values()))
    w, acts = scheme.get("weights") or {}, scheme.get("input_activations")
    if acts:
        raise UnsupportedModelError(f"{where}: its activations are quantized too ({acts.get('num_bits')}-bit "
                                    f"{acts.get('type')}), which umakit does not run; weight-only schemes are")
    strategy, bits = w.get("strategy"), int(w.get("num_bits", 0))
    if w.get("type") != "int" or strategy not in ("group", "channel") or bits not in (2, 4, 8):
        raise UnsupportedModelError(f"{where}: compressed-tensors {bits}-bit {w.get('type')} weights by "
                                    f"{strategy} are not supported (2, 4 or 8-bit int, by group or channel)")
    group = int(w.get("group_size") or 0) if strategy == "group" else -1
    return Scheme(method, bits, group, bool(w.get("symmetric", True)), 0)


def plan_import(path: Path) -> ImportPlan:
    """Read ``path``'s config and tensor headers and check that every quantized layer has an exact form."""
    config = with_side_file(path, json.loads((path / "config.json").read_text()))
    where = str(path)
    if method_of(config) is None:
        raise CheckpointError(f"{where} is not a GPTQ, AWQ or compressed-tensors checkpoint (its config.json has "
                              "no quantization_config.quant_method of those)")
    try:
        scheme = _scheme(config, where)
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise CheckpointError(f"{where}: malformed quantization_config ({type(e).__name__}: {e})") from e
    if scheme.bits not in BITS:
        raise UnsupportedModelError(f"{where}: {scheme.bits}-bit weights have no MLX form ({BITS})")
    tensors: dict[str, TensorInfo] = {}
    for f in weight_files(path):
        tensors.update(read_safetensors_header(f))
    marker = "." + TENSORS[scheme.method][0]
    modules = sorted(n[: -len(marker)] for n in tensors if n.endswith(marker))
    if not modules:
        raise CheckpointError(f"{where}: its config says {scheme.method} but no tensor ends in {marker}")
    return ImportPlan(path, config, scheme, tensors, modules)


def _read(info: TensorInfo) -> np.ndarray:
    a = np.memmap(info.file, dtype=_NUMPY[info.dtype], mode="r", offset=info.offset, shape=info.shape or (1,))
    return np.array(a)


def _layer(plan: ImportPlan, module: str) -> layouts.Layer:
    s, where = plan.scheme, module
    t = {}
    for suffix in TENSORS[s.method]:
        info = plan.tensors.get(f"{module}.{suffix}")
        if info is not None:
            raw = _read(info)
            t[suffix] = layouts.as_float32(raw, info.dtype) if suffix in ("scales", "weight_scale") else raw
    needed = {"gptq": ("qweight", "qzeros", "scales"), "awq": ("qweight", "qzeros", "scales"),
              "compressed-tensors": ("weight_packed", "weight_scale", "weight_shape")}[s.method]
    if s.method == "compressed-tensors" and not s.symmetric:
        needed += ("weight_zero_point",)
    missing = [x for x in needed if x not in t]
    if missing:
        raise CheckpointError(f"{plan.path}: {module} lacks {', '.join(missing)}")
    if s.method == "gptq":
        return layouts.gptq(t, s.bits, s.group, s.zeros_offset, where)
    if s.method == "awq":
        return layouts.awq(t, s.group, where)
    return layouts.compressed(t, s.bits, s.group if s.group > 0 else None, s.symmetric, where)


def _scale_dtype(scales: np.ndarray, biases: np.ndarray):
    """float16, else bfloat16, else float32: the narrowest that holds every value exactly."""
    import mlx.core as mx

    if pick_dtype(scales, biases) == np.float16:
        return mx.float16
    if not any((a.view(np.uint32) & 0xFFFF).any() for a in (scales, biases)):  # bfloat16 is float32's top half
        return mx.bfloat16
    return mx.float32


@dataclass
class ImportReport:
    out_dir: Path
    method: str
    layers: int
    bits: int
    group: int
    bytes_written: int = 0
    seconds: float = 0.0


def tensors(plan: ImportPlan, layers: dict, progress: Callable[[int, int], None] | None = None
            ) -> Iterator[tuple[str, object]]:
    """The import's tensors as mx arrays, one layer at a time (a whole model is never held); ``layers`` gets each
    quantized module's (group size, bits) as it goes; ``progress(done, total)`` the checkpoint's tensor bytes
    taken so far, after each layer and as each other tensor is read."""
    import mlx.core as mx

    suffixes = TENSORS[plan.scheme.method]
    quantized = set(plan.modules)
    done, total = [0], sum(info.nbytes for info in plan.tensors.values())

    def read(nbytes: int) -> None:
        done[0] += nbytes
        if progress:
            progress(min(done[0], total), total)

    for module in plan.modules:
        layer = _layer(plan, module)
        dtype = _scale_dtype(layer.scales, layer.biases)
        yield f"{module}.weight", mx.array(layer.weight)
        yield f"{module}.scales", mx.array(layer.scales).astype(dtype)
        yield f"{module}.biases", mx.array(layer.biases).astype(dtype)
        layers[module] = (layer.group, layer.bits)
        read(sum(plan.tensors[f"{module}.{x}"].nbytes for x in suffixes if f"{module}.{x}" in plan.tensors))
    for name, info in plan.tensors.items():
        module, _, leaf = name.rpartition(".")
        if module in quantized and leaf in suffixes:
            continue
        read(info.nbytes)
        a = _read(info).reshape(info.shape)
        if module in quantized and leaf == "bias" and not a.any():
            continue  # AutoGPTQ writes a zero bias for every layer, architectures without biases included
        if info.dtype not in ("F16", "F32", "BF16"):
            raise CheckpointError(f"{plan.path}: tensor {name} is {info.dtype}, not part of a quantized layer")
        yield name, mx.array(a).view(mx.bfloat16) if info.dtype == "BF16" else mx.array(a)


def config_of(plan: ImportPlan, layers: dict) -> dict:
    """config.json's object for the import, once `tensors` has listed its ``layers``."""
    config = {k: v for k, v in plan.config.items() if k != "quantization_config"}
    block = quantization_block(layers, layer_mode=False)
    config["quantization"], config["quantization_config"] = block, dict(block)
    config["umakit"] = {"source": plan.scheme.method, "import_format": IMPORT_FORMAT, "from": str(plan.path)}
    return config


def write(plan: ImportPlan, dest: Path, progress: Callable[[int, int], None] | None = None) -> ImportReport:
    """The import written into the existing, empty directory ``dest`` (``progress``: `tensors`')."""
    start, layers = time.perf_counter(), {}
    written = fill_model_dir_streamed(dest, tensors(plan, layers, progress), lambda: config_of(plan, layers),
                                      copy_from=plan.path, shard_bytes=SHARD_BYTES)
    group = quantization_block(layers, layer_mode=False)["group_size"]  # the most common
    return ImportReport(dest, plan.scheme.method, len(layers), plan.scheme.bits, group, written,
                        time.perf_counter() - start)
