"""Values that mlx-lm's own layout of a family stores otherwise than transformers' model holds them, undone as such
a checkpoint loads into transformers' model (mapped.py).

Qwen3-Next: mlx-lm takes a checkpoint whose routed experts come stacked (``switch_mlp``) to be in its own layout,
in which the norms that act as 1 + w hold 1 + w and each convolution kernel is (channels, kernel, 1), where
transformers' is (channels, 1, kernel); an imported Qwen3-Next GGUF is written that way, for MLX. Before the
weights load each such kernel takes the stored shape (the loader fills it by name); after, it is moved back and
the norms' 1 taken off.
"""

from __future__ import annotations

import torch
from torch import nn

from umakit.backends.common import ROUTED_EXPERTS

FAMILIES = ("qwen3_next",)  # model types whose mlx-lm layout differs in values, when their experts are stacked
NORMS = (".input_layernorm.weight", ".post_attention_layernorm.weight", "model.norm.weight", ".q_norm.weight",
         ".k_norm.weight")  # the norms mlx-lm stores as 1 + w


def before(model: nn.Module, tensors) -> list[str] | None:
    """When the checkpoint (``tensors``: names to their descriptions) is in mlx-lm's own layout of the model's
    family: its convolution kernels given their stored shapes; returns their paths (None for any other)."""
    kind = model.config.get_text_config().model_type
    if kind not in FAMILIES or not any(ROUTED_EXPERTS in name for name in tensors):
        return None
    convs = []
    for path, module in model.named_modules():
        stored = tensors.get(f"{path}.weight")
        if isinstance(module, nn.Conv1d) and stored is not None and tuple(stored.shape) != tuple(module.weight.shape):
            channels, _, kernel = module.weight.shape
            if tuple(stored.shape) == (channels, kernel, 1):
                module.weight = nn.Parameter(torch.empty(channels, kernel, 1, device="meta"), requires_grad=False)
                convs.append(path)
    return convs


def after(model: nn.Module, convs: list[str] | None) -> None:
    """Put back what `before` found: the kernels as (channels, 1, kernel), the norms' weights less 1."""
    if convs is None:
        return
    for path in convs:
        conv = model.get_submodule(path)
        conv.weight = nn.Parameter(conv.weight.data.transpose(1, 2).contiguous(), requires_grad=False)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1 and name.endswith(NORMS):
                p.sub_(1.0)
