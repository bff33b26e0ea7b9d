"""The cost of constrained decoding: decode tok/s with and without a JSON schema, at batch 1 and 8, in one run.

    python benchmarks/structured.py [--model FILE.gguf] [--tokens 192] [--repeat 3] [--backend torch] [--device cuda]

The default model answers the same prompts (asking for a city as a JSON record) greedily through
`Model.generate_batch`, once free and once under SCHEMA (nested objects, strings bounded by maxLength, numbers, an
enum, an array bounded by maxItems, so that every row can end inside ``--tokens``). The conditions alternate
within each of ``--repeat`` rounds (which goes first alternates too), so a burst of load from elsewhere hits both
alike; the table holds the medians. Columns: decode tok/s (all rows' tokens over the time in decode steps), its
ratio constrained/unconstrained, mean rows per step (constrained rows end when their JSON does, so the batch
thins sooner), ms per decode step, and the mask's cost per step two ways: the constrained step's extra time
(which includes the host sync a mask needs each step), and llguidance's own work per row (the constrained replies'
tokens replayed through fresh matchers: `allowed` then `accept`, no model). The last column says how many
constrained replies parsed and validated (`jsonschema`), and how many were cut by ``--tokens``.

The issue's bar: the mask costs at most 10% of decode speed at batch 1 (ratio >= 0.90). Printed, not asserted.
Prints a markdown table and writes it to benchmarks/out/structured.md.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from datetime import date
from pathlib import Path

OUT = Path(__file__).parent / "out" / "structured.md"
BATCHES = (1, 8)
BAR = 0.90  # constrained/unconstrained decode tok/s the issue asks for at batch 1
CITIES = ("Paris", "Tokyo", "Nairobi", "Lima", "Oslo", "Hanoi", "Toronto", "Sydney")
PROMPT = "Describe {} as JSON with name, country, population and a list of landmarks."
_NAME = {"type": "string", "maxLength": 32}
SCHEMA = {
    "type": "object",
    "properties": {
        "name": _NAME,
        "country": _NAME,
        "population": {"type": "integer", "minimum": 0, "maximum": 100_000_000},
        "continent": {"enum": ["Africa", "Asia", "Europe", "North America", "Oceania", "South America"]},
        "location": {"type": "object", "properties": {"lat": {"type": "number", "minimum": -90, "maximum": 90},
                                                      "lon": {"type": "number", "minimum": -180, "maximum": 180}},
                     "required": ["lat", "lon"], "additionalProperties": False},
        "landmarks": {"type": "array", "minItems": 1, "maxItems": 3,
                      "items": {"type": "object", "properties": {
                          "name": _NAME, "kind": {"enum": ["museum", "monument", "park", "building", "other"]}},
                          "required": ["name", "kind"], "additionalProperties": False}},
    },
    "required": ["name", "country", "population", "continent", "location", "landmarks"],
    "additionalProperties": False,
}


def run(model, batch: int, tokens: int, constrained: bool):
    prompts = [PROMPT.format(CITIES[i % len(CITIES)]) for i in range(batch)]
    return model.generate_batch(prompts, schema=SCHEMA if constrained else None, temperature=0, max_tokens=tokens,
                                batch_size=batch)


def validated(results) -> tuple[int, int]:
    """(replies that parse and validate against SCHEMA, replies cut by max_tokens)."""
    import jsonschema

    ok = 0
    for r in results:
        try:
            jsonschema.validate(json.loads(r.text), SCHEMA)
            ok += 1
        except (ValueError, jsonschema.ValidationError):
            pass
    return ok, sum(r.finish_reason == "length" for r in results)


def mask_us_per_row_step(model, results) -> float:
    """llguidance's time per token (`allowed`, then `accept`) replaying the constrained replies, in microseconds."""
    from umakit.generate.constrain import Constraint

    constraint = Constraint.json_schema(SCHEMA)
    elapsed, steps = 0.0, 0
    for r in results:
        matcher = constraint.matcher(model.tokenizer)
        t = time.perf_counter()
        for token in r.tokens:
            matcher.allowed()
            matcher.accept(token)
        elapsed += time.perf_counter() - t
        steps += len(r.tokens)
    return elapsed / steps * 1e6 if steps else 0.0


def main() -> None:
    import umakit

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=192, help="max_tokens of every row")
    ap.add_argument("--repeat", type=int, default=3, help="rounds; the table holds the medians")
    ap.add_argument("--model", default=None, help="a model directory or .gguf (default: the built-in model)")
    ap.add_argument("--backend", default="torch")
    ap.add_argument("--device", default=None)
    ap.add_argument("--dtype", default="auto")
    args = ap.parse_args()

    model = umakit.load(args.model, backend=args.backend, device=args.device, dtype=args.dtype)
    for batch in BATCHES:  # warm-up: kernels, allocator, llguidance's vocabulary
        for constrained in (False, True):
            run(model, batch, 8, constrained)
    runs: dict[tuple[int, bool], list] = {(b, c): [] for b in BATCHES for c in (False, True)}
    for i in range(args.repeat):
        for batch in BATCHES:
            for constrained in ((False, True) if i % 2 == 0 else (True, False)):
                runs[batch, constrained].append(run(model, batch, args.tokens, constrained))

    def median(batch, constrained, of):
        return statistics.median(of(r.stats) for r in runs[batch, constrained])

    lines = [f"Measured {date.today()} on {model.device_info.name} ({platform.machine()}), {model!r}; greedy, "
             f"max_tokens {args.tokens}, median of {args.repeat} alternating rounds.", "",
             "| batch | schema | decode tok/s | ratio | rows/step | ms/step | extra ms/step | llguidance µs/row-step "
             "| valid (cut) |",
             "|---:|---|---:|---:|---:|---:|---:|---:|---|"]
    ratios = {}
    for batch in BATCHES:
        plain_step = median(batch, False, lambda s: s.decode_s / s.steps)
        for constrained in (False, True):
            tps = median(batch, constrained, lambda s: s.decode_tps)
            step = median(batch, constrained, lambda s: s.decode_s / s.steps)
            rows = median(batch, constrained, lambda s: s.generated_tokens / s.steps)
            cells = [str(batch), "yes" if constrained else "no", f"{tps:.1f}", "", f"{rows:.2f}", f"{step * 1e3:.2f}",
                     "", "", ""]
            if constrained:
                ratios[batch] = tps / median(batch, False, lambda s: s.decode_tps)
                results = [r for run_ in runs[batch, True] for r in run_.results]
                ok, cut = validated(results)
                cells[3] = f"{ratios[batch]:.3f}"
                cells[6] = f"{(step - plain_step) * 1e3:+.2f}"
                cells[7] = f"{mask_us_per_row_step(model, results):.0f}"
                cells[8] = f"{ok}/{len(results)} ({cut})"
            lines.append("| " + " | ".join(cells) + " |")
    verdict = "meets" if ratios[1] >= BAR else "misses"
    lines += ["", f"Batch 1: constrained decode runs at {ratios[1]:.1%} of unconstrained speed; the issue's bar is "
                  f"{BAR:.0%} (at most a 10% cost): {verdict} it."]
    text = "\n".join(lines) + "\n"
    print(text)
    OUT.parent.mkdir(exist_ok=True)
    OUT.write_text(text)


if __name__ == "__main__":
    main()
