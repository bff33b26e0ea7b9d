"""Turn a GGUF file into a Hugging Face-style directory in MLX's quantized layout.

`plan_import` reads and checks everything (architecture, tensor names and
types, tokenizer) before a byte is written; the conversion then runs tensor by
tensor, and `umakit.checkpoint.writer` writes the result: `write_import` into
a given directory, `import_gguf` atomically, so a failed import leaves
nothing behind.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import NamedTuple

import numpy as np

from umakit.core.affine import quantization_block
from umakit.checkpoint.writer import fill_model_dir
from umakit.core.fsutil import atomic_dir, check_destination, check_not_inside, check_writable
from umakit.errors import UnsupportedModelError
from umakit.checkpoint.gguf import quants
from umakit.checkpoint.gguf.arch import ArchSpec, map_names, qk_row_order, spec_for
from umakit.checkpoint.gguf.finished import EXACT16_FILE, IMPORT_FORMAT, is_complete  # noqa: F401 (is_complete: part of this module's API)
from umakit.checkpoint.gguf.reader import GGUFFile, open_gguf, sha256_file
from umakit.checkpoint.gguf.vocab import TokenizerFiles, build_tokenizer, dumps



class LossyTensor(NamedTuple):
    """A tensor with no exact MLX form, re-quantized."""

    name: str  # HF tensor name in the output
    from_type: str  # GGUF type, e.g. "Q6_K"
    to_bits: int
    max_abs_err: float


@dataclass
class ImportReport:
    """What an import wrote; the CLI prints it."""

    out_dir: Path
    exact_tensors: int  # converted without any change of value (quantized or float)
    lossy_tensors: list[LossyTensor]  # re-quantized, with the largest error each
    bytes_written: int
    seconds: float
    warnings: list[str] = field(default_factory=list)
    exact16: list[str] = field(default_factory=list)  # module paths also kept exactly in groups of 16


@dataclass
class ImportPlan:
    """Everything checked and derived from a GGUF before any output is written."""

    gf: GGUFFile
    spec: ArchSpec
    names: dict[str, str]  # GGUF name -> HF name
    config: dict
    tokenizer: TokenizerFiles


def plan_import(gf: GGUFFile) -> ImportPlan:
    """Check that every part of ``gf`` can be converted; raise before anything is written."""
    spec = spec_for(gf)
    names = map_names(gf, spec)
    unsupported = set()
    for name in names:
        t = gf.tensors[name]
        qtype = t.tensor_type
        if qtype in quants.FLOAT_TYPES:
            continue
        if spec.expert_arrays and quants.can_dequantize(qtype):  # dequantized beside the experts (`_dequantized`)
            continue
        if len(t.shape) != (3 if spec.stacked and spec.stacked(names[name]) else 2):
            raise UnsupportedModelError(f"{gf.path.name}: quantized tensor {name} is not 2-D")
        if qtype not in quants.EXACT and not quants.can_dequantize(qtype):
            unsupported.add(qtype.name)
    if unsupported:
        exact = ", ".join(t.name for t in quants.EXACT)
        raise UnsupportedModelError(
            f"{gf.path.name}: tensor type {', '.join(sorted(unsupported))} is not supported "
            f"(exact: F32, F16, BF16, {exact}; others the gguf package can dequantize are re-quantized)"
        )
    return ImportPlan(gf, spec, names, spec.config(gf), build_tokenizer(gf))


def _reordered(values: np.ndarray, order: np.ndarray | None, cols: np.ndarray | None = None) -> np.ndarray:
    values = values if order is None else values[order]
    return values if cols is None else values[:, cols]


def _float_tensor(t, hf: str, spec: ArchSpec, order: np.ndarray | None, cols: np.ndarray | None = None):
    import mlx.core as mx

    data = np.asarray(t.data)
    bf16 = t.tensor_type == quants.T.BF16
    if bf16:
        data = data.view(np.uint16)
    data = _reordered(data, order, cols)
    if spec.fix is not None:
        if bf16:  # widened exactly to float32 to be changed, and kept so
            data, bf16 = (data.astype(np.uint32) << 16).view(np.float32), False
        data = spec.fix(hf, data)
    arr = mx.array(np.ascontiguousarray(data))
    if bf16:
        arr = arr.view(mx.bfloat16)
    if spec.norm_offset and hf.endswith("norm.weight"):
        arr = (arr.astype(mx.float32) - spec.norm_offset).astype(arr.dtype)
    return arr


def _exact(t, order: np.ndarray | None, cols: np.ndarray | None = None) -> tuple[tuple, int, None]:
    """Repack a block type that is an affine format already; values do not change."""
    aff = quants.to_affine(np.asarray(t.data), t.tensor_type, cols=int(t.shape[0])).reorder(order, cols)
    dtype = quants.pick_dtype(aff.scales, aff.biases)
    return (quants.pack(aff.q, aff.bits), aff.scales.astype(dtype), aff.biases.astype(dtype)), aff.bits, None


def _requantize(t, order: np.ndarray | None, cols: np.ndarray | None = None) -> tuple[tuple, int, float]:
    """Dequantize with the gguf package, re-quantize to MLX; return arrays, bits, max abs error."""
    import mlx.core as mx
    from gguf import quants as gguf_quants

    values = _reordered(gguf_quants.dequantize(np.asarray(t.data), t.tensor_type), order, cols)  # float32
    bits = quants.lossy_bits(t.tensor_type)
    if t.tensor_type in quants.SYMMETRIC and bits == 8:
        return quants.symmetric8(values)
    ref = mx.array(values)
    w, scales, biases = mx.quantize(ref, group_size=quants.GROUP_SIZE, bits=bits)
    half = scales.astype(mx.float16), biases.astype(mx.float16)
    if all(mx.all(mx.isfinite(x)).item() for x in half):
        scales, biases = half
    back = mx.dequantize(
        w, scales.astype(mx.float32), biases.astype(mx.float32), group_size=quants.GROUP_SIZE, bits=bits
    )
    err = mx.max(mx.abs(back - ref)).item()
    mx.eval(w, scales, biases)
    return (w, scales, biases), bits, float(err)


def _exact16(t, order: np.ndarray | None, cols: np.ndarray | None = None) -> tuple[dict[str, np.ndarray], tuple, int,
                                                                                   float]:
    """A `quants.EXACT16` tensor's codes and scales in groups of 16, exactly (MLX's packing, float32 scales; the
    biases are -2^(bits-1) times them), which the torch engine's CPU kernel reads (backends/torch/load/exact.py);
    and, from the same decoding, its symmetric 8-bit re-quantization for MLX's groups, as `_requantize` makes it."""
    aff = quants.to_affine16(np.asarray(t.data), t.tensor_type, cols=int(t.shape[0])).reorder(order, cols)
    exact = {"weight": quants.pack(aff.q, aff.bits), "scales": np.ascontiguousarray(aff.scales, dtype=np.float32)}
    rows, cols = aff.q.shape
    centred = aff.q.reshape(rows, -1, aff.group_size).astype(np.float32) - 2 ** (aff.bits - 1)
    values = (aff.scales[..., None] * centred).reshape(rows, cols)  # the gguf package's products, bit for bit
    return (exact, *quants.symmetric8(values))


def _dequantized(t):
    """A quantized tensor as float32 (the gguf package's values), for a checkpoint whose engines take no
    MLX-quantized tensors beside its own format (gpt-oss's MXFP4)."""
    import mlx.core as mx
    from gguf import quants as gguf_quants

    return mx.array(np.ascontiguousarray(gguf_quants.dequantize(np.asarray(t.data), t.tensor_type), dtype=np.float32))


def _targets(plan: ImportPlan) -> dict[str, list[str]]:
    """Each HF tensor's GGUF tensors: one, or the parts llama.cpp split it into, in `ArchSpec.joins` order."""
    groups: dict[str, list[str]] = {}
    for name, hf in plan.names.items():
        groups.setdefault(hf, []).append(name)
    order = {part: i for i, part in enumerate(plan.spec.joins)}
    return {hf: sorted(g, key=lambda n: order.get(n.split(".", 2)[-1], 0)) for hf, g in groups.items()}


def _joined_type(gf: GGUFFile, names: list[str]):
    """The type `_joined` gives ``names``' tensors, without joining them."""
    types = {gf.tensors[n].tensor_type for n in names}
    return types.pop() if len(types) == 1 else quants.T.F32


def _joined(gf: GGUFFile, names: list[str]):
    """One tensor, or the parts of a split one as one tensor of all their rows: their blocks as stored where all
    are of one type (rows are rows), else their values in float32 (exact, at 4 bytes a weight)."""
    parts = [gf.tensors[n] for n in names]
    if len(parts) == 1:
        return parts[0]
    cols = int(parts[0].shape[0])
    if any(int(p.shape[0]) != cols for p in parts):
        raise UnsupportedModelError(f"{gf.path.name}: {', '.join(names)} have different widths and cannot be joined")
    if len({p.tensor_type for p in parts}) == 1:
        data = np.concatenate([np.asarray(p.data).reshape(int(p.shape[1]), -1) for p in parts])
        return SimpleNamespace(data=data, tensor_type=parts[0].tensor_type, shape=(cols, data.shape[0]))
    from gguf import quants as gguf_quants

    values = np.concatenate([gguf_quants.dequantize(np.asarray(p.data), p.tensor_type).reshape(-1, cols)
                             for p in parts]).astype(np.float32)
    return SimpleNamespace(data=values, tensor_type=quants.T.F32, shape=(cols, values.shape[0]))


def _stacked(t, hf: str, spec: ArchSpec, parts: list[tuple[str, int, int]], arrays: dict, quantized: dict,
             lossy: list) -> int:
    """A 3-D stack of experts (ne = cols, rows, experts), converted as one 2-D tensor of all their rows (a
    quantized row is a row whichever expert it belongs to) and written as ``parts``' modules, each its share of
    every expert's rows. Returns 1 if it stayed exact, else 0 (``lossy`` then has it)."""
    import mlx.core as mx

    cols, rows, n = (int(d) for d in t.shape)
    flat = SimpleNamespace(data=np.asarray(t.data).reshape(n * rows, -1), tensor_type=t.tensor_type,
                           shape=(cols, n * rows))
    if t.tensor_type in quants.FLOAT_TYPES:
        held, bits, err = (_float_tensor(flat, hf, spec, None),), None, None
    else:
        convert = _exact if t.tensor_type in quants.EXACT else _requantize  # groups of 16: re-quantized here
        held, bits, err = convert(flat, None)
    for module, index, count in parts:
        lo, hi = index * rows // count, (index + 1) * rows // count
        for suffix, arr in zip(("weight", "scales", "biases"), held):
            part = arr.reshape(n, rows, -1)[:, lo:hi]
            arrays[f"{module}.{suffix}"] = (mx.array(np.ascontiguousarray(part)) if isinstance(part, np.ndarray)
                                            else mx.contiguous(part))
        if bits is not None:
            quantized[module] = (quants.GROUP_SIZE, bits)
    if err is not None:
        lossy.append(LossyTensor(hf, t.tensor_type.name, bits, err))
    return int(err is None)


@dataclass
class _Converted:
    """A GGUF's tensors in MLX's layout and the files beside them, ready to write."""

    arrays: dict  # HF tensor name -> mx array
    config_text: str
    files: dict[str, str]  # tokenizer and generation files by name
    exact: int
    lossy: list[LossyTensor]
    exact16: dict = field(default_factory=dict)  # HF tensor name -> numpy array, for EXACT16_FILE


def _convert(plan: ImportPlan) -> _Converted:
    import mlx.core as mx

    gf, spec, config = plan.gf, plan.spec, plan.config
    arrays: dict[str, mx.array] = {}
    quantized: dict[str, tuple[int, int]] = {}  # module path -> (group_size, bits)
    lossy: list[LossyTensor] = []
    exact = 0
    exact16: dict[str, np.ndarray] = {}
    groups16: dict[str, dict] = {}  # module path -> its exact groups' bits, group size and GGUF type
    if spec.expert_arrays:
        grouped = spec.expert_arrays(gf)
        arrays.update({k: mx.array(v) for k, v in grouped.items()})
        exact += len(grouped)
    for hf, group in _targets(plan).items():
        name, t = group[0], _joined(gf, group)
        if spec.stacked and (parts := spec.stacked(hf)):
            exact += _stacked(t, hf, spec, parts, arrays, quantized, lossy)
            continue
        rows = int(t.shape[1]) if len(t.shape) == 2 else int(t.shape[0])  # ne = (cols, rows)
        order, cols = qk_row_order(hf, rows, config) if spec.permute_qk else None, None
        if spec.reorder:
            order, cols = spec.reorder(hf, rows, int(t.shape[0]) if len(t.shape) == 2 else 1, config)
        if t.tensor_type in quants.FLOAT_TYPES:
            arrays[hf] = _float_tensor(t, hf, spec, order, cols)
            exact += 1
            continue
        if spec.expert_arrays:
            arrays[hf] = _dequantized(t)
            exact += 1
            continue
        try:
            if t.tensor_type in quants.EXACT16:
                held, packed, bits, err = _exact16(t, order, cols)
                exact16.update({f"{hf.removesuffix('.weight')}.{k}": v for k, v in held.items()})
            else:
                convert = _exact if t.tensor_type in quants.EXACT else _requantize
                packed, bits, err = convert(t, order, cols)
        except ValueError as e:  # a column order the quantized groups cannot follow (Affine.take_cols)
            raise UnsupportedModelError(
                f"{gf.path.name}: {name} ({t.tensor_type.name}) cannot be reordered: {e}") from None
        if err is None:
            exact += 1
        else:
            lossy.append(LossyTensor(hf, t.tensor_type.name, bits, err))
        module = hf.removesuffix(".weight")
        for suffix, arr in zip(("weight", "scales", "biases"), packed):
            arrays[f"{module}.{suffix}"] = mx.array(arr) if isinstance(arr, np.ndarray) else arr
        quantized[module] = (quants.GROUP_SIZE, bits)
        if t.tensor_type in quants.EXACT16:
            groups16[module] = {"bits": quants.EXACT16[t.tensor_type][1], "group_size": quants.EXACT16_GROUP,
                                "from": t.tensor_type.name}
    files = {
        "tokenizer_config.json": dumps(plan.tokenizer.tokenizer_config),
        "generation_config.json": dumps(plan.tokenizer.generation_config),
        "tokenizer.json": plan.tokenizer.tokenizer_json,
    }
    config = _full_config(plan, quantized, lossy)
    if groups16:
        config["umakit"]["exact_groups"] = {"file": EXACT16_FILE, "layers": groups16}
    return _Converted(arrays, dumps(config), files, exact, lossy, exact16)


def _report(plan: ImportPlan, converted: _Converted, out_dir: Path, written: int, start: float) -> ImportReport:
    return ImportReport(
        out_dir=out_dir,
        exact_tensors=converted.exact,
        lossy_tensors=converted.lossy,
        bytes_written=written,
        seconds=time.perf_counter() - start,
        warnings=list(plan.tokenizer.warnings),
        exact16=sorted({k.rsplit(".", 1)[0] for k in converted.exact16}),
    )


def write_import(plan: ImportPlan, dest: Path) -> ImportReport:
    """Convert ``plan.gf`` into the existing, empty directory ``dest``."""
    start = time.perf_counter()
    c = _convert(plan)
    return _report(plan, c, dest, _fill(dest, c), start)


def _fill(dest: Path, c: _Converted) -> int:
    """Write ``c`` into the empty directory ``dest``: the weights, the files beside them and the exact groups of
    16 (`EXACT16_FILE`); returns the bytes written."""
    written = fill_model_dir(dest, c.arrays, c.config_text, files=c.files, sharded=False)
    if c.exact16:
        from safetensors.numpy import save_file

        path = Path(dest) / EXACT16_FILE
        path.parent.mkdir()
        save_file(c.exact16, str(path))
        written += path.stat().st_size
    return written


def import_config(plan: ImportPlan, quantized: dict | None = None) -> dict:
    """The config.json an import of ``plan.gf`` writes, less its provenance (``umakit``); ``quantized`` (module
    path -> (group size, bits)) as the conversion made it, or, when None, as it would (for `umakit plan`)."""
    gf, spec = plan.gf, plan.spec
    if quantized is None:
        quantized = {}
        for hf, group in _targets(plan).items():
            qtype = _joined_type(gf, group)
            if qtype in quants.FLOAT_TYPES or spec.expert_arrays:
                continue
            bits = quants.EXACT[qtype][1] if qtype in quants.EXACT else quants.lossy_bits(qtype)
            parts = spec.stacked(hf) if spec.stacked else None
            for module in [m for m, _, _ in parts] if parts else [hf.removesuffix(".weight")]:
                quantized[module] = (quants.GROUP_SIZE, bits)
    has_bf16 = any(t.tensor_type == quants.T.BF16 for t in gf.tensors.values())
    config = {
        "architectures": [spec.hf_class],
        "model_type": spec.model_type,
        **plan.config,
        **plan.tokenizer.special_ids,
        "torch_dtype": "bfloat16" if has_bf16 or spec.model_type.startswith(("gemma", "gpt_oss")) else "float16",
    }
    if quantized:
        q = quantization_block(quantized, layer_mode=False)  # imports have always written entries without "mode"
        config["quantization"] = q
        config["quantization_config"] = dict(q)
    return config


def _full_config(plan: ImportPlan, quantized: dict, lossy: list[LossyTensor]) -> dict:
    gf = plan.gf
    config = import_config(plan, quantized)
    config["umakit"] = {
        "source": "gguf",
        "import_format": IMPORT_FORMAT,
        "file": gf.path.name,
        "sha256": sha256_file(gf.path),
        "gguf_version": gf.version,
        "lossy_tensors": {
            t.name: {"from": t.from_type, "bits": t.to_bits, "max_abs_err": t.max_abs_err} for t in lossy
        },
    }
    return config


def import_gguf(path: str | os.PathLike, out_dir: str | os.PathLike, force: bool = False) -> ImportReport:
    """Convert the GGUF at ``path`` into a model directory at ``out_dir``.

    Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K and Q5_K tensors convert exactly to MLX
    affine groups; F32/F16/BF16 stay as they are; any other type is
    dequantized and re-quantized, and listed in the report with its error.
    An existing ``out_dir`` is replaced only with ``force``, and only once the
    new one is complete; a failed import leaves nothing behind.
    """
    start = time.perf_counter()  # parsing and checking included
    plan = plan_import(open_gguf(path))
    check_destination(out_dir, force)
    check_not_inside(path, out_dir)  # with --force, replacing a folder that holds the GGUF would destroy it
    check_writable(out_dir)
    c = _convert(plan)
    with atomic_dir(out_dir, force=force) as tmp:
        written = _fill(Path(tmp), c)
    return _report(plan, c, Path(out_dir), written, start)
