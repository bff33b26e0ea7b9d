"""Synthetic models for the torch engine: random weights in a real architecture's exact shapes.

Benchmarks measure a Llama-3-8B-shaped model without downloading one: the
shapes come from the meta-built model of the preset's config, quantized
layers get random codes with small scales, and the tensors stream into the
same loader a checkpoint does (loader.build_model).
"""

from __future__ import annotations

import torch
from torch import nn

from umakit.backends.torch.model.llama import ModelArgs
from umakit.backends.torch.model.norm import GemmaRMSNorm, RMSNorm
from umakit.backends.torch.model.gemma4 import transformer_for
from umakit.backends.torch.model.moe import Experts


def synthetic_shapes(config: dict, bits: int | None, group_size: int) -> tuple[dict, dict[str, tuple]]:
    """(config with its quantization block, tensor name -> shape) as a checkpoint of ``config`` would hold."""
    config = dict(config)
    args = ModelArgs.from_config(config)
    with torch.device("meta"):
        model = transformer_for(args)
    shapes: dict[str, tuple] = {}
    for path, m in model.named_modules():
        if isinstance(m, (RMSNorm, GemmaRMSNorm)):
            shapes[f"{path}.weight"] = tuple(m.weight.shape)
        if isinstance(m, Experts):  # stacked as mlx-lm stores them: (E, out, in), each expert quantized alone
            n, rows, cols = m.n, m.out_features, m.in_features
            if bits and cols % group_size == 0:
                shapes[f"{path}.weight"] = (n, rows, cols * bits // 32)
                shapes[f"{path}.scales"] = shapes[f"{path}.biases"] = (n, rows, cols // group_size)
            else:
                shapes[f"{path}.weight"] = (n, rows, cols)
            if m.bias is not None:
                shapes[f"{path}.bias"] = (n, rows)
        for name in ("layer_scalar", "sinks", "scale", "per_expert_scale"):  # gemma4's scalars, gpt-oss's sinks
            if isinstance(getattr(m, name, None), torch.Tensor):
                shapes[f"{path}.{name}"] = tuple(getattr(m, name).shape)
        if not isinstance(m, (nn.Linear, nn.Embedding)) or (path == "lm_head" and args.tie_word_embeddings):
            continue
        rows, cols = m.weight.shape
        if bits and cols % group_size == 0:
            shapes[f"{path}.weight"] = (rows, cols * bits // 32)
            shapes[f"{path}.scales"] = shapes[f"{path}.biases"] = (rows, cols // group_size)
        else:
            shapes[f"{path}.weight"] = (rows, cols)
        if isinstance(m, nn.Linear) and m.bias is not None:
            shapes[f"{path}.bias"] = (rows,)
    if bits:
        config["quantization"] = {"group_size": group_size, "bits": bits}
    return config, shapes


def random_tensors(shapes: dict[str, tuple], dtype: torch.dtype, device: torch.device):
    """(name, tensor) for every shape: random codes where a layer is packed, unit norms, small floats."""
    for name, shape in shapes.items():
        packed = name.endswith(".weight") and f"{name.removesuffix('.weight')}.scales" in shapes
        yield name, random_tensor(name, shape, packed, dtype, device)


def random_tensor(name: str, shape: tuple, packed: bool, dtype: torch.dtype, device: torch.device):
    """A synthetic weight: random codes and small scales when ``packed``, unit norms, small floats."""
    if packed:
        return torch.randint(-2**31, 2**31 - 1, shape, dtype=torch.int32, device=device).view(torch.uint32)
    if name.endswith(("norm.weight", ".layer_scalar", ".scale", ".per_expert_scale")):
        return torch.ones(shape, dtype=dtype, device=device)
    if name.endswith(".scales"):
        return torch.full(shape, 0.002, dtype=dtype, device=device)
    if name.endswith(".biases"):
        return torch.full(shape, -0.001, dtype=dtype, device=device)
    return torch.randn(shape, dtype=dtype, device=device) * 0.02
