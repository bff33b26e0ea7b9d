"""Prompt lookup in a batch (`umakit batch --prompt-lookup`, `serve --prompt-lookup`) against plain batched
decoding, on the default model, in one run.

    python benchmarks/batch_lookup.py [--tokens 128] [--repeat 2] [--sizes 1,3,6] [--model FILE]

The prompts of benchmarks/speculative.py (three copy-heavy, three open-ended),
greedy, decoded as one batch of each size (the batch cycles through the
prompts), plain and with prompt lookup in rotation, median of the repeats.
Every speculative run's text is checked against the plain run's. Decode tok/s
counts the batch's generated tokens over its decode time (prefill apart), and
tokens a step says how much each forward pass yielded. Prints a markdown table
and writes it to benchmarks/out/batch_lookup.md.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time
from pathlib import Path

import umakit
from speculative import prompts

OUT = Path(__file__).parent / "out" / "batch_lookup.md"


def run(model, batch: list[str], tokens: int, lookup: bool):
    out = model.generate_batch(batch, max_tokens=tokens, temperature=0, batch_size=len(batch), prompt_lookup=lookup)
    s = out.stats
    return [r.text for r in out], s.generated_tokens / s.decode_s, s.generated_tokens / s.steps / len(batch)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--sizes", default="1,3,6")
    ap.add_argument("--model", default=None, help="a GGUF or model directory instead of the built-in model (a "
                    "random-weights file checks the text is unchanged; only a trained model copies)")
    args = ap.parse_args()
    model = umakit.load(args.model, backend="torch")
    groups = prompts()
    rows = []
    for kind, texts in groups.items():
        for size in (int(x) for x in args.sizes.split(",")):
            batch = [texts[i % len(texts)] for i in range(size)]
            seen = {False: [], True: []}
            texts_of = {}
            for _ in range(args.repeat):
                for lookup in (False, True):
                    texts_of[lookup], tps, per_step = run(model, batch, args.tokens, lookup)
                    seen[lookup].append((tps, per_step))
            plain = statistics.median(t for t, _ in seen[False])
            for lookup in (False, True):
                tps = statistics.median(t for t, _ in seen[lookup])
                per_step = statistics.median(p for _, p in seen[lookup])
                rows.append(f"| {kind} | {size} | {'prompt lookup' if lookup else 'plain'} | {tps:.1f} | "
                            f"{tps / plain:.2f}x | {per_step:.2f} | {'yes' if texts_of[lookup] == texts_of[False] else 'NO'} |")
    lines = [f"Prompt lookup in a batch, {time.strftime('%Y-%m-%d')}, {platform.processor() or platform.machine()}, "
             f"{model.info.name} ({model.info.weights.quantization}), greedy, at most {args.tokens} tokens a row, median of "
             f"{args.repeat}.", "",
             "| prompts | rows | decoding | decode tok/s (all rows) | vs plain | tokens a row and step | same text |",
             "|---|---:|---|---:|---:|---:|---|", *rows]
    text = "\n".join(lines) + "\n"
    print(text)
    OUT.parent.mkdir(exist_ok=True)
    OUT.write_text(text)


if __name__ == "__main__":
    main()
