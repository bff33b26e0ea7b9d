"""What several benchmarks share: an engine's decode rates, ways run each in a process of its own in rotation,
and a table printed and written under benchmarks/out. Imported by the scripts beside it (run as
``python benchmarks/NAME.py``, which puts this folder on the path)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

PROMPT = list(range(100, 116))


def decode_rates(engine, tokens: int, rows: int = 8, steps: int | None = None) -> tuple[float, float]:
    """(tok/s of ``tokens`` greedy tokens after `PROMPT`, tok/s summed over ``rows`` rows decoded together for
    ``steps`` steps, default a quarter of ``tokens`` and at least 4), each after one untimed step."""
    from umakit.backends.base import BatchRow
    from umakit.generate.sampling import SamplingParams

    greedy = SamplingParams(temperature=0)
    stream = engine.generate_tokens(PROMPT, engine.make_cache(), greedy)
    next(stream)
    t = time.perf_counter()
    for _ in range(tokens):
        next(stream)
    single = tokens / (time.perf_counter() - t)
    stream.close()
    decoder = engine.batch_decoder()
    decoder.add([BatchRow(i, [i + 3] + PROMPT, greedy) for i in range(rows)])
    decoder.step()
    steps = steps or max(4, tokens // 4)
    t = time.perf_counter()
    for _ in range(steps):
        decoder.step()
    return single, rows * steps / (time.perf_counter() - t)


def in_rotation(script: str, ways, repeat: int, extra: list[str], threads: int, env: dict | None = None) -> dict:
    """{way: [the worker's JSON result, ...]}: ``script --worker WAY *extra`` in a fresh process each, the ways in
    rotation ``repeat`` times; a failed run is reported on stderr and left out."""
    runs: dict = {w: [] for w in ways}
    for _ in range(repeat):
        for way in ways:
            done = subprocess.run([sys.executable, script, "--worker", way, *extra], capture_output=True, text=True,
                                  env={**os.environ, **(env or {}), "OMP_NUM_THREADS": str(threads)})
            if done.returncode:
                print(f"  {way} failed:\n{done.stderr[-1500:]}", file=sys.stderr)
                continue
            runs[way].append(json.loads(done.stdout.strip().splitlines()[-1]))
    return runs


def publish(lines: list[str], out: Path) -> None:
    """Print the table and write it to ``out``."""
    table = "\n".join(lines) + "\n"
    print(table)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(table)
