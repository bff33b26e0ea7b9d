"""umakit's CPU affine kernel, layer by layer, against torch's int4 kernel and the memory's bandwidth, in one process.

    python benchmarks/affine_layers.py [--threads 2] [--repeat 30]

Layers of Qwen2.5-1.5B's shapes (its MLP's up and down projections and an attention projection), random
weights quantized min-max in groups of 32 at 4, 5, 6 and 8 bits. For each width and form of the kernel's inputs
(float32; int8 in one pass, llama.cpp's scheme; int8 in two passes, the default with AVX512-VNNI): the bytes a
decode step (one input row) reads per second, and the time of 1, 4, 16 and 64 input rows. At 4 bits, torch's
int4 kernel (`Int4PackLinear`, the CPU form those layers took before) on the same layers. Each call runs
copies of the three layers that together hold at least 256 MB, so the weights come from memory as a model's do,
not from the caches; times are per copy. The reference is a float32 sum over 256 MB, what one pass over memory
reads per second here. Median of ``--repeat`` calls.

Prints a markdown table and writes it to benchmarks/out/affine_layers.md.
"""

from __future__ import annotations

import argparse
import copy
import platform
import time
from datetime import date
from pathlib import Path

import torch

from umakit.backends.torch.cpu import affine_kernel as affine, build
from umakit.backends.torch.quant import layout
from umakit.backends.torch.quant.kernels import Int4PackLinear

OUT = Path(__file__).parent / "out" / "affine_layers.md"
SHAPES = [(8960, 1536), (1536, 8960), (1536, 1536)]  # (out, in)
ROWS = (1, 4, 16, 64)
SPAN = 256 << 20  # bytes of weights each timed pass reads: past any CPU's caches
FORMS = {"float32": affine.FLOAT32, "int8, one pass": affine.INT8, "int8, two passes": affine.INT8X2}


def median_s(f, repeat: int) -> float:
    f()
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        f()
        times.append(time.perf_counter() - t)
    return sorted(times)[len(times) // 2]


def layer(rows: int, cols: int, bits: int) -> layout.QuantizedLinear:
    packed, s, b = layout.quantize(torch.randn(rows, cols) * 0.05, bits, 32)
    m = layout.QuantizedLinear(cols, rows, False, bits, 32, device="meta")
    m.weight, m.scales, m.biases = packed, s.half(), b.half()
    return m


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeat", type=int, default=30)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if not affine.available():
        raise SystemExit(f"Error: the affine kernel is not vectorized here ({build.reason() or 'no AVX2'})")
    have_int8 = affine.features() & affine.INT8_LOOPS
    isa = "AVX512-VNNI" if affine.features() & affine.VNNI else "AVX-512" if affine.features() & affine.AVX512 else "AVX2"
    big = torch.ones(64 << 20)
    bandwidth = big.numel() * 4 / median_s(big.sum, 10) / 1e9
    torch.manual_seed(0)
    lines = [f"Measured {date.today()} on {platform.machine()} ({isa} loops), {args.threads} threads, median of {args.repeat}; "
             f"a float32 sum over 256 MB reads {bandwidth:.1f} GB/s. Layers of Qwen2.5-1.5B's shapes "
             f"({', '.join(f'{o}x{i}' for o, i in SHAPES)}), groups of 32, the three summed.", "",
             "| bits | form | GB/s at 1 row | " + " | ".join(f"{r} rows (ms)" for r in ROWS) + " |",
             "|---:|---|---:|" + "---:|" * len(ROWS)]
    with torch.inference_mode():
        for bits in (4, 5, 6, 8):
            layers = [layer(o, i, bits) for o, i in SHAPES]
            kernels = [affine.AffineLinear([m]) for m in layers]
            nbytes = sum(k.codes0.nbytes + k.sb0.nbytes for k in kernels)
            copies = -(-SPAN // nbytes)
            inputs = [[torch.randn(r, i) for _, i in SHAPES] for r in ROWS]
            ways = {name: (form, kernels) for name, form in FORMS.items() if form == affine.FLOAT32 or have_int8}
            if bits == 4:
                ways["torch's int4 kernel"] = (None, [Int4PackLinear(m, torch.device("cpu")) for m in layers])
            for name, (form, mods) in ways.items():
                if form is not None:
                    affine.inputs = lambda f=form: f  # the form every AffineLinear call asks for
                many = [copy.deepcopy(mods) for _ in range(copies)]

                def run(xs, many=many):
                    for mods in many:
                        for m, x in zip(mods, xs, strict=True):
                            m(x)
                times = [median_s(lambda xs=xs: run(xs), args.repeat) / copies for xs in inputs]
                del many
                gbps = f"{nbytes / times[0] / 1e9:.1f}" if form is not None else ""
                lines.append(f"| {bits} | {name} | {gbps} | " + " | ".join(f"{t * 1e3:.2f}" for t in times) + " |")
    text = "\n".join(lines) + "\n"
    print(text)
    OUT.parent.mkdir(exist_ok=True)
    OUT.write_text(text)


if __name__ == "__main__":
    main()
