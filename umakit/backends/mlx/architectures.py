"""Which model types the installed mlx-lm runs, found without importing it (or mlx).

mlx-lm has one model file per model type, plus a table of types served by
another's code (mistral -> llama). Importing ``mlx_lm`` itself costs seconds
(it imports transformers), so the package is only located and its files read.
"""

from __future__ import annotations

import ast
import functools
import importlib.util
from pathlib import Path


@functools.cache
def _package_dirs() -> tuple[Path, ...]:
    spec = importlib.util.find_spec("mlx_lm")  # locating a top-level package runs none of its code
    if spec is None or not spec.submodule_search_locations:
        return ()
    return tuple(Path(d) for d in spec.submodule_search_locations)


@functools.cache
def _remapping() -> dict[str, str]:
    """mlx-lm's ``MODEL_REMAPPING``, read from its source (importing mlx_lm.utils takes over a second)."""
    for root in _package_dirs():
        try:
            tree = ast.parse((root / "utils.py").read_text(encoding="utf-8"))
        except (OSError, SyntaxError, UnicodeDecodeError):
            continue
        for node in tree.body:
            targets = node.targets if isinstance(node, ast.Assign) else [getattr(node, "target", None)]
            if any(isinstance(t, ast.Name) and t.id == "MODEL_REMAPPING" for t in targets) and node.value is not None:
                try:
                    return dict(ast.literal_eval(node.value))
                except ValueError:
                    return {}
    return {}


def mlx_lm_runs(model_type: str) -> bool:
    """Whether the installed mlx-lm has a model file for ``model_type`` (directly or through its remapping)."""
    names = (model_type, _remapping().get(model_type, model_type))
    return any((root / "models" / f"{name}.py").is_file() for root in _package_dirs() for name in names)
