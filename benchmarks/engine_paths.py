"""The torch engine's compact model code against the transformers engine (transformers' model classes), on the
same architecture and shapes, in one run: is the compact code worth keeping for a family both run?

    python benchmarks/engine_paths.py [--preset smollm2-135m] [--tokens 64] [--repeat 3] [--threads 2]

Random weights in a preset's exact shapes (`umakit plan` presets), loaded by each engine's ``synthetic``:
float32 (every weight read as it is), and 4-bit groups of 32 (the torch engine's default CPU form, umakit's
affine kernel where it is built; the transformers engine's linear layers swapped for the same packed forms, its
head and embeddings kept float). Decode tok/s of ``--tokens`` greedy tokens after a 16-token prompt, each
engine and form in a fresh process, in rotation, median of ``--repeat``. Also the batched decode of 8 rows
(tok/s summed over the rows), where the transformers engine runs each row as its own forward pass.

Prints a markdown table and writes it to benchmarks/out/engine_paths.md.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from datetime import date
from pathlib import Path

OUT = Path(__file__).parent / "out" / "engine_paths.md"
WAYS = {"torch, float32": ("torch", "float32", None), "transformers, float32": ("transformers", "float32", None),
        "torch, 4-bit": ("torch", "auto", 4), "transformers, 4-bit": ("transformers", "auto", 4)}
PROMPT = list(range(100, 116))


def worker(args) -> dict:
    import torch

    torch.set_num_threads(args.threads)
    import umakit
    from umakit.backends.base import BatchRow
    from umakit.generate.sampling import SamplingParams

    backend, dtype, bits = WAYS[args.worker]
    preset = json.loads(Path(args.preset).read_text()) if args.preset.endswith(".json") else args.preset
    model = umakit.load_synthetic(preset, backend=backend, device="cpu", dtype=dtype, bits=bits, group_size=32)
    engine, greedy = model.engine, SamplingParams(temperature=0)
    stream = engine.generate_tokens(PROMPT, engine.make_cache(), greedy)
    next(stream)
    t = time.perf_counter()
    for _ in range(args.tokens):
        next(stream)
    single = args.tokens / (time.perf_counter() - t)
    stream.close()
    decoder = engine.batch_decoder()
    decoder.add([BatchRow(i, [i + 3] + PROMPT, greedy) for i in range(8)])
    decoder.step()
    steps = max(8, args.tokens // 4)
    t = time.perf_counter()
    for _ in range(steps):
        decoder.step()
    batched = 8 * steps / (time.perf_counter() - t)
    return {"single": single, "batched": batched, "weights": model.info.weights.quantization}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="smollm2-135m", help="a `umakit plan` preset, or a config.json of shapes")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        print(json.dumps(worker(args)))
        return
    runs: dict[str, list[dict]] = {w: [] for w in WAYS}
    for _ in range(args.repeat):
        for way in WAYS:
            cmd = [sys.executable, __file__, "--worker", way, "--preset", args.preset, "--tokens", str(args.tokens),
                   "--threads", str(args.threads)]
            done = subprocess.run(cmd, capture_output=True, text=True,
                                  env={**os.environ, "OMP_NUM_THREADS": str(args.threads)})
            if done.returncode:
                print(f"  {way} failed:\n{done.stderr[-1500:]}", file=sys.stderr)
                continue
            runs[way].append(json.loads(done.stdout.strip().splitlines()[-1]))
    lines = [f"{args.preset} shapes, random weights, {date.today()}, {platform.machine()}, {args.threads} threads: "
             f"{args.tokens} greedy tokens after a 16-token prompt, median of {args.repeat} runs in rotation, each "
             "in its own process.", "",
             "| engine, weights | decode tok/s | 8 rows, tok/s summed | weights as loaded |", "|---|---:|---:|---|"]
    for way, rs in runs.items():
        if not rs:
            lines.append(f"| {way} | failed | | |")
            continue
        single = statistics.median(r["single"] for r in rs)
        batched = statistics.median(r["batched"] for r in rs)
        lines.append(f"| {way} | {single:.1f} | {batched:.1f} | {rs[0]['weights']} |")
    table = "\n".join(lines)
    print(table)
    OUT.parent.mkdir(exist_ok=True)
    OUT.write_text(table + "\n")


if __name__ == "__main__":
    main()
