"""The eager CPU step's calls into umakit's library where it has no fused step (gemma4, the mixtures):
- a decode step's routed experts in one call (csrc/experts.cpp, `affine_kernel.expert_rows`): the same bits as
  moe.py's Python path over the same packed layers, for distinct picks (a lone step) and shared ones (a batch);
- each RMSNorm in one call (csrc/norm.cpp): the formula of model/norm.py within float32's rounding (the mean
  summed in double rather than by torch's reduction: at most a few units in the last place of the largest output).
"""

import functools

import pytest
import torch
import torch.nn.functional as F

from umakit.backends.torch.cpu import affine_kernel as affine, build
from umakit.backends.torch.model.moe import SwitchMLP, mix
from umakit.backends.torch.quant import layout
from umakit.backends.torch.quant.forms import pack_experts

pytestmark = pytest.mark.skipif(not build.ensure(), reason="the C++ library cannot be built here")

E, HIDDEN, INTER = 6, 128, 256


def packed_switch(act, bits: int, group: int, seed: int = 0) -> SwitchMLP:
    """A SwitchMLP of E random quantized experts, each projection packed one layer an expert."""
    g = torch.Generator().manual_seed(seed)
    switch = SwitchMLP(E, HIDDEN, INTER, act)
    for name in ("gate_proj", "up_proj", "down_proj"):
        stack = getattr(switch, name).quantized(bits, group, torch.float16)
        w = torch.randn(E * stack.out_features, stack.in_features, generator=g) * 0.05
        codes, scales, biases = layout.quantize(w, bits, group)
        stack.weight = codes.view(E, stack.out_features, -1)
        stack.scales = scales.half().view(E, stack.out_features, -1)
        stack.biases = biases.half().view(E, stack.out_features, -1)
        pack_experts(stack, name)
        assert stack.forms is not None
        setattr(switch, name, stack)
    return switch


def python_path(switch: SwitchMLP, x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    native, switch.native_act = switch.native_act, None
    try:
        return switch.gathered(x, idx)
    finally:
        switch.native_act = native


GELU = functools.partial(F.gelu, approximate="tanh")


@pytest.mark.parametrize("act", [F.silu, GELU], ids=["silu", "gelu_tanh"])
@pytest.mark.parametrize("bits,group", [(4, 32), (6, 64), (8, 128), (5, 32)])
@pytest.mark.parametrize("picks", [[3], [0, 5, 2, 4], [1, 1, 4, 1, 0, 4]], ids=["one", "distinct", "shared"])
def test_one_call_gives_the_python_paths_bits(act, bits, group, picks, monkeypatch):
    switch = packed_switch(act, bits, group)
    x = torch.randn(len(picks), HIDDEN, generator=torch.Generator().manual_seed(1))
    idx = torch.tensor(picks)
    calls = []
    real = affine.expert_rows
    monkeypatch.setattr(affine, "expert_rows", lambda *a: calls.append(1) or real(*a))
    got = switch.gathered(x, idx)
    assert calls, "the C++ step was not taken"
    want = python_path(switch, x, idx)
    assert got.shape == (len(picks), HIDDEN) and torch.equal(got, want)


def test_a_batch_step_through_mix_equals_the_python_path():
    """Three tokens, two experts each (some shared), summed by the router's weights: the same bits."""
    switch = packed_switch(F.silu, 4, 32, seed=2)
    flat = torch.randn(3, HIDDEN, generator=torch.Generator().manual_seed(3))
    idx = torch.tensor([[0, 2], [2, 5], [0, 1]])
    weights = torch.tensor([[0.7, 0.3], [0.6, 0.4], [0.5, 0.5]])
    got = mix(switch, flat, weights, idx, E)
    switch.native_act = None
    assert torch.equal(got, mix(switch, flat, weights, idx, E))


def test_other_activations_and_dtypes_stay_in_python():
    assert affine.native_activation(F.relu) is None
    assert affine.native_activation(functools.partial(F.gelu, approximate="none")) is None
    assert affine.native_activation(torch.nn.SiLU()) == affine.SILU
    switch = packed_switch(F.silu, 4, 32)
    forms = (switch.gate_proj.forms, switch.up_proj.forms, switch.down_proj.forms)
    x = torch.randn(2, HIDDEN)
    assert affine.expert_rows(forms, affine.SILU, x.half(), torch.tensor([0, 1])) is None
    assert affine.expert_rows(forms, affine.SILU, x, torch.tensor([0, 1])) is not None


def test_the_one_call_norms_are_the_formula_within_float32_rounding():
    """csrc/norm.cpp against model/norm.py's formula: w, 1 + w and no weight, a row and many, a strided view."""
    from umakit.backends.torch.model.norm import GemmaRMSNorm, RMSNorm, ScalelessNorm

    g = torch.Generator().manual_seed(4)
    for norm in (RMSNorm(96, 1e-6), GemmaRMSNorm(96, 1e-6), ScalelessNorm(1e-6)):
        if "weight" in norm._parameters:
            norm.weight.data = torch.randn(96, generator=g)
        for x in (torch.randn(1, 1, 96, generator=g) * 3, torch.randn(5, 2, 192, generator=g)[..., ::2]):
            want = norm(x)
            norm.native = True
            try:
                got = norm(x)
            finally:
                norm.native = False
            assert got.shape == want.shape and got.is_contiguous()
            assert (got - want).abs().max() <= 4e-7 * want.abs().max(), type(norm).__name__


def test_an_expert_whose_rows_take_a_gemm_runs_as_python_runs_it(monkeypatch):
    """Where one expert has `dense_rows` rows or more (a GEMM's bits, not a lone row's), the call runs expert by
    expert as the Python path does, and still gives its bits."""
    monkeypatch.setattr(affine, "dense_rows", lambda: 2)
    switch = packed_switch(F.silu, 4, 32, seed=5)
    x = torch.randn(5, HIDDEN, generator=torch.Generator().manual_seed(6))
    idx = torch.tensor([2, 2, 2, 0, 3])
    assert torch.equal(switch.gathered(x, idx), python_path(switch, x, idx))


def test_the_gated_delta_step_is_transformers_rule_within_float32_rounding():
    """csrc/delta.cpp against transformers' own recurrent rule (Qwen3.5's), q and k normed in the kernel, grouped
    value heads, two rows; the state it started from is left as it was."""
    from transformers.models.qwen3_5 import modeling_qwen3_5 as qwen35

    from umakit.backends.transformers import recurrent

    rule = qwen35.torch_recurrent_gated_delta_rule
    rule = getattr(rule, "umakit_wraps", rule)  # transformers' own, whether or not a load wrapped it
    g = torch.Generator().manual_seed(7)
    B, Hk, Hv, dk, dv = 2, 2, 4, 32, 16
    q, k = (torch.randn(B, 1, Hk, dk, generator=g) for _ in range(2))
    v = torch.randn(B, 1, Hv, dv, generator=g)
    decay, beta = -torch.rand(B, 1, Hv, generator=g), torch.rand(B, 1, Hv, generator=g)
    state = torch.randn(B, Hv, dk, dv, generator=g)
    before = state.clone()
    want_out, want_state = rule(q, k, v, g=decay, beta=beta, initial_state=state, output_final_state=True,
                                use_qk_l2norm_in_kernel=True)
    got_out, got_state = torch.ops.umakit.delta_rule_step(q, k, v, decay, beta, state)
    assert torch.equal(state, before)
    for got, want in ((got_out, want_out), (got_state, want_state)):
        assert got.shape == want.shape
        assert (got - want).abs().max() <= 1e-5 * want.abs().max()
    wrapped = recurrent._wrap(rule)
    args = dict(g=decay, beta=beta, initial_state=state, output_final_state=True, use_qk_l2norm_in_kernel=True)
    assert torch.equal(wrapped(q, k, v, **args)[0], want_out)  # outside umakit's forward: transformers' own
    with recurrent.umakit_forward():
        assert torch.equal(wrapped(q, k, v, **args)[0], got_out)
        assert torch.equal(wrapped(q, k, v, **{**args, "use_qk_l2norm_in_kernel": False})[0],
                           rule(q, k, v, **{**args, "use_qk_l2norm_in_kernel": False})[0])
