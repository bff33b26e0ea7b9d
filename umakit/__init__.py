"""umakit: local LLM inference for unified-memory machines.

    import umakit
    model = umakit.load()                       # the built-in default model
    print(model.generate("Tell me a joke", max_tokens=64, seed=1).text)
"""

from .chat import ChatSession, ChatSettings
from .checkpoint import resolve as resolve_model
from .checkpoint import size_on_disk as checkpoint_size
from .errors import UmakitError
from .gguf import ImportReport, import_gguf
from .generation import Chunk, GenerationResult, GenerationStats
from .model import Model, load
from .sampling import SamplingParams

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
]
__version__ = "0.1.0"
