"""Whether a GGUF import is finished: what a later load checks before it reads the import, without the
converter's imports (numpy, gguf: 0.1 s of a one-shot start)."""

from __future__ import annotations

import json
from pathlib import Path

from umakit.checkpoint.writer import WEIGHTS_FILE

# Bump when the output layout changes: cached imports of an older format are then redone.
IMPORT_FORMAT = 1
LEFT_FORMAT = 2  # the same, its quantized layers left in the GGUF (layers.py), which older versions import again
# Beside the weights: the tensors a GGUF holds exactly in groups of 16 (its Q6_K), which MLX's groups (32, 64,
# 128) cannot hold; config.json's umakit.exact_groups names them.
EXACT16_FILE = "exact/groups16.safetensors"
# Their 8-bit copies for the engines that read MLX's layout, written from the exact groups when the first such load
# needs them (`requantized.write`), not by the import: config.json's umakit.exact_groups.requantized names this
# file where an import left them to then (imports before it hold them in the weights).
REQUANTIZED_FILE = "exact/requantized8.safetensors"


def deferred_file(model_dir: Path, config: dict) -> Path | None:
    """Where the 8-bit copies of an import's exact layers go once made, if the import left them to be made."""
    meta = config.get("umakit")
    groups = meta.get("exact_groups") if isinstance(meta, dict) else None
    deferred = isinstance(groups, dict) and groups.get("requantized") == REQUANTIZED_FILE
    return Path(model_dir) / REQUANTIZED_FILE if deferred else None


def is_complete(model_dir: Path) -> bool:
    """Whether ``model_dir`` holds a finished import (cheap: no file is parsed but config.json)."""
    needed = ("config.json", WEIGHTS_FILE, "tokenizer.json", "tokenizer_config.json")
    if not all((model_dir / f).is_file() for f in needed):
        return False
    try:
        meta = json.loads((model_dir / "config.json").read_text())["umakit"]
        return meta["source"] == "gguf" and meta["import_format"] in (IMPORT_FORMAT, LEFT_FORMAT)
    except (OSError, ValueError, KeyError, TypeError):
        return False
