"""umakit: local LLM inference for unified-memory machines.

    import umakit
    model = umakit.load()                       # the built-in default model
    print(model.generate("Tell me a joke", max_tokens=64, seed=1).text)

`import umakit` stays light (standard library only): the names that need an
engine, numpy or gguf are imported on first use, by `__getattr__` below.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from umakit.checkpoint import resolve as resolve_model
from umakit.checkpoint import size_on_disk as checkpoint_size
from umakit.errors import UmakitError
from umakit.sampling import SamplingParams

if TYPE_CHECKING:
    from umakit.chat import ChatSession, ChatSettings
    from umakit.generation import Chunk, GenerationResult, GenerationStats
    from umakit.gguf import ImportReport, import_gguf
    from umakit.model import Model, load, load_synthetic

# public name -> the module that defines it, imported when the name is first read
_LAZY = {
    "ChatSession": ".chat",
    "ChatSettings": ".chat",
    "Chunk": ".generation",
    "GenerationResult": ".generation",
    "GenerationStats": ".generation",
    "ImportReport": ".gguf",
    "import_gguf": ".gguf",
    "Model": ".model",
    "load": ".model",
    "load_synthetic": ".model",
}

__all__ = [
    "ChatSession",
    "ChatSettings",
    "checkpoint_size",
    "resolve_model",
    "Chunk",
    "GenerationResult",
    "GenerationStats",
    "ImportReport",
    "import_gguf",
    "Model",
    "SamplingParams",
    "UmakitError",
    "load",
    "load_synthetic",
]
__version__ = "0.1.0"


def __getattr__(name: str):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'umakit' has no attribute {name!r}")
    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value  # later reads skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
