"""Import GGUF files (llama.cpp's format) as MLX-quantized Hugging Face directories."""

from umakit.checkpoint.gguf.store import cached_import, import_once

__all__ = ["ImportReport", "LossyTensor", "cached_import", "import_gguf", "import_once"]


def __getattr__(name):
    if name in ("ImportReport", "LossyTensor", "import_gguf"):  # the converter (numpy, gguf): imported on use
        from umakit.checkpoint.gguf import convert

        return getattr(convert, name)
    raise AttributeError(name)
