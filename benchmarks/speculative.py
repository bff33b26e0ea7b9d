"""Plain decoding against speculative decoding on the default model, in one run.

    python benchmarks/speculative.py [--tokens 128] [--repeat 2] [--draft-dtype bfloat16]

Copy-heavy prompts (correct a passage of Jane Austen, extract its quoted
sentences, edit a code snippet) and open-ended ones, greedy, the same number
of new tokens at most. Each prompt runs plain, with prompt lookup, and with a
draft model, in rotation, median of the repeats. The text of every speculative
run is checked against the plain run's (greedy speculation is lossless).

No smaller model with SmolLM2's tokenizer ships offline, so the draft stands
in as the same weights in another execution form (``--draft-dtype``; on CPU
bfloat16 runs on torch's int4 kernels): that shows the machinery and its
acceptance, not the speed-up a 3-10x smaller draft gives. The Austen text
comes from `umakit corpora fetch austen` (Debian's r-cran-janeaustenr).
Prints a markdown table and writes it to benchmarks/out/speculative.md.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time
from pathlib import Path

import umakit
from umakit.evaluate.corpora import fetch, load_corpus

OUT = Path(__file__).parent / "out" / "speculative.md"
CODE = '''def moving_average(values, window):
    result = []
    for i in range(len(values)):
        start = max(0, i - window + 1)
        chunk = values[start:i + 1]
        result.append(sum(chunk) / len(chunk))
    return result
'''
OPEN = [
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "What are three good habits for learning a new language? Explain each briefly.",
    "Describe a walk through a forest in autumn.",
]


def austen_passage(chars: int = 700) -> str:
    fetch("austen")
    text = load_corpus("austen")
    start = text.index("Mrs. John Dashwood now installed herself")  # a passage with dialogue follows
    return " ".join(text[start:start + chars].split())


def prompts() -> dict[str, list[str]]:
    passage = austen_passage()
    return {
        "copy-heavy": [
            f"Correct any spelling mistakes in this passage and write it out again in full:\n\n{passage}",
            f"Copy out, word for word, every sentence of this passage that contains a comma:\n\n{passage}",
            f"Rename the variable `chunk` to `span` in this code and print the whole function:\n\n{CODE}",
        ],
        "open-ended": OPEN,
    }


def run(model, prompt: str, tokens: int, **how):
    t0 = time.perf_counter()
    r = model.generate(prompt, max_tokens=tokens, temperature=0, **how)
    return r, time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--draft-dtype", default="bfloat16")
    args = ap.parse_args()

    model = umakit.load()
    draft = umakit.load(dtype=args.draft_dtype, backend=model.info.backend)
    methods = {"plain": {}, "prompt lookup": {"prompt_lookup": True}, f"draft ({args.draft_dtype} weights)":
               {"draft": draft}}
    for how in methods.values():  # warm up: packing, first-call costs
        run(model, "Hello", 8, **how)
    rows = []
    for kind, items in prompts().items():
        for i, prompt in enumerate(items):
            tps = {m: [] for m in methods}
            result = {}
            for _ in range(args.repeat):
                for name, how in methods.items():
                    r, _ = run(model, prompt, args.tokens, **how)
                    tps[name].append(r.stats.decode_tps)
                    result[name] = r
            plain = result["plain"]
            for name in methods:
                r = result[name]
                s = r.stats.speculative
                rows.append(dict(
                    kind=kind, prompt=i + 1, method=name, tokens=len(r.tokens),
                    tps=statistics.median(tps[name]), vs_plain=statistics.median(tps[name]) /
                    statistics.median(tps["plain"]),
                    over=r.stats.over_roofline, accept=s.acceptance_rate if s else None,
                    per_step=s.tokens_per_step if s else 1.0, same=r.tokens == plain.tokens))
    lines = [f"Decode speed, plain against speculative; default model ({model.info.name}, "
             f"{model.info.backend}/{model.info.device} {model.info.dtype}), greedy, up to {args.tokens} new "
             f"tokens, median of {args.repeat}; {platform.processor() or platform.machine()}, "
             f"{time.strftime('%Y-%m-%d')}.", "",
             "| prompts | prompt | method | tokens | decode tok/s | vs plain | x one-token roofline | accepted |"
             " tok/target step | same text |",
             "|---|---:|---|---:|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        accept = "" if r["accept"] is None else f"{r['accept']:.0%}"
        lines.append(f"| {r['kind']} | {r['prompt']} | {r['method']} | {r['tokens']} | {r['tps']:.1f} | "
                     f"{r['vs_plain']:.2f}x | {r['over']:.2f} | {accept} | {r['per_step']:.2f} | "
                     f"{'yes' if r['same'] else 'NO'} |")
    lines.append("")
    for kind in ("copy-heavy", "open-ended"):
        for name in methods:
            if name == "plain":
                continue
            ratios = [r["vs_plain"] for r in rows if r["kind"] == kind and r["method"] == name]
            lines.append(f"- {kind}, {name}: {statistics.geometric_mean(ratios):.2f}x plain decode tok/s "
                         f"(geometric mean of {len(ratios)})")
    table = "\n".join(lines)
    print(table)
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(table + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
