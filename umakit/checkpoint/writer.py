"""Write a model directory: safetensors weights, config.json and the tokenizer's files.

One writer for every directory umakit makes (`umakit quantize`, GGUF imports):
`write_model_dir` builds it atomically (`umakit.core.fsutil.atomic_dir`), so a
failure leaves nothing behind; `fill_model_dir` writes into a directory the
caller already made (the GGUF cache installs its own with a racing rename).
Weights go either as mlx-lm's ``save`` lays them out (5 GB shards and an
index) or as one `WEIGHTS_FILE`.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any, Mapping

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
