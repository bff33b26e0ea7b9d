"""CPU decode and prefill speed of every engine on the default model, in one run.

    python benchmarks/cpu_engines.py [--tokens 128] [--repeat 3]

Engines: umakit torch-CPU in each weight form it supports, from the imported
4/8-bit weights (float32: dequantized once at load, exact; float16: the same
rounded to float16 for FBGEMM's float32 kernels; bfloat16: repacked exactly
for torch's int4 kernels, which run in bfloat16), umakit MLX-CPU, and Hugging
Face transformers' ``generate`` on the same GGUF. Same prompt, greedy, fixed
number of new tokens, median of the repeats. Prints a markdown table and
writes it to benchmarks/out/cpu_engines.md.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

import umakit
from umakit.sampling import SamplingParams

PROMPT = (
    "You are reviewing a pull request that adds a PyTorch backend to a small inference toolkit. "
    "Summarise, in a few short paragraphs, what a reviewer should check: correctness against a "
    "reference implementation, memory use while loading, decode speed, and how errors are reported."
)
OUT = Path(__file__).parent / "out" / "cpu_engines.md"


def time_umakit(model, ids: list[int], tokens: int) -> tuple[float, float, list[int]]:
    """(prefill tok/s, decode tok/s, tokens) of one greedy run through the engine's token generator."""
    engine = model.engine
    t0 = time.perf_counter()
    stream = engine.generate_tokens(ids, engine.make_cache(), SamplingParams(temperature=0))
    out = [next(stream)]
    t1 = time.perf_counter()
    out += [next(stream) for _ in range(tokens - 1)]
    t2 = time.perf_counter()
    stream.close()
    return len(ids) / (t1 - t0), (tokens - 1) / (t2 - t1), out


def time_transformers(model, ids: list[int], tokens: int) -> tuple[float, float, list[int]]:
    """The same measures for transformers' generate: prefill is a 1-token generate, decode the rest."""
    x = torch.tensor([ids])
    greedy = dict(do_sample=False, temperature=None, top_p=None, top_k=None, pad_token_id=0)
    with torch.inference_mode():
        t0 = time.perf_counter()
        model.generate(x, max_new_tokens=1, min_new_tokens=1, **greedy)
        t1 = time.perf_counter()
        out = model.generate(x, max_new_tokens=tokens, min_new_tokens=tokens, **greedy)
        t2 = time.perf_counter()
    prefill = t1 - t0
    return len(ids) / prefill, (tokens - 1) / (t2 - t1 - prefill), out[0, len(ids):].tolist()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=128, help="new tokens per run")
    ap.add_argument("--repeat", type=int, default=3, help="timed runs per engine (the median is reported)")
    ap.add_argument("--skip", nargs="*", default=[],
                    help="engines to skip: torch-float32 torch-float16 torch-bfloat16 mlx hf")
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    path = umakit.resolve_model(None)  # imports the packaged GGUF on first use
    engines = []  # (label, weights, dtype, timing function, model)
    for backend, dtype in [("torch", "float32"), ("torch", "float16"), ("torch", "bfloat16"), ("mlx", "float32")]:
        if f"{backend}-{dtype}" in args.skip or backend in args.skip:
            continue
        model = umakit.load(path, backend=backend, device="cpu", dtype=dtype)
        w = model.info.weights
        engines.append((f"umakit {backend}-CPU", f"{w.quantization}; {w.bytes_per_token / 1e6:.0f} MB/token",
                        dtype, time_umakit, model))
    tokenizer = umakit.load(path, backend="mlx", device="cpu") if not engines else engines[0][4]
    ids = tokenizer.encode(PROMPT)
    if "hf" not in args.skip:
        from transformers import AutoModelForCausalLM

        from umakit.default_model import packaged_gguf

        gguf = packaged_gguf()
        hf = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32).eval()
        engines.append(("transformers generate", "GGUF Q4_1 dequantized to float32; 538 MB/token", "float32",
                        time_transformers, hf))

    load_before = os.getloadavg()
    for _, _, _, fn, model in engines:
        fn(model, ids, 8)  # warm-up
    # Round-robin repeats, so a burst of load from elsewhere hits every engine alike.
    runs: list[list] = [[] for _ in engines]
    for _ in range(args.repeat):
        for i, (label, _, _, fn, model) in enumerate(engines):
            runs[i].append(fn(model, ids, args.tokens))
            print(f"  {label}: prefill {runs[i][-1][0]:.0f} tok/s, decode {runs[i][-1][1]:.1f} tok/s", file=sys.stderr)
    load_after = os.getloadavg()

    rows = []
    for (label, weights, dtype, _, _), rs in zip(engines, runs, strict=True):
        rows.append(dict(label=label, weights=weights, dtype=dtype, prefill=statistics.median(r[0] for r in rs),
                         decode=statistics.median(r[1] for r in rs), tokens=rs[0][2]))
    base = next((r["decode"] for r in rows if r["label"] == "transformers generate"), None)
    ref_tokens = rows[0]["tokens"]
    lines = [
        f"CPU engines on the default model ({path.name}): prompt {len(ids)} tokens, {args.tokens} new tokens, "
        f"greedy, median of {args.repeat} round-robin runs.",
        f"Machine: {platform.machine()}, {os.cpu_count()} CPUs, torch threads {torch.get_num_threads()}, "
        f"load average {load_before[0]:.1f} before / {load_after[0]:.1f} after (1-minute).",
        "",
        "| engine | weights | compute dtype | prefill tok/s | decode tok/s | decode vs transformers | "
        "first 32 tokens as row 1 |",
        "|---|---|---|---:|---:|---:|---|",
    ]
    for r in rows:
        ratio = f"{r['decode'] / base:.2f}x" if base else "n/a"
        same = "yes" if r["tokens"][:32] == ref_tokens[:32] else "no"
        lines.append(f"| {r['label']} | {r['weights']} | {r['dtype']} | {r['prefill']:.0f} | {r['decode']:.1f} | "
                     f"{ratio} | {same} |")
    table = "\n".join(lines)
    print(table)
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(table + "\n")


if __name__ == "__main__":
    main()
