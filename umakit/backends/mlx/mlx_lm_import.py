"""Import mlx-lm's model and cache modules without its package ``__init__``.

``mlx_lm/__init__.py`` imports its generate/convert helpers and, through them,
transformers (and torch, when installed): 2-6 s before the first token, for
code umakit does not use. The model files need only MLX. So the package is
registered without running its ``__init__``; the first access to an attribute
the package would have defined (``mlx_lm.load``, ``mlx_lm.__version__``, ...)
runs the real ``__init__`` into the same module object, so user code that
imports mlx_lm afterwards sees the normal package.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from types import ModuleType


def _register_lazy_package() -> None:
    spec = importlib.util.find_spec("mlx_lm")
    if spec is None:  # pragma: no cover - declared dependency
        from umakit.errors import BackendUnavailableError

        raise BackendUnavailableError("the mlx backend needs mlx-lm: pip install mlx-lm")
    package: ModuleType = importlib.util.module_from_spec(spec)

    def complete(name: str):
        del package.__getattr__  # run __init__ once; afterwards attributes resolve normally
        spec.loader.exec_module(package)
        return getattr(package, name)

    package.__getattr__ = complete
    sys.modules["mlx_lm"] = package


def import_mlx_lm(module: str) -> ModuleType:
    """``import_mlx_lm("models.llama")`` -> the mlx_lm.models.llama module."""
    if "mlx_lm" not in sys.modules:
        _register_lazy_package()
    return importlib.import_module(f"mlx_lm.{module}")
