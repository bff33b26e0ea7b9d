"""A prompt's prefill on torch-CPU's default (the packed form), three ways, for where the paths cross over.

    python benchmarks/prefill_rows.py [--model FILE.gguf] [--windows 60] [--lengths 8 32 64 128 256 512]

The same prompt into the same engine (``--dtype auto`` on a CPU whose torch kernels are built for AVX-512):

- ``packed kernel``: the engine's forward pass, every layer on the CPU default's kernel (umakit's affine kernel,
  which decodes each weight once per four input rows; torch's int4 kernel where that is not built, once per row);
- ``dequantize + GEMM``: the forward pass, each layer's weight dequantized once per call for one GEMM (float32
  for the affine kernel, bfloat16 for the int4 one, and for the affine kernel where the CPU multiplies bfloat16
  natively; below 256 tokens on AMX tiles where the CPU has them, `UMAKIT_PREFILL_GEMM=bfloat16-onednn` keeping
  oneDNN's);
- ``dequantize + GEMM, torch's BLAS``: the same with torch's oneDNN turned off, so the affine kernel's float32
  GEMMs take torch's own (csrc/gemm.cpp takes oneDNN's where it can);
- ``fused rows``: each token run as its own fused decode step, all in one C++ call.

The engine takes the first below `crossover.AFFINE_DENSE_ROWS` (or `DENSE_ROWS`) rows and the second from there up. For each way it
reports the time of a prefill of ``--lengths`` tokens (best of ``--repeat``, the ways alternating in one
process), and, over ``--windows`` random windows of 33-90 tokens of Jane Austen's novels (seeded; 0 skips this),
how often the next token's argmax after that prefill (its last token run as a decode step, as `generate` does)
equals the float32 engine's, and the mean KL divergence from float32's distribution.

Prints a markdown table and writes it to benchmarks/out/prefill_rows.md.
"""

from __future__ import annotations

import argparse
import contextlib
import platform
import random
import time
from datetime import date
from pathlib import Path

import numpy as np
import torch

import umakit
from umakit.backends.torch import crossover
from umakit.backends.torch.cpu import affine_kernel

OUT = Path(__file__).parent / "out" / "prefill_rows.md"
WAYS = ("packed kernel", "dequantize + GEMM", "dequantize + GEMM, torch's BLAS", "fused rows")


@contextlib.contextmanager
def dense_from(rows: int):
    names = ("DENSE_ROWS", "AFFINE_DENSE_ROWS", "AFFINE_INT8_DENSE_ROWS", "AFFINE_INT8X2_DENSE_ROWS",
             "AFFINE_INT8X2_ONEDNN_DENSE_ROWS", "AFFINE_INT8X2_BF16_DENSE_ROWS")
    old = [getattr(crossover, n) for n in names]
    for n in names:
        setattr(crossover, n, rows)
    try:
        yield
    finally:
        for n, value in zip(names, old):
            setattr(crossover, n, value)


@contextlib.contextmanager
def onednn(way: str):
    """torch's oneDNN off for the BLAS way (not `torch.backends.mkldnn.flags`, which also turns on TF32 matmuls)."""
    before = torch.backends.mkldnn.enabled
    torch.backends.mkldnn.enabled = way != "dequantize + GEMM, torch's BLAS"
    try:
        yield
    finally:
        torch.backends.mkldnn.enabled = before


def prefill(engine, ids: list[int], way: str):
    """A fresh cache holding ``ids``, prefilled ``way``."""
    cache = engine.make_cache()
    with torch.inference_mode():
        if way == "fused rows":
            engine._fused.prefill(torch.tensor(ids), cache)
        else:
            with dense_from(10**9 if way == "packed kernel" else 1), engine.eager(), onednn(way):  # the forward pass
                engine.prefill(ids, cache)
    return cache


def next_logits(engine, ids: list[int], way: str) -> np.ndarray:
    """Logits (V,) of the token after ``ids``: all but the last prefilled, the last a decode step."""
    cache = prefill(engine, ids[:-1], way)
    return engine.logits(ids[-1:], cache)[-1].astype(np.float64)


def log_softmax(z: np.ndarray) -> np.ndarray:
    z = z - z.max()
    return z - np.log(np.exp(z).sum())


def agreement(model, args) -> dict[str, tuple[int, float]]:
    """way -> (windows whose argmax is float32's, mean KL from float32)."""
    from umakit.evaluate.corpora import load_corpus

    exact = umakit.load(args.model, backend="torch", device="cpu", dtype="float32").engine
    ids = model.tokenizer.encode(load_corpus("austen", max_chars=400_000))
    rng = random.Random(args.seed)
    agree, kl = dict.fromkeys(WAYS, 0), {w: [] for w in WAYS}
    for _ in range(args.windows):
        n = rng.randint(33, 90)
        start = rng.randrange(len(ids) - n)
        window = ids[start:start + n]
        ref = log_softmax(exact.logits(window)[-1].astype(np.float64))
        for way in WAYS:
            lp = log_softmax(next_logits(model.engine, window, way))
            agree[way] += int(lp.argmax() == ref.argmax())
            kl[way].append(float((np.exp(ref) * (ref - lp)).sum()))
    return {w: (agree[w], float(np.mean(kl[w]))) for w in WAYS}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="a model or .gguf (default: the built-in one)")
    parser.add_argument("--windows", type=int, default=60)
    parser.add_argument("--lengths", type=int, nargs="+", default=[8, 32, 64, 128, 256, 512])
    parser.add_argument("--fused-up-to", type=int, default=128, help="longest prefill timed as fused rows")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    model = umakit.load(args.model, backend="torch", device="cpu")
    engine = model.engine
    if engine._fused is None:
        raise SystemExit("the fused CPU decode step is off here (no AVX-512, or no C++ build)")
    scores = agreement(model, args) if args.windows else {}

    times: dict[str, dict[int, float]] = {w: {} for w in WAYS}
    prompt = (list(range(100, 1100)) * 2)[:max(args.lengths)]
    for n in args.lengths:
        ways = [w for w in WAYS if w != "fused rows" or n <= args.fused_up_to]
        for way in ways:
            prefill(engine, prompt[:n], way)  # warm
        for _ in range(args.repeat):
            for way in ways:
                t = time.perf_counter()
                prefill(engine, prompt[:n], way)
                spent = time.perf_counter() - t
                times[way][n] = min(times[way].get(n, spent), spent)

    rows = affine_kernel.dense_rows()
    below = "at every length" if rows > 1 << 30 else f"below {rows} rows"
    lines = [f"Measured {date.today()} on {platform.machine()}, {args.threads} threads, {model.info.name} "
             f"({model.info.weights.quantization}); the engine's forward takes the packed kernel {below} "
             f"(the affine kernel; below {crossover.DENSE_ROWS} for the int4 one).", "",
             "| prefill | " + " | ".join(f"{n} tokens (ms)" for n in args.lengths)
             + (f" | argmax = float32's ({args.windows} windows) | mean KL from float32 |" if scores else " |"),
             "|---|" + "---:|" * (len(args.lengths) + (2 if scores else 0))]
    for way in WAYS:
        cells = " | ".join(f"{times[way][n] * 1e3:.0f}" if n in times[way] else "" for n in args.lengths)
        score = f" | {scores[way][0]}/{args.windows} | {scores[way][1]:.2e} |" if scores else " |"
        lines.append(f"| {way} | {cells}{score}")
    table = "\n".join(lines)
    print(table)
    OUT.parent.mkdir(exist_ok=True)
    OUT.write_text(table + "\n")


if __name__ == "__main__":
    main()
