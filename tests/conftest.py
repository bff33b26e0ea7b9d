"""Fixtures every test folder shares: tiny checkpoints, loaded models, one torch thread, an isolated
$UMAKIT_HOME. Helpers a test imports live in tests/support/."""

import importlib.util
import os
import sys
from pathlib import Path

import pytest

from support.tiny import make_tiny_model

# The fused CPU decode step's C++ build (umakit/backends/torch/cpu/build.py) is kept across test runs, so
# only the first run on a machine compiles it; every test process, subprocesses included, finds it here.
ROOT = Path(__file__).resolve().parent.parent
os.environ.setdefault("UMAKIT_NATIVE_DIR", str(ROOT / ".pytest_cache" / "umakit-native"))
# `umakit run` and `generate` attach to a server answering at $UMAKIT_HOST: none does at port 9 (discard), so no
# test talks to a server the developer left running; the attach tests name theirs with --server.
os.environ["UMAKIT_HOST"] = "http://127.0.0.1:9"


def pytest_sessionstart(session):
    """Build (or load) that library before any test times anything."""
    if importlib.util.find_spec("torch") is not None:
        from umakit.backends.torch.cpu import build

        build.ensure()


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory):
    """``tiny_dir(family)`` -> path of a tiny random checkpoint, written once per session."""
    made = {}

    def get(family: str = "llama"):
        if family not in made:
            made[family] = make_tiny_model(family, tmp_path_factory.mktemp(family))
        return made[family]

    return get


@pytest.fixture(scope="session")
def torch_models(tiny_dir):
    """``torch_models(family)`` -> the tiny checkpoint loaded on the torch engine (CPU, float32), once per session."""
    import umakit

    loaded = {}

    def get(family: str):
        if family not in loaded:
            loaded[family] = umakit.load(tiny_dir(family), backend="torch", device="cpu", dtype="float32")
        return loaded[family]

    return get


@pytest.fixture(scope="session")
def quantized(tmp_path_factory):
    """``quantized(family, bits)`` -> a tiny checkpoint quantized by umakit in groups of 32, its biases random
    (transformers initialises them to zero, where a dropped bias would not show); the default recipe keeps
    some layers at 8 bits, which the torch engine's int4 kernels run as two nibble planes."""
    made = {}

    def get(family: str, bits: int = 4, **overrides):
        import torch
        from safetensors.torch import load_file, save_file

        from umakit.quantize import quantize

        key = (family, bits, tuple(sorted(overrides.items())))
        if key not in made:
            src = make_tiny_model(family, tmp_path_factory.mktemp(family), **overrides)
            tensors = load_file(src / "model.safetensors")
            gen = torch.Generator().manual_seed(1)
            for name, t in tensors.items():
                if name.endswith(".bias"):
                    tensors[name] = torch.randn(t.shape, generator=gen, dtype=torch.float32).to(t.dtype)
            save_file(tensors, src / "model.safetensors", metadata={"format": "pt"})
            made[key] = tmp_path_factory.mktemp(f"{family}-q{bits}") / "q"
            quantize(src, made[key], bits=bits, group_size=32)
        return made[key]

    return get


@pytest.fixture(scope="session")
def tiny_model(tiny_dir):
    """A loaded tiny llama on the MLX backend (float32 on CPU)."""
    import umakit

    return umakit.load(tiny_dir("llama"), backend="mlx", device="cpu")  # pinned: float32 on a Mac too


@pytest.fixture(autouse=True)
def one_torch_thread():
    """Tiny models gain nothing from more torch threads, and on a busy machine they cost a lot.

    Every test that uses torch gets one thread; a test that never touches torch does not pay
    for importing it: torch is set only when already imported, by the test module or by a
    (module- or session-scoped) fixture, which pytest sets up before this one.
    """
    torch = sys.modules.get("torch")
    if torch is None:
        yield
        return
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


@pytest.fixture(autouse=True)
def _isolated_home(tmp_path_factory, monkeypatch):
    """Keep umakit's cache (hardware probe, imports) out of the user's home."""
    home = tmp_path_factory.getbasetemp() / "umakit_home"
    monkeypatch.setenv("UMAKIT_HOME", str(home))

