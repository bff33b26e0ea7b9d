"""Qwen3.5's and Qwen3-Next's linear attention (transformers' gated delta rule) one decode token at a time on a
CPU in one call of umakit's library (csrc/delta.cpp), where transformers' torch reference makes some fifteen ops a
layer, each a pass over the layer's recurrent state.

transformers' layers call the rule by its module-level name (``torch_recurrent_gated_delta_rule``) in their
modeling module. `install` wraps that name once per module; the wrapper takes the library's step only inside
`umakit_forward` (umakit's own forward passes, a context variable) and only for what the step computes (one
float32 token a row, q and k normed in the kernel, a state to start from, no packed sequences); any other call,
umakit's or anyone's in the same process, goes to transformers' own function unchanged.
"""

from __future__ import annotations

import contextlib
import contextvars
import sys

import torch
from torch import nn

from umakit.backends.torch.cpu import build

NAME = "torch_recurrent_gated_delta_rule"
_inside = contextvars.ContextVar("umakit_forward", default=False)


def install(model: nn.Module) -> int:
    """Wrap the gated delta rule of each modeling module ``model``'s layers come from, where the library is built
    here; returns how many of its modules use a wrapped rule."""
    modules = [m for m in {sys.modules.get(type(m).__module__) for m in model.modules()} if hasattr(m, NAME)]
    if not modules or not build.ensure() or not hasattr(torch.ops.umakit, "delta_rule_step"):
        return 0
    for module in modules:
        rule = getattr(module, NAME)
        if getattr(rule, "umakit_wraps", None) is None:
            setattr(module, NAME, _wrap(rule))
    return len(modules)


@contextlib.contextmanager
def umakit_forward():
    """Inside: the wrapped rules take the library's step where it applies."""
    token = _inside.set(True)
    try:
        yield
    finally:
        _inside.reset(token)


def _wrap(rule):
    def step(query, key, value, g, beta, initial_state=None, output_final_state=False,
             use_qk_l2norm_in_kernel=False, **kwargs):
        tensors = (query, key, value, g, beta, initial_state)
        if (_inside.get() and use_qk_l2norm_in_kernel and initial_state is not None and query.shape[1] == 1
                and kwargs.get("cu_seqlens") is None and kwargs.get("seq_idx") is None
                and all(t.device.type == "cpu" and t.dtype == torch.float32 for t in tensors)):
            out, state = torch.ops.umakit.delta_rule_step(query, key, value, g, beta, initial_state)
            return out, state if output_final_state else None
        return rule(query, key, value, g=g, beta=beta, initial_state=initial_state,
                    output_final_state=output_final_state, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
                    **kwargs)

    step.umakit_wraps = rule
    step.__name__ = step.__qualname__ = NAME
    return step
