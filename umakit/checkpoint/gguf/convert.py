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
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import NamedTuple

import numpy as np

from umakit.core.affine import quantization_block
from umakit.checkpoint.config import architecture
from umakit.checkpoint.writer import WEIGHTS_FILE, StreamedSafetensors, finish_model_dir
from umakit.core.fsutil import atomic_dir, check_destination, check_not_inside, check_writable
from umakit.errors import UnsupportedModelError
from umakit.checkpoint.gguf import left_layers, quants, tensors
from umakit.checkpoint.gguf.arch import ArchSpec, map_names, qk_row_order, spec_for
from umakit.checkpoint.gguf.finished import EXACT16_FILE, IMPORT_FORMAT, LEFT_FORMAT, REQUANTIZED_FILE
from umakit.checkpoint.gguf.finished import is_complete  # noqa: F401 (part of this module's API)
from umakit.checkpoint.gguf.reader import Digest, GGUFFile, open_gguf, sha256_file
from umakit.checkpoint.gguf.vocab import TokenizerFiles, build_tokenizer, dumps

Progress = Callable[[int, int], None]  # (bytes done, bytes in all)
DeferCopies = bool | Callable[[str | None], bool]  # `write_import`'s


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
        if spec.expert_arrays and quants.can_dequantize(qtype):  # beside the experts: `tensors.dequantized`
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
        held, bits, err = (tensors.float_tensor(flat, hf, spec, None),), None, None
    else:
        # groups of 16: re-quantized here
        convert = tensors.exact if t.tensor_type in quants.EXACT else tensors.requantize
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
    """What a conversion wrote besides the weights, and what it found."""

    config_text: str
    files: dict[str, str]  # tokenizer and generation files by name
    exact: int
    lossy: list[LossyTensor]
    exact16: list[str]  # module paths also written exactly in groups of 16 (EXACT16_FILE)


class _Groups16:
    """`EXACT16_FILE`, made when the first tensor kept exactly in groups of 16 comes, and written as they come;
    ``defers``: their 8-bit copies are left to the first load that reads them (requantized.py), not written;
    ``leaves``: the tensors `left_layers.leaves` takes are left in the GGUF (``left``: their records), not converted."""

    def __init__(self, path: Path, defers: bool, leaves: bool = False):
        self.path, self.file, self.modules, self.defers = path, None, [], defers
        self.leaves, self.left = leaves, {}

    def add(self, module: str, held: dict[str, np.ndarray]) -> None:
        if self.file is None:
            self.path.parent.mkdir()
            self.file = StreamedSafetensors(self.path)
        self.file.update({f"{module}.{k}": v for k, v in held.items()})
        self.modules.append(module)

    def close(self) -> int:
        return self.file.close() if self.file is not None else 0

    def abort(self) -> None:
        if self.file is not None:
            self.file.abort()


def _convert(plan: ImportPlan, arrays: StreamedSafetensors, groups16_file: _Groups16, digest: Digest | None,
             progress: Progress | None = None) -> _Converted:
    """Convert ``plan.gf`` tensor by tensor into ``arrays`` (and ``groups16_file``), each written as it is made,
    its GGUF pages let go of, so memory holds one tensor and its temporaries; ``progress(done, total)`` hears
    the GGUF's tensor bytes converted after each. ``digest``: the file's, for its provenance (None: an import
    that leaves its layers in the GGUF names the file by path, size and modification time instead, `left_layers.record`,
    unless it left none: hashing a 1.3 GB file took 1.1 s of such an import's 1.6 s)."""
    import mlx.core as mx

    gf, spec, config = plan.gf, plan.spec, plan.config
    quantized: dict[str, tuple[int, int]] = {}  # module path -> (group_size, bits)
    lossy: list[LossyTensor] = []
    exact = 0
    groups16: dict[str, dict] = {}  # module path -> its exact groups' bits, group size and GGUF type
    if spec.expert_arrays:
        grouped = spec.expert_arrays(gf)
        arrays.update({k: mx.array(v) for k, v in grouped.items()})
        exact += len(grouped)
    targets = _targets(plan)
    done, total = 0, sum(gf.tensors[n].n_bytes for group in targets.values() for n in group)
    for hf, group in targets.items():
        name, t = group[0], _joined(gf, group)
        exact += _one(plan, hf, t, name, arrays, groups16_file, quantized, lossy, groups16)
        gf.release(group)
        done += sum(gf.tensors[n].n_bytes for n in group)
        if progress:
            progress(done, total)
    files = {
        "tokenizer_config.json": dumps(plan.tokenizer.tokenizer_config),
        "generation_config.json": dumps(plan.tokenizer.generation_config),
        "tokenizer.json": plan.tokenizer.tokenizer_json,
    }
    sha256 = digest.result() if digest else None if groups16_file.left else sha256_file(gf.path)
    config = _full_config(plan, quantized, lossy, sha256)
    if groups16:
        config["umakit"]["exact_groups"] = {"file": EXACT16_FILE, "layers": groups16}
        if groups16_file.defers:
            config["umakit"]["exact_groups"]["requantized"] = REQUANTIZED_FILE
    if groups16_file.left:
        config["umakit"]["gguf_layers"] = left_layers.record(gf.path, groups16_file.left)
        config["umakit"]["import_format"] = LEFT_FORMAT
    return _Converted(dumps(config), files, exact, lossy, groups16_file.modules)


def _one(plan: ImportPlan, hf: str, t, name: str, arrays: StreamedSafetensors, groups16_file: _Groups16,
         quantized: dict, lossy: list, groups16: dict) -> int:
    """Convert one tensor ``t`` (GGUF ``name``, HF ``hf``) into ``arrays``; 1 if it stayed exact, else 0."""
    gf, spec, config = plan.gf, plan.spec, plan.config
    if spec.stacked and (parts := spec.stacked(hf)):
        return _stacked(t, hf, spec, parts, arrays, quantized, lossy)
    rows = int(t.shape[1]) if len(t.shape) == 2 else int(t.shape[0])  # ne = (cols, rows)
    order, cols = qk_row_order(hf, rows, config) if spec.permute_qk else None, None
    if spec.reorder:
        order, cols = spec.reorder(hf, rows, int(t.shape[0]) if len(t.shape) == 2 else 1, config)
    if t.tensor_type in quants.FLOAT_TYPES:
        arrays[hf] = tensors.float_tensor(t, hf, spec, order, cols)
        return 1
    if spec.expert_arrays:
        arrays[hf] = tensors.dequantized(t)
        return 1
    module = hf.removesuffix(".weight")
    if groups16_file.leaves and not spec.reorder and left_layers.leaves(t, module, config):  # packed from its blocks
        groups16_file.left[module] = left_layers.entry(t, order is not None)
        exact16 = t.tensor_type in quants.EXACT16
        quantized[module] = (quants.GROUP_SIZE, quants.lossy_bits(t.tensor_type) if exact16 else
                             quants.EXACT[t.tensor_type][1])
        return 1
    try:
        if t.tensor_type in quants.EXACT16:  # held exactly, and its 8-bit copy now or on first use
            (held, codes), bits = tensors.exact16(t, order, cols), quants.EXACT16[t.tensor_type][1]
            groups16_file.add(module, held)
            groups16[module] = {"bits": bits, "group_size": quants.EXACT16_GROUP, "from": t.tensor_type.name}
            if groups16_file.defers:
                quantized[module] = (quants.GROUP_SIZE, quants.lossy_bits(t.tensor_type))
                return 1
            packed, bits, err = tensors.requantized16(codes, held["scales"], bits)
        else:
            convert = tensors.exact if t.tensor_type in quants.EXACT else tensors.requantize
            packed, bits, err = convert(t, order, cols)
    except ValueError as e:  # a column order the quantized groups cannot follow (Affine.take_cols)
        raise UnsupportedModelError(
            f"{gf.path.name}: {name} ({t.tensor_type.name}) cannot be reordered: {e}") from None
    if err is not None:
        lossy.append(LossyTensor(hf, t.tensor_type.name, bits, err))
    for suffix, arr in zip(("weight", "scales", "biases"), packed):
        arrays[f"{module}.{suffix}"] = arr
    quantized[module] = (quants.GROUP_SIZE, bits)
    return int(err is None)


def _report(plan: ImportPlan, converted: _Converted, out_dir: Path, written: int, start: float) -> ImportReport:
    return ImportReport(
        out_dir=out_dir,
        exact_tensors=converted.exact,
        lossy_tensors=converted.lossy,
        bytes_written=written,
        seconds=time.perf_counter() - start,
        warnings=list(plan.tokenizer.warnings),
        exact16=sorted(converted.exact16),
    )


def write_import(plan: ImportPlan, dest: Path, progress: Progress | None = None,
                 defer_copies: DeferCopies = False, leave_layers: DeferCopies = False) -> ImportReport:
    """Convert ``plan.gf`` into the existing, empty directory ``dest``; ``progress(done, total)``: the GGUF's
    tensor bytes converted, after each tensor; ``defer_copies``: the 8-bit copies of Q6_K layers are left to the
    first load that reads them (requantized.py), not written (True, or a test of the model's architecture, the
    language model's model_type, as the engine that will load it is chosen by it); ``leave_layers`` (the same
    kinds of value): the layers `left_layers.leaves` takes are left in the GGUF, for the CPU kernel's first load."""
    start = time.perf_counter()
    kind = architecture({"model_type": plan.spec.model_type, **plan.config})
    defer_copies, leave_layers = (f(kind) if callable(f) else f for f in (defer_copies, leave_layers))
    c, written = _fill(dest, plan, progress, defer_copies, leave_layers)
    return _report(plan, c, dest, written, start)


def _fill(dest: Path, plan: ImportPlan, progress: Progress | None = None,
          defer_copies: bool = False, leave_layers: bool = False) -> tuple[_Converted, int]:
    """Convert ``plan.gf`` into the empty directory ``dest``: the weights as they are made, then the files beside
    them (config.json last); returns what was converted and the bytes written. ``defer_copies``: `_Groups16`'s."""
    reserve = (1 << 16) + 768 * len(plan.gf.tensors)  # the header's room: about 3 entries a GGUF tensor
    weights = StreamedSafetensors(Path(dest) / WEIGHTS_FILE, reserve, metadata={"format": "mlx"})
    groups16 = _Groups16(Path(dest) / EXACT16_FILE, defer_copies, leave_layers)
    digest = None if leave_layers else Digest(plan.gf.path)  # hashed beside the conversion
    try:
        c = _convert(plan, weights, groups16, digest, progress)
    except BaseException:
        if digest:
            digest.cancel()
        weights.abort()
        groups16.abort()
        raise
    weights.close()
    return c, groups16.close() + finish_model_dir(dest, c.config_text, c.files)  # with the weights' file


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


def _full_config(plan: ImportPlan, quantized: dict, lossy: list[LossyTensor], sha256: str | None) -> dict:
    gf = plan.gf
    config = import_config(plan, quantized)
    config["umakit"] = {
        "source": "gguf",
        "import_format": IMPORT_FORMAT,
        "file": gf.path.name,
        "sha256": sha256,
        "gguf_version": gf.version,
        "lossy_tensors": {
            t.name: {"from": t.from_type, "bits": t.to_bits, "max_abs_err": t.max_abs_err} for t in lossy
        },
    }
    return config


def import_gguf(path: str | os.PathLike, out_dir: str | os.PathLike, force: bool = False,
                progress: Progress | None = None) -> ImportReport:
    """Convert the GGUF at ``path`` into a model directory at ``out_dir``.

    Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K and Q5_K tensors convert exactly to MLX
    affine groups; F32/F16/BF16 stay as they are; any other type is
    dequantized and re-quantized, and listed in the report with its error (Q6_K is kept exactly too, in groups
    of 16; the directory holds its 8-bit copies as well, so that mlx-lm serves it as it is).
    An existing ``out_dir`` is replaced only with ``force``, and only once the
    new one is complete; a failed import leaves nothing behind. ``progress(done, total)`` hears the GGUF's
    tensor bytes converted, after each tensor.
    """
    start = time.perf_counter()  # parsing and checking included
    plan = plan_import(open_gguf(path))
    check_destination(out_dir, force)
    check_not_inside(path, out_dir)  # with --force, replacing a folder that holds the GGUF would destroy it
    check_writable(out_dir)
    with atomic_dir(out_dir, force=force) as tmp:
        c, written = _fill(Path(tmp), plan, progress)
    return _report(plan, c, Path(out_dir), written, start)
