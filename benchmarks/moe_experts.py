"""Quantized experts on a CPU: one packed layer an expert (the default since 2026-12-06, quant/forms.py
`pack_experts`) against the stacked form that dequantizes each picked expert in the step (what ran before), in
one run.

    python benchmarks/moe_experts.py [--tokens 32] [--repeat 3] [--threads 2]

A random Mixtral-style model (hidden 1024, 8 experts of 2816, 2 a token, 8 layers, a 32,000-token vocabulary),
4-bit groups of 32 on the torch engine's CPU default, each way in a process of its own, in rotation: decode
tok/s of ``--tokens`` greedy tokens after a 16-token prompt, median of ``--repeat``. Prints a markdown table and
writes it to benchmarks/out/moe_experts.md.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
from datetime import date
from pathlib import Path

import runs

OUT = Path(__file__).parent / "out" / "moe_experts.md"
CONFIG = dict(model_type="mixtral", vocab_size=32000, hidden_size=1024, intermediate_size=2816, num_hidden_layers=8,
              num_attention_heads=16, num_key_value_heads=4, num_local_experts=8, num_experts_per_tok=2,
              max_position_embeddings=4096, rms_norm_eps=1e-5, rope_theta=1e6, tie_word_embeddings=False)
WAYS = {"packed": "one packed layer an expert (affine kernel)", "stacked": "stacked, picked experts dequantized"}


def worker(way: str, tokens: int, threads: int) -> float:
    import torch

    torch.set_num_threads(threads)
    import umakit
    from umakit.backends.torch.quant import forms

    if way == "stacked":
        forms.pack_experts = lambda *args, **kw: None  # the form before packed experts
    model = umakit.load_synthetic(CONFIG, backend="torch", device="cpu", dtype="auto", bits=4, group_size=32)
    return runs.decode_rates(model.engine, tokens)[0]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        print(json.dumps(worker(args.worker, args.tokens, args.threads)))
        return
    done = runs.in_rotation(__file__, WAYS, args.repeat, ["--tokens", str(args.tokens), "--threads",
                                                         str(args.threads)], args.threads)
    lines = [f"Mixtral-style, 8 layers of hidden 1024, 8 experts of 2816 (2 a token), 4-bit g32, random weights, "
             f"{date.today()}, {platform.machine()}, {args.threads} threads, {args.tokens} greedy tokens, median of "
             f"{args.repeat} in rotation.", "", "| experts | decode tok/s | runs |", "|---|---:|---|"]
    for way, rs in done.items():
        median = f"{statistics.median(rs):.1f}" if rs else "failed"
        lines.append(f"| {WAYS[way]} | {median} | {', '.join(f'{r:.1f}' for r in rs)} |")
    runs.publish(lines, OUT)


if __name__ == "__main__":
    main()
