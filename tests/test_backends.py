"""Backend registry: names, shorthands, automatic choice, install hints."""

import pytest

from umakit import backends
from umakit.errors import BackendUnavailableError, InvalidArgumentError


def test_shorthands_and_explicit_choices(monkeypatch):
    monkeypatch.setattr(backends, "is_apple_silicon", lambda: False)
    monkeypatch.setattr(backends, "_cuda_available", lambda: False)
    assert backends.resolve("cuda") == ("torch", "cuda")
    assert backends.resolve("torch", "cpu") == ("torch", "cpu")
    assert backends.resolve("mlx") == ("mlx", "cpu")
    with pytest.raises(InvalidArgumentError, match="backend mlx runs on metal or cpu, not 'cuda'"):
        backends.resolve("mlx", "cuda")
    with pytest.raises(InvalidArgumentError, match="--backend cuda runs on device cuda, not cpu"):
        backends.resolve("cuda", "cpu")


def test_auto_prefers_metal_then_cuda_then_the_faster_cpu_engine(monkeypatch):
    monkeypatch.setattr(backends, "is_apple_silicon", lambda: True)
    assert backends.resolve("auto") == ("mlx", "metal")
    monkeypatch.setattr(backends, "is_apple_silicon", lambda: False)
    monkeypatch.setattr(backends, "_cuda_available", lambda: True)
    assert backends.resolve("auto") == ("torch", "cuda")
    monkeypatch.setattr(backends, "_cuda_available", lambda: False)
    monkeypatch.setattr(backends, "_installed", lambda m: True)
    assert backends.resolve("auto") == ("torch", "cpu")  # benchmarks/cpu_engines.py: torch is faster on CPU
    monkeypatch.setattr(backends, "_installed", lambda m: m != "torch")
    assert backends.resolve("auto") == ("mlx", "cpu")


def test_missing_torch_gives_the_install_command(monkeypatch):
    monkeypatch.setattr(backends, "_installed", lambda m: m != "torch")
    with pytest.raises(BackendUnavailableError, match=r"the torch backend needs torch: pip install 'umakit\[cuda\]'"):
        backends.engine_class("torch")


def test_auto_respects_needed_features(monkeypatch):
    monkeypatch.setattr(backends, "is_apple_silicon", lambda: False)
    monkeypatch.setattr(backends, "_cuda_available", lambda: False)
    monkeypatch.setattr(backends, "_installed", lambda m: True)
    assert backends.resolve("auto", needs=frozenset({"kv_bits"})) == ("mlx", "cpu")
    assert backends.resolve("auto", needs=frozenset({"batch"})) == ("torch", "cpu")
    with pytest.raises(InvalidArgumentError, match="torch backend does not support kv_bits yet; use --backend mlx"):
        backends.resolve("torch", needs=frozenset({"kv_bits"}))
