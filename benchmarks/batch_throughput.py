"""Aggregate decode throughput of batched generation versus batch size.

    python benchmarks/batch_throughput.py                 # the built-in default model
    python benchmarks/batch_throughput.py path/to/model --sizes 1,2,4,8,16 --max-tokens 64

Each batch size runs that many prompts at once (greedy, so every row runs to
max_tokens unless it meets EOS), ``--repeats`` times; the best run counts, as
the machine may be shared. Decode tok/s counts every row's generated tokens
over the time spent in decode steps; GB/s is the weights read once per step
plus every row's KV cache (padding included), over the same time. The first
line is the single-sequence `Model.generate` for reference.
"""

from __future__ import annotations

import argparse
import platform

PROMPTS = [
    "Write a long story about a lighthouse keeper who finds a map.",
    "Explain in detail how a steam engine works, step by step.",
    "Describe a walk through a busy market in a city you love.",
    "Write a detailed recipe for bread, with every step explained.",
    "Tell me the history of the bicycle from its invention onwards.",
    "Write a letter from a sailor to his family during a long voyage.",
    "Explain how plants turn sunlight into energy, for a curious child.",
    "Describe the planets of the solar system one by one.",
]


def main() -> None:
    import umakit

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model", nargs="?", default=None, help="model path (default: the built-in SmolLM2-135M)")
    ap.add_argument("--sizes", default="1,2,4,8,16")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--backend", default="auto")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dtype", default="auto", help="compute dtype (torch: auto, float32, float16, bfloat16)")
    args = ap.parse_args()

    model = umakit.load(args.model, backend=args.backend, device=args.device, dtype=args.dtype)
    w = model.info.weights
    print(f"{model} · weights {w.total_bytes / 2**20:.0f} MiB · {platform.machine()} {platform.system()}")
    model.generate_batch(PROMPTS[:2], max_tokens=8, temperature=0, batch_size=2)  # warm-up
    single = max((model.generate(PROMPTS[0], max_tokens=args.max_tokens, temperature=0) for _ in range(args.repeats)),
                 key=lambda r: r.stats.decode_tps)
    print(f"Model.generate, one sequence: {single.stats.decode_tps:.1f} tok/s")
    print(f"{'batch':>5} {'tokens':>7} {'decode s':>9} {'tok/s':>8} {'x b=1':>6} {'GB/s':>6} {'steps':>6}")
    base = None
    for size in (int(s) for s in args.sizes.split(",")):
        prompts = [PROMPTS[i % len(PROMPTS)] for i in range(size)]
        runs = [model.generate_batch(prompts, max_tokens=args.max_tokens, temperature=0, batch_size=size)
                for _ in range(args.repeats)]
        run = max(runs, key=lambda r: r.stats.decode_tps)
        s = run.stats
        base = base or s.decode_tps
        print(f"{run.batch_size:>5} {s.generated_tokens:>7} {s.decode_s:>9.2f} {s.decode_tps:>8.1f} "
              f"{s.decode_tps / base:>6.2f} {s.achieved_gbps:>6.2f} {s.steps:>6}")
        if run.note:
            print(f"      note: {run.note}")


if __name__ == "__main__":
    main()
