"""What --deterministic costs and what it buys, on the torch engine's CPU default (one process, both modes).

    python benchmarks/deterministic.py                       # the built-in model
    python benchmarks/deterministic.py --model FILE.gguf --lengths 40,128,512 --rows 1,8,16,32

The same checkpoint is loaded twice, as it is by default and with ``deterministic=True``; every figure
alternates the two loads, ``--repeat`` times, and keeps the median:

- prefill ms of a prompt of each ``--lengths`` (Jane-Austen-like text made of the chat prompts below, cycled);
- batch decode tok/s at each ``--rows`` (greedy, ``--tokens`` steps after a short prompt a row);
- how many two-pass splits of ``--prompts`` chat prompts (first passes of 8, 16, 17, 30, 33 tokens and all but
  two) change the next ``--greedy`` greedy tokens from the one-pass run: what the mode buys.

It prints a Markdown table for docs/performance.md.
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import time

import umakit
from umakit.backends.base import BatchRow
from umakit.generate.sampling import SamplingParams

GREEDY = SamplingParams(temperature=0)
QUESTIONS = ["Write two sentences about a mountain.", "What is two plus two?", "Describe a river at dawn.",
             "Name three fruits and say why you like them.", "Explain what a lighthouse does.",
             "Write a short letter to a friend about the weather."]


def prefill_ms(engine, tokens: list[int]) -> float:
    cache = engine.make_cache()
    t0 = time.perf_counter()
    engine.prefill(tokens, cache)
    return 1000 * (time.perf_counter() - t0)


def decode_tps(engine, prompts: list[list[int]], steps: int) -> float:
    decoder = engine.batch_decoder()
    decoder.add([BatchRow(i, p, GREEDY) for i, p in enumerate(prompts)])
    decoder.step()  # the rows' first tokens
    t0 = time.perf_counter()
    made = sum(len(decoder.step()) for _ in range(steps))
    return made / (time.perf_counter() - t0)


def greedy(engine, ids: list[int], split: int, n: int) -> list[int]:
    cache = engine.make_cache()
    if split:
        engine.prefill(ids[:split], cache)
    return list(itertools.islice(engine.generate_tokens(ids[split:], cache, GREEDY), n))


def changed_splits(engine, prompts: list[list[int]], n: int) -> tuple[int, int]:
    changed = total = 0
    for ids in prompts:
        whole = greedy(engine, ids, 0, n)
        for split in sorted({8, 16, 17, 30, 33, len(ids) - 2} & set(range(1, len(ids) - 1))):
            total += 1
            changed += greedy(engine, ids, split, n) != whole
    return changed, total


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="a model umakit loads (default: the built-in one)")
    ap.add_argument("--lengths", default="40,128,512")
    ap.add_argument("--rows", default="1,8,16,32")
    ap.add_argument("--tokens", type=int, default=32, help="batch decode steps timed")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--prompts", type=int, default=4, help="chat prompts whose splits are tried")
    ap.add_argument("--greedy", type=int, default=48, help="greedy tokens compared after each split")
    args = ap.parse_args()
    models = {"default": umakit.load(args.model, backend="torch", device="cpu"),
              "--deterministic": umakit.load(args.model, backend="torch", device="cpu", deterministic=True)}
    first = models["default"]
    chats = [first.encode(None, [{"role": "user", "content": q}], None, False) for q in QUESTIONS]
    text = list(itertools.chain.from_iterable(chats))
    rows = []
    for n in [int(x) for x in args.lengths.split(",")]:
        tokens = list(itertools.islice(itertools.cycle(text), n))
        times: dict[str, list[float]] = {k: [] for k in models}
        for _ in range(args.repeat):
            for name, m in models.items():
                times[name].append(prefill_ms(m.engine, tokens))
        rows.append((f"prefill {n} tokens, ms", {k: statistics.median(v) for k, v in times.items()}, "{:.0f}"))
    for b in [int(x) for x in args.rows.split(",")]:
        prompts = [chats[i % len(chats)] for i in range(b)]
        rates: dict[str, list[float]] = {k: [] for k in models}
        for _ in range(args.repeat):
            for name, m in models.items():
                rates[name].append(decode_tps(m.engine, prompts, args.tokens))
        rows.append((f"batch decode, {b} rows, tok/s", {k: statistics.median(v) for k, v in rates.items()}, "{:.1f}"))
    splits = {name: changed_splits(m.engine, chats[:args.prompts], args.greedy) for name, m in models.items()}
    print(f"{first.info.name} on {first.info.weights.quantization} ({first.info.device}), "
          f"{time.strftime('%Y-%m-%d')}; median of {args.repeat}, the two loads alternating\n")
    print("| measure | default | --deterministic | ratio |")
    print("|---|---:|---:|---:|")
    for label, values, form in rows:
        d, e = values["default"], values["--deterministic"]
        print(f"| {label} | {form.format(d)} | {form.format(e)} | {e / d:.2f}x |")
    (dc, total), (ec, _) = splits["default"], splits["--deterministic"]
    print(f"| two-pass splits changing the next {args.greedy} greedy tokens | {dc} of {total} | {ec} of {total} | |")


if __name__ == "__main__":
    main()
