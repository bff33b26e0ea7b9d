"""The CPU decode step in one C++ call (cpu/build.py builds it): the eager step's math without its ~65 ops a layer.

`FusedDecoder` serves the same calls as the eager step and the CUDA graph
(logits of one token appended to the cache, or of a few: a speculative
verification) and as the eager batched step (`rows`: one token for each row
of a batch cache), every row exactly as its own one-token step would compute
it, for the models it covers: the Llama family (llama, mistral, qwen2's
q/k/v biases, qwen3's q/k norms) with every projection on umakit's
affine kernel (cpu/affine_kernel.py) or torch's int4 kernels and float32
activations, which is the CPU default for quantized checkpoints (quant/forms.py). Anything else, and every step where the library
cannot be built (cpu/build.py), runs the eager model.
"""

from __future__ import annotations

import torch

from umakit.backends.torch import crossover
from umakit.backends.torch.cpu import affine_kernel
from umakit.backends.torch.cpu.affine_kernel import AffineLinear
from umakit.backends.torch.model.llama import MLP, Transformer
from umakit.backends.torch.model.norm import RMSNorm, Norm
from umakit.backends.torch.quant.kernels import Int4PackLinear

INT4, INT4_SPLIT, AFFINE = 0, 1, 2  # a projection's kind, as csrc/fused_decode.cpp reads it


def covers(model: Transformer) -> bool:
    """Whether every layer of ``model`` is one the fused step computes exactly as the eager one."""
    a = model.args
    if model.streamer is not None or a.gemma_norms or a.layer_types or a.num_experts or a.hidden_act != "silu":
        return False
    if a.rope_dynamic:  # frequencies per position past the original context: the step takes one set
        return False
    if a.num_attention_heads % a.num_key_value_heads or a.head_dim % 2:
        return False
    for block in model.model.layers:
        attn, mlp = block.self_attn, block._modules[block.ffn_name]
        if not isinstance(mlp, MLP):
            return False
        linears = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
        if not all(isinstance(m, Int4PackLinear) or isinstance(m, AffineLinear) and not m.padded for m in linears):
            return False
        if any(m.bias is not None for m in linears[1:]):
            return False
        norms = [block.input_layernorm, block.post_attention_layernorm]
        if a.qk_norm:
            norms += [attn.q_norm, attn.k_norm]
        if not all(type(n) is RMSNorm and n.weight.dtype == torch.float32 for n in norms):
            return False
    return True


class FusedDecoder:
    """One decode step: embedding and head in torch, the layers in `umakit::decode_layers`."""

    def __init__(self, model: Transformer):
        self.model = model
        a = model.args
        norms, qk_norms, biases = [], [], []
        parts: tuple[list, list, list, list, list, list] = ([], [], [], [], [], [])  # ta, tb, kinds, counts, bits, groups
        for block in model.model.layers:
            attn, mlp = block.self_attn, block._modules[block.ffn_name]
            norms += [block.input_layernorm.weight, block.post_attention_layernorm.weight]
            if a.qk_norm:
                qk_norms += [attn.q_norm.weight, attn.k_norm.weight]
            for m in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj):
                _describe(m, *parts)
            if attn.qkv_proj.bias is not None:
                biases.append(attn.qkv_proj.bias)
        self.weights = (norms, qk_norms, *parts, biases)
        self.shape = (a.num_attention_heads, a.num_key_value_heads, a.head_dim, a.rms_norm_eps,
                      a.attn_scale or 0.0, a.sliding_window or 0, list(a.nope_layers))
        self.inv_freq = model.inv_freq[0].contiguous()
        # The hook tables of the modules whose forward the step does not call (each module keeps its own,
        # filled in place), so that asking on every step is one any() over them.
        self.hooks = [h for m in model.model.layers.modules() for h in (m._forward_hooks, m._forward_pre_hooks)]

    def applies(self) -> bool:
        """False once a module it bypasses carries a hook (a sharded engine's all-reduce): those run eagerly."""
        return not any(self.hooks)

    def __call__(self, tokens: torch.Tensor, cache) -> torch.Tensor:
        """Logits (T, V) of ``tokens`` (T,) appended to a single-sequence ``cache``, each row the bits its own
        one-token step gives (so a verification of T proposed tokens is T decode steps, in one call)."""
        return self._append(tokens, cache, head=True)

    def prefill(self, tokens: torch.Tensor, cache) -> None:
        """``tokens`` (T,) appended to a single-sequence ``cache`` as T decode steps would write them, without the
        head. The engine prefills with its forward pass instead (benchmarks/prefill_rows.py compares the two:
        rows are faster below ~100 tokens, but their bfloat16-rounded inputs moved the built-in model's first
        answer off float32's)."""
        self._append(tokens, cache, head=False)

    def rows(self, tokens: torch.Tensor, positions: list[int], cache, slots: list[int] | None = None) -> torch.Tensor:
        """Logits (B, V) of one token per row, ``tokens`` (B, 1), row b at ``positions[b]`` of a `BatchKVCache`
        (reserved for them), as `Transformer.decode_rows` computes them and as each row's own step would. With
        ``slots``, row b goes to the cache's row ``slots[b]``: several rows may be consecutive tokens of one slot
        (a speculating row's token and proposals), each seeing the ones before it."""
        return self._layers(tokens, positions, slots or [], cache.k, cache.v)

    def _append(self, tokens: torch.Tensor, cache, head: bool) -> torch.Tensor | None:
        n = tokens.numel()
        cache.reserve(n)
        start = cache.offset
        out = self._layers(tokens.view(n, 1), list(range(start, start + n)), [0] * n, cache.k, cache.v, head)
        cache.advance(n)
        return out

    def _layers(self, tokens: torch.Tensor, positions: list[int], rows: list[int], k: torch.Tensor,
                v: torch.Tensor, head: bool = True) -> torch.Tensor | None:
        x = self.model._embed(tokens)
        x = torch.ops.umakit.decode_layers(x, self.inv_freq, positions, rows, k, v, *self.weights, *self.shape,
                                           affine_kernel.inputs())
        if not head:
            return None
        # The head in runs of rows below where a quantized layer takes GEMMs, whose rows' bits depend on the rows
        # beside them: 16 rows of the built-in model's head moved its logits by 0.15 from their lone steps'.
        run = min(affine_kernel.dense_rows(), crossover.DENSE_ROWS) - 1
        if len(x) <= run:
            return self.model._head(x)[:, -1]
        return torch.cat([self.model._head(x[i:i + run])[:, -1] for i in range(0, len(x), run)])


def _describe(m, ta: list, tb: list, kinds: list, counts: list, bits: list, groups: list) -> None:
    """Append projection ``m`` as decode_layers reads it: its kind, its parts' tensors, widths and groups."""
    if isinstance(m, AffineLinear):
        codes, sb = m.parts
        ta += codes
        tb += sb
        kinds.append(AFFINE)
        counts.append(len(codes))
        bits += m.bits
        groups += m.groups
        return
    ta.append(m.packed)
    tb.append(m.scales_and_zeros)
    kinds.append(INT4_SPLIT if m.split else INT4)
    counts.append(1)
    bits.append(0)
    groups.append(m.group_size)


def native_norms(model: torch.nn.Module) -> int:
    """Where the fused step does not cover ``model``: each float32 RMSNorm of its eager step one call of the
    library (csrc/norm.cpp; model/norm.py). Returns how many norms it turned."""
    norms = [m for m in model.modules() if isinstance(m, Norm)]
    turned = [m for m in norms if m._parameters.get("weight") is None or m.weight.dtype == torch.float32]
    for m in turned:
        m.native = True
    return len(turned)
