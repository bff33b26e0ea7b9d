"""Which checkpoints are imported (a foreign ``quant_method``) and whether an import is finished: what every load
asks, without the converter's numpy."""

from __future__ import annotations

import json
from pathlib import Path

METHODS = ("gptq", "awq", "compressed-tensors")
IMPORT_FORMAT = 1  # bump when the output changes: cached imports are redone


def method_of(config: dict) -> str | None:
    """The checkpoint's foreign integer format (``quantization_config.quant_method``), None where it has none or
    is MLX-quantized already (an mlx-lm ``quantization`` block)."""
    q = config.get("quantization_config")
    if not isinstance(q, dict) or isinstance(config.get("quantization"), dict):
        return None
    method = q.get("quant_method")
    return method if method in METHODS else None


def is_complete(model_dir: Path) -> bool:
    """Whether ``model_dir`` holds a finished import of this format (only config.json is read)."""
    try:
        meta = json.loads((model_dir / "config.json").read_text())["umakit"]
        return meta["source"] in METHODS and meta["import_format"] == IMPORT_FORMAT and any(
            model_dir.glob("*.safetensors"))
    except (OSError, ValueError, KeyError, TypeError):
        return False
