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

from umakit.errors import UmakitError

if TYPE_CHECKING:
    from umakit.api import LoadInfo, Model, load, load_synthetic
    from umakit.checkpoint.files import resolve as resolve_model
    from umakit.checkpoint.files import size_on_disk as checkpoint_size
    from umakit.generate.sampling import SamplingParams
    from umakit.checkpoint.gguf import ImportReport, import_gguf
    from umakit.generate.batch import BatchRun, BatchStats, BatchStream
    from umakit.generate.chat import ChatSession, ChatSettings
    from umakit.generate.stream import Chunk, GenerationResult, GenerationStats

# public name -> the module that defines it (and the name there, where it differs), imported when first read
_LAZY = {
    "checkpoint_size": "umakit.checkpoint.files:size_on_disk",
    "resolve_model": "umakit.checkpoint.files:resolve",
    "SamplingParams": "umakit.generate.sampling",
    "BatchRun": "umakit.generate.batch",
    "BatchStats": "umakit.generate.batch",
    "BatchStream": "umakit.generate.batch",
    "ChatSession": "umakit.generate.chat",
    "ChatSettings": "umakit.generate.chat",
    "Chunk": "umakit.generate.stream",
    "GenerationResult": "umakit.generate.stream",
    "GenerationStats": "umakit.generate.stream",
    "ImportReport": "umakit.checkpoint.gguf",
    "import_gguf": "umakit.checkpoint.gguf",
    "LoadInfo": "umakit.api",
    "Model": "umakit.api",
    "load": "umakit.api",
    "load_synthetic": "umakit.api",
}

__all__ = sorted({*_LAZY, "UmakitError"})
__version__ = "0.1.0"


# subpackages reachable as attributes once umakit is imported (``umakit.quantize.quantize(...)``), on first use
_SUBPACKAGES = frozenset({"backends", "bench", "checkpoint", "core", "evaluate", "generate", "hardware", "plan",
                          "quantize", "serve"})


def __getattr__(name: str):
    if name in _SUBPACKAGES:
        return importlib.import_module(f"umakit.{name}")
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'umakit' has no attribute {name!r}")
    module, _, attr = module.partition(":")
    value = getattr(importlib.import_module(module), attr or name)
    globals()[name] = value  # later reads skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
