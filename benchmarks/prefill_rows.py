"""A short prompt's prefill on torch-CPU's default: the eager forward against rows of the fused decode step.

    python benchmarks/prefill_rows.py [--model FILE.gguf] [--windows 60] [--lengths 8 16 32 64 95] [--repeat 3]

Two prefills of the same prompt into the same int4 engine (``--dtype auto`` on a CPU whose torch kernels are
built for AVX-512): ``eager``, the engine's forward pass (torch's int4 kernels below 32 rows, dequantize + one
float32 GEMM from 32 on), and ``fused rows``, each token run as its own fused decode step in one C++ call.
For each it reports:

- time: the prefill of ``--lengths`` tokens, best of ``--repeat``, both in the same process, alternating;
- agreement: over ``--windows`` random windows of 33-90 tokens of Jane Austen's novels (seeded), how often
  the next token's argmax after that prefill (its last token run as a decode step, as `generate` does)
  equals the float32 engine's, and the mean KL divergence from float32's distribution.

Prints a markdown table and writes it to benchmarks/out/prefill_rows.md.
"""

from __future__ import annotations

import argparse
import platform
import random
import time
from datetime import date
from pathlib import Path

import numpy as np
import torch

import umakit

OUT = Path(__file__).parent / "out" / "prefill_rows.md"


def prefill(engine, ids: list[int], how: str):
    """A fresh cache holding ``ids``, prefilled the way ``how`` names."""
    cache = engine.make_cache()
    with torch.inference_mode():
        if how == "fused rows":
            engine._fused.prefill(torch.tensor(ids), cache)
        else:
            with engine.eager():  # the forward pass; the fused step is the decode's
                engine.prefill(ids, cache)
    return cache


def next_logits(engine, ids: list[int], how: str) -> np.ndarray:
    """Logits (V,) of the token after ``ids``: all but the last prefilled, the last a decode step."""
    cache = prefill(engine, ids[:-1], how)
    return engine.logits(ids[-1:], cache)[-1].astype(np.float64)


def log_softmax(z: np.ndarray) -> np.ndarray:
    z = z - z.max()
    return z - np.log(np.exp(z).sum())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="a model or .gguf (default: the built-in one)")
    parser.add_argument("--windows", type=int, default=60)
    parser.add_argument("--lengths", type=int, nargs="+", default=[8, 16, 32, 64, 95])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    model = umakit.load(args.model, backend="torch", device="cpu")
    engine = model.engine
    if engine._fused is None:
        raise SystemExit("the fused CPU decode step is off here (no AVX-512 int4 kernels, or no C++ build)")
    exact = umakit.load(args.model, backend="torch", device="cpu", dtype="float32").engine
    hows = ("eager", "fused rows")

    from umakit.evaluate.corpora import load_corpus

    ids = model.tokenizer.encode(load_corpus("austen", max_chars=400_000))
    rng = random.Random(args.seed)
    agree = {h: 0 for h in hows}
    kl = {h: [] for h in hows}
    for _ in range(args.windows):
        n = rng.randint(33, 90)
        start = rng.randrange(len(ids) - n)
        window = ids[start:start + n]
        ref = log_softmax(exact.logits(window)[-1].astype(np.float64))
        for how in hows:
            lp = log_softmax(next_logits(engine, window, how))
            agree[how] += int(lp.argmax() == ref.argmax())
            kl[how].append(float((np.exp(ref) * (ref - lp)).sum()))

    times = {h: {} for h in hows}
    prompt = (ids * 2)[:max(args.lengths)]
    for n in args.lengths:
        for how in hows:
            prefill(engine, prompt[:n], how)  # warm
        for _ in range(args.repeat):
            for how in hows:
                t = time.perf_counter()
                prefill(engine, prompt[:n], how)
                spent = time.perf_counter() - t
                times[how][n] = min(times[how].get(n, spent), spent)

    lines = [f"Measured {date.today()} on {platform.processor() or platform.machine()}, {args.threads} threads, "
             f"{model.info.name} ({model.info.weights.quantization}).", "",
             "| prefill | " + " | ".join(f"{n} tokens (ms)" for n in args.lengths)
             + f" | argmax = float32's ({args.windows} windows) | mean KL from float32 |",
             "|---|" + "---:|" * (len(args.lengths) + 2)]
    for how in hows:
        cells = " | ".join(f"{times[how][n] * 1e3:.0f}" for n in args.lengths)
        lines.append(f"| {how} | {cells} | {agree[how]}/{args.windows} | {np.mean(kl[how]):.5f} |")
    table = "\n".join(lines)
    print(table)
    OUT.parent.mkdir(exist_ok=True)
    OUT.write_text(table + "\n")


if __name__ == "__main__":
    main()
