"""Write a model directory: safetensors weights, config.json and the tokenizer's files.

One writer for every directory umakit makes (`umakit quantize`, GGUF imports):
`write_model_dir` builds it atomically (`umakit.core.fsutil.atomic_dir`), so a
failure leaves nothing behind; `fill_model_dir` writes into a directory the
caller already made. Weights go either as mlx-lm's ``save`` lays them out
(5 GB shards and an index) or as one `WEIGHTS_FILE`; a GGUF import writes its
one file a tensor at a time (`StreamedSafetensors`), then `finish_model_dir`
the files beside it.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping

from umakit.core.fsutil import atomic_dir

WEIGHTS_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
MAX_SHARD_BYTES = 5 << 30  # mlx-lm's MAX_FILE_SIZE_GB
# Everything but the weights that a model directory needs, copied as is from a source checkpoint.
COPIED_FILES = (
    "tokenizer.json", "tokenizer_config.json", "tokenizer.model", "special_tokens_map.json",
    "added_tokens.json", "vocab.json", "merges.txt", "chat_template.json", "chat_template.jinja",
    "generation_config.json", "LICENSE", "LICENSE.txt", "LICENSE.md", "NOTICE",
)


class StreamedSafetensors:
    """One safetensors file written a tensor at a time, so memory holds one tensor, not the model.

    The header goes first in the format but is known last: ``reserve`` bytes are left for it, and it is written
    into them at `close`, padded with spaces (the format allows them after the JSON). A header that outgrows
    its room (a low guess) costs one copy of the data into a new file, never a wrong one. Tensors are numpy
    arrays or mx arrays; they are written as they come, with no gaps, as the format requires.
    """

    def __init__(self, path: Path, reserve: int = 1 << 16, metadata: dict[str, str] | None = None):
        self.path, self._room = Path(path), -(-max(reserve, 64) // 8) * 8
        self._meta, self._header, self._size = metadata, {}, 0
        self._f = open(self.path, "wb")
        self._f.seek(8 + self._room)

    def __setitem__(self, name: str, array) -> None:
        if name in self._header:
            raise ValueError(f"tensor {name} written twice")
        dtype, raw = _raw(array)
        self._f.write(raw)
        self._header[name] = {"dtype": dtype, "shape": list(array.shape),
                              "data_offsets": [self._size, self._size + raw.nbytes]}
        self._size += raw.nbytes

    def update(self, arrays: Mapping[str, Any]) -> None:
        for name, array in arrays.items():
            self[name] = array

    def __len__(self) -> int:
        return len(self._header)

    def close(self) -> int:
        """Write the header; returns the file's size."""
        meta = {"__metadata__": self._meta} if self._meta else {}
        header = json.dumps({**meta, **self._header}, separators=(",", ":")).encode()
        with self._f:
            if len(header) <= self._room:
                self._f.seek(0)
                self._f.write(struct.pack("<Q", self._room) + header.ljust(self._room, b" "))
                return 8 + self._room + self._size
        start, self._room = 8 + self._room, -(-len(header) // 8) * 8
        moved = self.path.with_name(self.path.name + ".data")
        os.rename(self.path, moved)
        try:
            with open(moved, "rb") as src, open(self.path, "wb") as dst:
                dst.write(struct.pack("<Q", self._room) + header.ljust(self._room, b" "))
                src.seek(start)
                shutil.copyfileobj(src, dst, 1 << 24)
        finally:
            moved.unlink()
        return 8 + self._room + self._size

    def abort(self) -> None:
        self._f.close()


_DTYPES = {"float32": "F32", "float16": "F16", "bfloat16": "BF16", "float64": "F64", "uint8": "U8", "int8": "I8",
           "uint16": "U16", "int16": "I16", "uint32": "U32", "int32": "I32", "uint64": "U64", "int64": "I64",
           "bool": "BOOL"}


def _raw(array) -> tuple[str, memoryview]:
    """A numpy or mx array's safetensors dtype and its bytes, C order."""
    import numpy as np

    if not isinstance(array, np.ndarray):  # an mx array: through numpy, bfloat16 as its raw 16 bits
        import mlx.core as mx

        name = str(array.dtype).removeprefix("mlx.core.")
        array = np.array(array.view(mx.uint16) if array.dtype == mx.bfloat16 else array)
    else:
        name = array.dtype.name
    if name not in _DTYPES:
        raise ValueError(f"no safetensors dtype for {name}")
    return _DTYPES[name], memoryview(np.ascontiguousarray(array)).cast("B")


def _shards(weights: Mapping[str, Any]) -> list[dict[str, Any]]:
    shards: list[dict[str, Any]] = []
    size = 0
    for k, v in weights.items():
        if not shards or size + v.nbytes > MAX_SHARD_BYTES:
            shards.append({})
            size = 0
        shards[-1][k] = v
        size += v.nbytes
    return shards


def _save(file: Path, arrays: dict) -> None:
    import mlx.core as mx

    # Through a Python file, so a full disk is an OSError with its errno (a path gives a bare RuntimeError).
    with open(file, "wb") as f:
        mx.save_safetensors(f, arrays, metadata={"format": "mlx"})


def _write_weights(dest: Path, weights: Mapping[str, Any], sharded: bool) -> None:
    if not sharded:
        _save(dest / WEIGHTS_FILE, dict(weights))
        return
    shards = _shards(weights)
    weight_map = {}
    for i, shard in enumerate(shards):
        name = WEIGHTS_FILE if len(shards) == 1 else f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        _save(dest / name, shard)
        weight_map.update(dict.fromkeys(shard, name))
    index = {"metadata": {"total_size": sum(v.nbytes for v in weights.values())},
             "weight_map": dict(sorted(weight_map.items()))}
    (dest / INDEX_FILE).write_text(json.dumps(index, indent=4))


def fill_model_dir(
    dest: Path,
    weights: Mapping[str, Any],
    config: dict | str,
    *,
    files: Mapping[str, str] | None = None,
    copy_from: Path | None = None,
    sharded: bool = True,
) -> int:
    """Write a model into the existing, empty directory ``dest``; returns the bytes written.

    ``weights`` maps checkpoint names to mx arrays. ``config`` is config.json's
    object (written with mlx-lm's indent of 4) or its finished text. ``files``
    are further files by name, as text (a GGUF import's tokenizer.json);
    ``copy_from`` is a checkpoint whose `COPIED_FILES` are copied as they are.
    ``sharded``: mlx-lm's layout, shards of at most `MAX_SHARD_BYTES` and an
    index even for one file; otherwise a single `WEIGHTS_FILE`, no index.
    """
    _write_weights(dest, weights, sharded)
    return finish_model_dir(dest, config, files, copy_from)


def fill_model_dir_streamed(dest: Path, items: Iterable[tuple[str, Any]], config: Callable[[], dict], *,
                            copy_from: Path | None = None, shard_bytes: int = MAX_SHARD_BYTES) -> int:
    """`fill_model_dir` for weights that come one at a time (an import of a model too large to hold whole):
    shards of at most ``shard_bytes`` written as they fill, so memory holds one; ``config`` is asked for
    config.json's object once every weight is written. Returns the bytes written."""
    names, weight_map, shard, size = [], {}, {}, 0

    def flush():
        names.append(f"model-{len(names) + 1:05d}.safetensors")
        _save(dest / names[-1], shard)
        weight_map.update(dict.fromkeys(shard, names[-1]))

    total = 0
    for k, v in items:
        if shard and size + v.nbytes > shard_bytes:
            flush()
            shard, size = {}, 0
        shard[k], size, total = v, size + v.nbytes, total + v.nbytes
    flush()
    final = {n: WEIGHTS_FILE if len(names) == 1 else f"model-{i + 1:05d}-of-{len(names):05d}.safetensors"
             for i, n in enumerate(names)}
    for n, f in final.items():
        os.rename(dest / n, dest / f)
    index = {"metadata": {"total_size": total},
             "weight_map": dict(sorted((k, final[v]) for k, v in weight_map.items()))}
    (dest / INDEX_FILE).write_text(json.dumps(index, indent=4))
    return finish_model_dir(dest, config(), None, copy_from)


def finish_model_dir(dest: Path, config: dict | str, files: Mapping[str, str] | None = None,
                     copy_from: Path | None = None) -> int:
    """config.json and the other files beside the weights; the bytes of every file in ``dest``."""
    text = config if isinstance(config, str) else json.dumps(config, indent=4)
    (dest / "config.json").write_text(text, encoding="utf-8")
    for name, content in (files or {}).items():
        (dest / name).write_text(content, encoding="utf-8")
    if copy_from is not None:
        for name in COPIED_FILES:
            if (copy_from / name).is_file() and name not in (files or {}):
                shutil.copy2(copy_from / name, dest / name)
    return sum(p.stat().st_size for p in dest.iterdir() if p.is_file())


def write_model_dir(
    dst: str | os.PathLike,
    weights: Mapping[str, Any],
    config: dict | str,
    *,
    files: Mapping[str, str] | None = None,
    copy_from: Path | None = None,
    sharded: bool = True,
    force: bool = False,
) -> int:
    """`fill_model_dir` into a fresh directory renamed to ``dst`` once complete; returns the bytes written.

    An existing ``dst`` is an error unless ``force``; it is replaced only after
    the new directory is complete, and a failure leaves nothing behind.
    """
    with atomic_dir(dst, force=force) as tmp:
        return fill_model_dir(tmp, weights, config, files=files, copy_from=copy_from, sharded=sharded)
