"""--deterministic on the eager CPU layers: a prompt's tokens as rows of the batch decode step.

Where the fused CPU step does not run (families it does not cover, quantized KV caches), a deterministic engine
prefills a prompt as rows of `Transformer.decode_rows` over a one-slot batch cache, each row a token at its own
position that sees the ones before it, with every quantized layer giving each row the bits of its lone step
(`crossover.rows_alone`). A decode step is such a row, and a lone one-token step computes the same bits (the
tests check both), so a prompt's cache does not depend on how it was split, and a reply's own tokens have the
bits a later prefill gives them. The price is the kernel's arithmetic a row, and a copy of the sequence's cache
into the batch cache and back on each call.
"""

from __future__ import annotations

import torch
from torch import nn

from umakit.backends.torch import crossover, quant
from umakit.backends.torch.batch_decoder import BatchKVCache
from umakit.backends.torch.cpu.affine_kernel import AffineLinear
from umakit.backends.torch.ragged_cache import kv_cache

MOST_ROWS = 64  # tokens a pass at most
SCORES_BYTES = 1 << 26  # and few enough that the rows' gathered keys and values stay within this


def refusal(model: nn.Module) -> str | None:
    """Why ``model``'s layers cannot give each row its lone bits (None where they can): a layer whose rows share
    a GEMM whatever their count (float weights on torch's matmul, a dequantized layer), or layers streamed in."""
    if model.streamer is not None:
        return "its layers stream from host memory (--gpu-layers, --vram-budget), in float32 GEMMs"
    rowwise = (AffineLinear, quant.Int4PackLinear, quant.Fp16Linear)
    for name, m in model.named_modules():
        if isinstance(m, quant.QuantizedEmbedding):
            continue  # a table's rows are looked up, each alone
        if isinstance(m, (nn.Linear, quant.QuantizedLinear)) and not isinstance(m, rowwise):
            return f"its layer {name} runs as {type(m).__name__}, whose rows share a GEMM (load it quantized)"
    return None


class ExactRows:
    """`cpu.fused.FusedDecoder`'s calls (logits, prefill) for an engine's eager layers, every row its own."""

    def __init__(self, engine):
        self.engine = engine

    def __call__(self, tokens: torch.Tensor, cache) -> torch.Tensor:
        """Logits (T, V) of ``tokens`` (T,) appended to a single-sequence ``cache``, each its own step's."""
        return self._append(tokens, cache, head=True)

    def prefill(self, tokens: torch.Tensor, cache) -> None:
        self._append(tokens, cache, head=False)

    def _append(self, tokens: torch.Tensor, single, head: bool) -> torch.Tensor | None:
        engine, a = self.engine, self.engine.args
        start, n = single.offset, tokens.numel()
        batch = kv_cache(a.kv_shapes, lambda layers, heads, size: BatchKVCache(
            layers, heads, size, a.max_position_embeddings, engine.cache_dtype, engine.torch_device, single.kv_bits))
        batch.reserve(1, start + n, 0)
        batch.put(0, single)
        # a pass's attention gathers each row's slot: rows x kv heads x span x head size, keys and values
        per_row = max(2 * 4 * heads * size for heads, size in a.kv_shapes) * (start + n)
        rows = max(1, min(MOST_ROWS, SCORES_BYTES // per_row))
        out = []
        with crossover.rows_alone():
            for i in range(0, n, rows):
                chunk = tokens[i:i + rows]
                at = start + i
                where = torch.arange(at, at + len(chunk), device=engine.torch_device)
                logits = engine.model.decode_rows(chunk[:, None], where, batch.slotted([0] * len(chunk)),
                                                  at + len(chunk), head=head)
                if head:
                    out.append(logits)
        batch.get(0, start + n, single)
        return torch.cat(out) if head else None
