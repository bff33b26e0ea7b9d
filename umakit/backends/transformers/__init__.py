"""The transformers engine: any architecture the installed transformers runs, on PyTorch (CUDA or CPU).

umakit's torch engine has compact model code for nine families (its `ARCHITECTURES`), which its fused CPU step,
offload and tensor parallel need. A checkpoint of any other family transformers knows (gemma4, the hybrid
qwen3_next and qwen3_5, lfm2, ...) runs here on transformers' own model classes, with umakit's cache protocol, sampler,
batch rows and measurements around them (engine.py). "auto" takes it when neither compact engine runs the model.

Importing this package imports neither torch nor transformers: the registry reads `SPEC`, and finding an
architecture looks for transformers' model folder on disk.
"""

from __future__ import annotations

import functools
import importlib.util
from pathlib import Path

from umakit.backends.base import BATCH, CONSTRAIN, LOOKUP, EngineSpec


@functools.cache
def _models_dir() -> Path | None:
    spec = importlib.util.find_spec("transformers")  # locating a top-level package runs none of its code
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations))) / "models"


def transformers_runs(model_type: str) -> bool:
    """Whether the installed transformers has model code for ``model_type``: its models/<type>/ folder, where a
    text model of a multimodal family (gemma4_text) lives in its family's (gemma4)."""
    root = _models_dir()
    if root is None or not model_type:
        return False
    name = model_type.replace("-", "_")
    return any((root / n).is_dir() for n in (name, name.removesuffix("_text")))


SPEC = EngineSpec(name="transformers", module="umakit.backends.transformers.engine", cls="TransformersEngine",
                  dependency="transformers", requires=("torch",), extra="umakit[cuda]", devices=("cuda", "cpu"),
                  features=frozenset({BATCH, CONSTRAIN, LOOKUP}), finds_architecture=transformers_runs,
                  architectures_source="architecture the installed transformers has model code for")


def __getattr__(name):
    if name == "TransformersEngine":
        from umakit.backends.transformers.engine import TransformersEngine

        return TransformersEngine
    raise AttributeError(name)
