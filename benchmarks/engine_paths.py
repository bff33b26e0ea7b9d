"""The torch engine's compact model code against the transformers engine (transformers' model classes), on the
same architecture and shapes, in one run: is the compact code worth keeping for a family both run? With
``--mlx``, MLX's CPU backend too: which of the engines without compact code "auto" should take on a CPU.

    python benchmarks/engine_paths.py [--preset smollm2-135m] [--tokens 64] [--repeat 3] [--threads 2] [--mlx]
        [--skip-torch] [--ways "torch, 4-bit;transformers, 4-bit"]

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
import platform
import statistics
from datetime import date
from pathlib import Path

import runs

OUT = Path(__file__).parent / "out" / "engine_paths.md"
WAYS = {"torch, float32": ("torch", "float32", None), "transformers, float32": ("transformers", "float32", None),
        "torch, auto (float16 weights)": ("torch", "auto", None),
        "transformers, auto (float16 weights)": ("transformers", "auto", None),
        "torch, 4-bit": ("torch", "auto", 4), "transformers, 4-bit": ("transformers", "auto", 4)}
MLX_WAYS = {"mlx (CPU), float32": ("mlx", "float32", None), "mlx (CPU), 4-bit": ("mlx", "auto", 4)}


def worker(args) -> dict:
    import torch

    torch.set_num_threads(args.threads)
    import umakit

    backend, dtype, bits = {**WAYS, **MLX_WAYS}[args.worker]
    preset = json.loads(Path(args.preset).read_text()) if args.preset.endswith(".json") else args.preset
    model = umakit.load_synthetic(preset, backend=backend, device="cpu", dtype=dtype, bits=bits, group_size=32)
    single, batched = runs.decode_rates(model.engine, args.tokens, steps=max(8, args.tokens // 4))
    return {"single": single, "batched": batched, "weights": model.info.weights.quantization}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="smollm2-135m", help="a `umakit plan` preset, or a config.json of shapes")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--mlx", action="store_true",
                    help="MLX's CPU backend too (what \"auto\" passes over for transformers off Apple Silicon)")
    ap.add_argument("--skip-torch", action="store_true", help="leave the torch engine's compact code out")
    ap.add_argument("--ways", help="only these rows, as the table names them, separated by ';' (for large shapes)")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        print(json.dumps(worker(args)))
        return
    ways = [w for w in WAYS if not (args.skip_torch and w.startswith("torch"))] + (list(MLX_WAYS) if args.mlx else [])
    if args.ways:
        wanted = [w.strip() for w in args.ways.split(";")]
        unknown = [w for w in wanted if w not in {**WAYS, **MLX_WAYS}]
        if unknown:
            raise SystemExit(f"Error: unknown way {unknown[0]!r}; choose from {'; '.join({**WAYS, **MLX_WAYS})}")
        ways = [w for w in ways if w in wanted]
    done = runs.in_rotation(__file__, ways, args.repeat, ["--preset", args.preset, "--tokens", str(args.tokens),
                                                         "--threads", str(args.threads)], args.threads)
    lines = [f"{args.preset} shapes, random weights, {date.today()}, {platform.machine()}, {args.threads} threads: "
             f"{args.tokens} greedy tokens after a 16-token prompt, median of {args.repeat} runs in rotation, each "
             "in its own process.", "",
             "| engine, weights | decode tok/s | 8 rows, tok/s summed | weights as loaded |", "|---|---:|---:|---|"]
    for way, rs in done.items():
        if not rs:
            lines.append(f"| {way} | failed | | |")
            continue
        single = statistics.median(r["single"] for r in rs)
        batched = statistics.median(r["batched"] for r in rs)
        lines.append(f"| {way} | {single:.1f} | {batched:.1f} | {rs[0]['weights']} |")
    runs.publish(lines, OUT)


if __name__ == "__main__":
    main()
