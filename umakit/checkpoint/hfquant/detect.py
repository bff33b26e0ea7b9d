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


# formats MLX runs as they are stored (OpenAI's gpt-oss checkpoints: MXFP4 experts, FP4 E2M1 values in pairs a
# byte, a shared E8M0 exponent per 32): their ``quantization_config`` as the mlx-lm ``quantization`` block it is
NATIVE = {"mxfp4": {"group_size": 32, "bits": 4, "mode": "mxfp4"}}


def native_block(config: dict) -> dict | None:
    """The mlx-lm ``quantization`` block of a checkpoint quantized in a format MLX holds as it is (`NATIVE`),
    else None."""
    q = config.get("quantization_config")
    if not isinstance(q, dict) or isinstance(config.get("quantization"), dict):
        return None
    block = NATIVE.get(q.get("quant_method"))
    return dict(block) if block else None


# where older checkpoints keep their quantization beside config.json instead of in it: AutoGPTQ's, AutoAWQ's
SIDE_FILES = {"quantize_config.json": "gptq", "quant_config.json": "awq"}


def with_side_file(path: Path, config: dict) -> dict:
    """``config``, its ``quantization_config`` read from AutoGPTQ's ``quantize_config.json`` or AutoAWQ's
    ``quant_config.json`` where config.json has none (checkpoints made before transformers read them)."""
    if isinstance(config.get("quantization_config"), dict) or isinstance(config.get("quantization"), dict):
        return config
    for name, method in SIDE_FILES.items():
        try:
            q = json.loads((path / name).read_text())
        except (OSError, ValueError):
            continue
        if isinstance(q, dict):
            return {**config, "quantization_config": {"quant_method": method, **q}}
    return config


def foreign_block(config: dict) -> dict | None:
    """A foreign integer checkpoint's bits and group size as an mlx-lm ``quantization`` block of what its import
    holds (a row's one scale as groups of 128; the embedding and head float, as these formats leave them), for what
    plans and lists it before it is imported; compressed-tensors nests them in its scheme."""
    method = method_of(config)
    if method is None:
        return None
    q = config["quantization_config"]
    if method == "compressed-tensors":
        groups = [g for g in (q.get("config_groups") or {}).values() if isinstance(g, dict)]
        weights = groups[0].get("weights") if groups else None
        if not isinstance(weights, dict) or "num_bits" not in weights:
            return None
        bits, group = weights["num_bits"], weights.get("group_size")
    else:
        bits, group = q.get("bits", q.get("w_bit", 4)), q.get("group_size", q.get("q_group_size", 128))
    group = group if isinstance(group, int) and 0 < group <= 128 else 128
    return {"bits": bits, "group_size": group, "quant_method": method, "model.embed_tokens": False, "lm_head": False}


def is_complete(model_dir: Path) -> bool:
    """Whether ``model_dir`` holds a finished import of this format (only config.json is read)."""
    try:
        meta = json.loads((model_dir / "config.json").read_text())["umakit"]
        return meta["source"] in METHODS and meta["import_format"] == IMPORT_FORMAT and any(
            model_dir.glob("*.safetensors"))
    except (OSError, ValueError, KeyError, TypeError):
        return False
