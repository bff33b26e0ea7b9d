"""Check umakit's Metal path on an Apple Silicon Mac: wiring, memory and decode speed, in under 5 minutes.

    python benchmarks/mac_check.py            # on a Mac (about 2-4 minutes on an M-series Max/Ultra)
    python benchmarks/mac_check.py --quick    # fewer tokens and repeats
    python benchmarks/mac_check.py --tiny     # a small random model only (a smoke test; any machine)

Prints the chip, its memory, working set and peak bandwidth; the wired limit
before, during and after `Engine.wired()` (nested, and with UMAKIT_NO_WIRE=1);
then, for the built-in model (when its package is installed) and a synthetic
Llama-3-8B in 4 bits, decode tok/s, GB/s, share of peak bandwidth and peak
memory, for umakit (`umakit.bench.run_bench`) and for mlx-lm's own decode loop
(`mlx_lm.generate.generate_step` under its `wired_limit`) on the very same
weights in memory, in the same run. Ends with a markdown table, also written
to benchmarks/out/mac_check.md, with a batch of copy-heavy prompts decoded with and
without prompt lookup on the built-in model. What good looks like: MLX runs a 70B bf16 at
about 83% of an M2 Ultra's 800 GB/s; llama.cpp's Q4_0 reaches 40-63% on an
M2 Ultra / M3 Max / M4 Max. umakit should sit within a few percent of mlx-lm.

Without a Metal GPU (Linux, CI) it says so in one line and runs the parts a
CPU can run: the small random model through both decode loops on MLX's CPU.

Checked on CPU by the tests (tests/test_wiring.py, tests/test_mlx_engine.py):
the wiring policy with fake Metal calls (limit = weights x 1.05 capped by the
working set, nesting, restore when the body or synchronize raises,
UMAKIT_NO_WIRE), the entry points that hold it, the batch KV budget, the
device-info helper, the wired-limit advice, vm_stat parsing, cast_predicate,
auto dtype, clear-cache cadence and the last-position-only first token.

Checked only on a Mac (here), the Metal-only lines:
- umakit/backends/mlx/wiring.py `_metal_calls`: `mx.set_wired_limit` on a real
  GPU (accepts weights x 1.05, returns the old limit, the restore takes), the
  real working set, `mx.synchronize` and `mx.clear_cache` before wiring;
- umakit/hardware/metal.py: `mx.device_info(mx.gpu)` has
  max_recommended_working_set_size and memory_size, without the deprecation
  warning of `mx.metal.device_info`;
- umakit/backends/mlx/batch_decoder.py `kv_budget_bytes` on Metal: 0.7 x (working set
  minus weights), printed here;
- umakit/backends/mlx/engine.py on Metal: auto dtype picks a half type, the
  float64 cast on the CPU stream, cast_predicate's float32 parameters on the
  GPU, the released buffers (peak memory below weights + KV + activations);
- umakit/hardware/local.py on macOS: `available_ram` from the real `vm_stat`,
  the chip from sysctl/ioreg, and the `iogpu.wired_limit_mb` advice below RAM;
- every speed figure: tok/s, GB/s, share of peak, and the gap to mlx-lm.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import mlx.core as mx

import umakit
from umakit.bench.measure import BenchSettings, random_prompt, run_bench
from umakit.errors import UmakitError
from umakit.hardware import available_ram

OUT = Path(__file__).parent / "out" / "mac_check.md"
GiB = 1 << 30
TINY = dict(model_type="llama", vocab_size=1000, hidden_size=256, intermediate_size=768, num_hidden_layers=4,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048, rms_norm_eps=1e-5,
            rope_theta=500000.0, tie_word_embeddings=False)
MLX_LM_GAP = 0.05  # umakit's decode tok/s may trail mlx-lm's by at most this share


def wired_limit_now() -> int:
    """The process's wired limit (MLX has no getter: set it to itself)."""
    old = mx.set_wired_limit(0)
    mx.set_wired_limit(old)
    return old


def check_wiring(model, report: list[str]) -> bool:
    """Wired limit before, during (nested too), after, and under UMAKIT_NO_WIRE; True when all hold."""
    from umakit.backends.mlx.wiring import NO_WIRE_ENV, WIRE_MARGIN, wiring_disabled

    if wiring_disabled():
        report.append(f"wiring: off ({NO_WIRE_ENV} is set), not checked")
        return True
    engine, ok = model.engine, True
    weights = model.info.weights.total_bytes
    working_set = model.device_info.working_set_bytes or 0
    want = min(int(weights * WIRE_MARGIN), working_set)
    before = wired_limit_now()
    with engine.wired():
        during = wired_limit_now()
        with engine.wired():
            nested = wired_limit_now()
        after_inner = wired_limit_now()
    after = wired_limit_now()
    os.environ[NO_WIRE_ENV] = "1"
    try:
        with engine.wired():
            opted_out = wired_limit_now()
    finally:
        os.environ.pop(NO_WIRE_ENV)
    for name, got, expect in [("during", during, want), ("nested", nested, want), ("after the inner", after_inner, want),
                              ("after", after, before), ("with UMAKIT_NO_WIRE=1", opted_out, before)]:
        good = got == expect
        ok &= good
        report.append(f"wired limit {name}: {got / GiB:.2f} GiB (want {expect / GiB:.2f}) {'ok' if good else 'WRONG'}")
    report.append(f"batch KV budget: {engine.batch_decoder().kv_budget_bytes() / GiB:.2f} GiB "
                  f"(working set {working_set / GiB:.1f} GiB, weights {weights / GiB:.2f} GiB)")
    return ok


def time_mlx_lm(model, prompt: list[int], tokens: int, repeat: int) -> tuple[float, int]:
    """mlx-lm's decode loop over umakit's model object (the same weights): median decode tok/s, peak bytes."""
    from mlx_lm.generate import generate_step, wired_limit
    from mlx_lm.sample_utils import make_sampler

    net = model.engine.model  # an mlx-lm model class instance, loaded by umakit
    sampler = make_sampler(temp=0.0)
    speeds, peak = [], 0
    for _ in range(repeat + 1):  # the first run warms up
        mx.reset_peak_memory()
        with wired_limit(net):
            steps = generate_step(mx.array(prompt, dtype=mx.uint32), net, max_tokens=tokens, sampler=sampler)
            next(steps)  # the first token: prefill
            t0, n = time.perf_counter(), 0
            for _token, _ in steps:
                n += 1
            speeds.append(n / (time.perf_counter() - t0))
        peak = max(peak, mx.get_peak_memory())
    return statistics.median(speeds[1:]), peak


def measure(name: str, model, settings: BenchSettings) -> dict:
    record = run_bench(model, settings)
    s = record.summary
    vocab = model.engine.config.get("vocab_size") or 1000
    prompt = random_prompt(vocab, settings.prompt_tokens, settings.seed)
    ref_tps, ref_peak = time_mlx_lm(model, prompt, settings.gen_tokens, settings.repeat)
    ref, _ = model.measure_decode(ref_tps, settings.prompt_tokens + settings.gen_tokens // 2)
    return {"name": name, "tps": s["decode_tps"].median, "gbps": s["achieved_gbps"].median, "mbu": s["mbu"].median,
            "peak": max(r.peak_memory_bytes for r in record.runs), "ref_tps": ref_tps, "ref_gbps": ref.achieved_gbps,
            "ref_mbu": ref.mbu, "ref_peak": ref_peak, "weights": model.info.weights.total_bytes,
            "dtype": model.info.dtype}


PASSAGE = ("It is a truth universally acknowledged, that a single man in possession of a good fortune, must be in want "
           "of a wife. However little known the feelings or views of such a man may be on his first entering a "
           "neighbourhood, this truth is so well fixed in the minds of the surrounding families.")
COPY_PROMPTS = [f"Copy this passage exactly:\n\n{PASSAGE}",
                f"Fix the typos in this passage:\n\n{PASSAGE.replace('the', 'teh')}",
                f"Repeat this passage in capitals:\n\n{PASSAGE}", f"Quote the first sentence of:\n\n{PASSAGE}"]


def check_batch_lookup(model, tokens: int) -> str:
    """A batch of 4 copy-heavy prompts, greedy, with and without prompt lookup (batch_decoder.py's MLX path):
    the wall time of each and whether the texts agree (on MLX they may differ at a near-tie)."""
    times, runs = [], []
    for lookup in (False, True):
        t = time.perf_counter()
        runs.append(model.generate_batch(COPY_PROMPTS, max_tokens=tokens, temperature=0, prompt_lookup=lookup))
        times.append(time.perf_counter() - t)
    same = sum(a.text == b.text for a, b in zip(*runs))
    n = runs[1].stats.generated_tokens
    return (f"batch prompt lookup, 4 copy-heavy rows, {tokens} tokens: {times[0]:.2f} s plain, {times[1]:.2f} s with "
            f"lookup ({times[0] / times[1]:.2f}x), {runs[1].stats.steps} steps for {n} tokens, the same text in "
            f"{same} of 4")


def table(rows: list[dict], peak_gbps: float) -> str:
    lines = [f"| model | dtype | weights GiB | umakit tok/s | GB/s | % of {peak_gbps:.0f} GB/s | peak GiB "
             "| mlx-lm tok/s | GB/s | % of peak | peak GiB | umakit / mlx-lm |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['name']} | {r['dtype']} | {r['weights'] / GiB:.2f} | {r['tps']:.1f} | {r['gbps']:.1f} "
                     f"| {r['mbu']:.0%} | {r['peak'] / GiB:.2f} | {r['ref_tps']:.1f} | {r['ref_gbps']:.1f} "
                     f"| {r['ref_mbu']:.0%} | {r['ref_peak'] / GiB:.2f} | {r['tps'] / r['ref_tps']:.2f} |")
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="fewer tokens and repeats")
    p.add_argument("--tiny", action="store_true", help="only the small random model (a smoke test)")
    args = p.parse_args()
    metal = mx.metal.is_available()
    device = "metal" if metal else "cpu"
    if not metal:
        print("no Metal GPU here: only the CPU-possible parts run (the small random model on MLX's CPU)")
    gen = 16 if args.tiny or not metal else 64 if args.quick else 128
    settings = BenchSettings(prompt_tokens=64 if args.tiny else 128, gen_tokens=gen,
                             repeat=1 if args.tiny or args.quick else 3, warmup=1)
    report, rows, ok = [], [], True
    tiny = umakit.load_synthetic(TINY, backend="mlx", device=device)
    dev = tiny.device_info
    report.append(f"chip: {dev.name} ({dev.gpu_cores or '?'} GPU cores), {platform.platform()}")
    report.append(f"memory {dev.memory_bytes / GiB:.0f} GiB, working set "
                  f"{(dev.working_set_bytes or 0) / GiB:.1f} GiB, peak {dev.peak_bandwidth_gbps:.0f} GB/s "
                  f"({dev.bandwidth_source}), available now {available_ram() / GiB:.1f} GiB")
    if metal:
        ok &= check_wiring(tiny, report)
    print("\n".join(report), flush=True)
    models = [("random llama (tiny)", lambda: tiny)]
    if metal and not args.tiny:
        models = [("built-in model", lambda: umakit.load(None, backend="mlx", device=device)),
                  ("synthetic Llama-3-8B 4-bit", lambda: umakit.load_synthetic("llama-3-8b", backend="mlx",
                                                                               device=device, bits=4))]
    for name, load in models:
        try:
            model = load()
        except UmakitError as e:
            print(f"{name}: skipped ({e})", flush=True)
            continue
        t0 = time.perf_counter()
        rows.append(measure(name, model, settings))
        r = rows[-1]
        print(f"{name}: umakit {r['tps']:.1f} tok/s ({r['mbu']:.0%} of peak), mlx-lm {r['ref_tps']:.1f} tok/s "
              f"({r['ref_mbu']:.0%}), {time.perf_counter() - t0:.0f} s", flush=True)
        if metal and r["tps"] < (1 - MLX_LM_GAP) * r["ref_tps"]:
            report.append(f"{name}: umakit trails mlx-lm by more than {MLX_LM_GAP:.0%}")
        del model
    if metal and not args.tiny:  # (on MLX's CPU it runs too, slowly: 107 s here for 16 tokens, prefill mostly)
        try:
            line = check_batch_lookup(umakit.load(None, backend="mlx", device=device), gen)
        except UmakitError as e:
            line = f"batch prompt lookup: skipped ({e})"
        print(line, flush=True)
        report.append(line)
    text = "\n".join(["# mac_check", "", *(f"- {line}" for line in report), "", table(rows, dev.peak_bandwidth_gbps)])
    print("\n" + table(rows, dev.peak_bandwidth_gbps))
    OUT.parent.mkdir(exist_ok=True)
    OUT.write_text(text + "\n", encoding="utf-8")
    if not ok:
        print("a wiring check failed (see above)", file=sys.stderr)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
