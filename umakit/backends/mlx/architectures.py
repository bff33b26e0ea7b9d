"""Which model types the installed mlx-lm runs, found without importing it (or mlx).

mlx-lm has one model file per model type, plus a table of types served by
another's code (mistral -> llama). Importing ``mlx_lm`` itself costs seconds
(it imports transformers), so the package is only located and its files read.
"""

from __future__ import annotations

import ast
import functools
import importlib.util
import re
from pathlib import Path


@functools.cache
def _package_dirs() -> tuple[Path, ...]:
    spec = importlib.util.find_spec("mlx_lm")  # locating a top-level package runs none of its code
    if spec is None or not spec.submodule_search_locations:
        return ()
    return tuple(Path(d) for d in spec.submodule_search_locations)


@functools.cache
def _remapping() -> dict[str, str]:
    """mlx-lm's ``MODEL_REMAPPING``, read from its source (importing mlx_lm.utils takes over a second, parsing the
    whole file a tenth of one): the dict literal after the name, taken to its closing brace."""
    for root in _package_dirs():
        try:
            text = (root / "utils.py").read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        found = re.search(r"^MODEL_REMAPPING\b[^=\n]*=\s*\{", text, re.MULTILINE)
        if found is None:
            continue
        start = found.end() - 1
        end = text.find("\n}", start)
        try:
            value = ast.literal_eval(text[start : end + 2] if end >= 0 else "")
        except (ValueError, SyntaxError):
            return {}
        return dict(value) if isinstance(value, dict) else {}
    return {}


# Text-only checkpoints (transformers' *ForCausalLM of a multimodal family) whose mlx-lm file is the multimodal
# one: it takes the text model's flat config as its text_config.
TEXT_ONLY = {"qwen3_5_text": "qwen3_5", "qwen3_5_moe_text": "qwen3_5_moe"}


def mlx_lm_type(model_type: str) -> str:
    """The mlx-lm model file that runs ``model_type``: mlx-lm's remapping, then umakit's `TEXT_ONLY`."""
    model_type = _remapping().get(model_type, model_type)
    return TEXT_ONLY.get(model_type, model_type)


def mlx_lm_runs(model_type: str) -> bool:
    """Whether the installed mlx-lm has a model file for ``model_type`` (directly or through its remapping)."""
    names = (model_type, mlx_lm_type(model_type))
    return any((root / "models" / f"{name}.py").is_file() for root in _package_dirs() for name in names)


@functools.cache
def reads_rope_scaling(model_file: str) -> bool:
    """Whether an mlx-lm model file reads its config's ``rope_scaling`` (or ``rope_parameters``): uses it in an
    expression (``args.rope_scaling``, ``config["rope_scaling"]``). Declaring the field in ModelArgs, as
    qwen3_moe.py and mixtral.py do, and never reading it, is not enough: such a model runs unscaled."""
    try:
        tree = ast.parse(Path(model_file).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, SyntaxError):
        return True  # unreadable: not ours to refuse
    names = {"rope_scaling", "rope_parameters"}
    return any((isinstance(node, ast.Attribute) and node.attr in names)
               or (isinstance(node, ast.Constant) and node.value in names) for node in ast.walk(tree))
