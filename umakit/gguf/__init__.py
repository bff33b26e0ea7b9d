"""Import GGUF files (llama.cpp's format) as MLX-quantized Hugging Face directories."""

from .cache import cached_import, import_once
from .convert import ImportReport, LossyTensor, import_gguf

__all__ = ["ImportReport", "LossyTensor", "cached_import", "import_gguf", "import_once"]
