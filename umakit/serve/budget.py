"""How many prompt tokens the scheduler prefills between two decode steps, measured on the engine at start.

A prefill pass costs a fixed part whatever its length (on a CPU, the
quantized weights dequantized for the GEMMs: 60 ms a pass on the built-in
model, 0.3 s on a 1.5B Q4_K_M; where AMX tiles take a slice's GEMMs,
csrc/amx.cpp, a 16-token pass took 0.56-0.65x oneDNN's on the built-in
model and a 0.5B Q4_K_M) and a part per token. While rows decode, every
pass stalls them: a short slice stalls them little but spends most of its pass
on the fixed part, so at 8 clients the prompts waited in many small passes
(48 tokens a slice: 2 ms a prompt token, against 0.5 at 256). The budget is
the slice whose tokens cost what the fixed part costs, so a pass takes at
most about twice the least any pass takes (the bound on a running row's stall
between two of its tokens, beside its own step) and half of it or more goes
to prompt tokens. Where a 16-token pass alone takes SLOW_S or more (a large
model on a CPU), the budget is the least, and nothing longer is timed: the
measurement would hold up the server's start for tens of seconds, to find
what the stall already decides. `umakit serve --step-tokens N` sets it instead.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Sequence

SMALL, LARGE = 16, 256  # the two slice lengths timed
# The passes timed, in this order, the shortest of each length kept: the first warms the engine up (a mapped
# checkpoint's pages, the GEMMs' first calls), the slow check follows the second, and the lengths alternate so
# that a noisy moment of a shared machine does not spoil all of one length's runs.
ORDER = ("small", "small", "large", "small", "large")
LEAST = 16  # tokens a step at least
SLOW_S = 0.5  # a SMALL pass this slow: the least budget, without timing a LARGE one


@dataclass(frozen=True)
class StepBudget:
    tokens: int  # prompt tokens a step may prefill while rows decode
    fixed_s: float  # a prefill pass's cost whatever its length, as measured
    per_token_s: float  # and its cost a token

    def describe(self) -> str:
        if not self.per_token_s:
            return (f"{self.tokens} prompt tokens between two decode steps (a prefill pass of {SMALL} tokens took "
                    f"{self.fixed_s * 1e3:.0f} ms)")
        return (f"{self.tokens} prompt tokens between two decode steps (a prefill pass measured "
                f"{self.fixed_s * 1e3:.0f} ms + {self.per_token_s * 1e3:.2f} ms a token)")


def measure(prefill: Callable[[Sequence[int]], None], text: Sequence[int], most: int,
            clock: Callable[[], float] = time.perf_counter) -> StepBudget:
    """Time ``prefill`` (a slice into a fresh cache) on SMALL and LARGE tokens cycled from ``text``; the budget is
    the fixed part over the part a token, in multiples of 16, at least LEAST and at most ``most``."""
    if not text:
        raise ValueError("no tokens to time a prefill with")
    large = max(min(LARGE, most), SMALL + 1)
    took = {SMALL: float("inf"), large: float("inf")}
    for i, which in enumerate(ORDER):
        n = SMALL if which == "small" else large
        t0 = clock()
        prefill([text[j % len(text)] for j in range(n)])
        took[n] = min(took[n], clock() - t0)
        if i == 1 and took[SMALL] >= SLOW_S:
            return StepBudget(min(most, LEAST), took[SMALL], 0.0)
    per = max((took[large] - took[SMALL]) / (large - SMALL), 1e-9)
    fixed = max(took[SMALL] - SMALL * per, 0.0)
    tokens = int(fixed / per) // 16 * 16
    return StepBudget(min(most, max(LEAST, tokens)), fixed, per)


def measure_model(model, kv_bits: int | None, most: int) -> StepBudget:
    """`measure` on a loaded `umakit.api.Model`'s engine, its caches quantized to ``kv_bits`` as the batch's are."""
    engine = model.engine
    text = model.tokenizer.encode("It is a truth universally acknowledged, that a single man in possession of a "
                                  "good fortune, must be in want of a wife.")
    return measure(lambda ids: engine.prefill(ids, engine.make_cache(kv_bits)), text, most)
