"""Decode speed of the default model against this machine's bandwidth roofline.

    python benchmarks/roofline_table.py [--prompt-tokens 64 --gen-tokens 64 --repeat 3]

One run on the current machine, float and quantized variants of the built-in
SmolLM2-135M: decode tok/s, bytes read per token, achieved GB/s and MBU
(achieved / peak). Peak is the table's published figure on Apple and NVIDIA
chips and the cached streaming-read probe on a CPU. Writes a markdown table to
stdout and benchmarks/out/roofline.md.
"""

from __future__ import annotations

import argparse
import platform
from pathlib import Path


def variants():
    """(label, loader) pairs; each loader returns a loaded `umakit.Model`."""
    import dataclasses

    import umakit
    from umakit.backends import resolve

    def mlx(dequantize: bool):
        def load():
            m = umakit.load(None, backend="mlx")
            if dequantize:
                from umakit.quantize import dequantize_model

                dequantize_model(m.engine.model)
                m.engine.quantization = None
                # the bytes a step reads are measured from the weights as they now are
                m.info = dataclasses.replace(m.info, weights=m.engine.weight_info())
            return m
        return load

    def torch(dtype: str):
        return lambda: umakit.load(None, backend="torch", device="cpu", dtype=dtype)

    out = [("mlx-CPU, 4-bit g32 (Q4_1 import, 8-bit embeddings), float32 math", mlx(False)),
           ("mlx-CPU, dequantized to float32", mlx(True))]
    if resolve("auto")[0] == "torch":
        out += [("torch-CPU, dequantized to float32", torch("float32")),
                ("torch-CPU, float16 weights, float32 math (auto)", torch("float16")),
                ("torch-CPU, int4 kernels, bfloat16 math", torch("bfloat16"))]
    return out


def main() -> None:
    from umakit.bench import BenchSettings, run_bench

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompt-tokens", type=int, default=64)
    ap.add_argument("--gen-tokens", type=int, default=64)
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    settings = BenchSettings(prompt_tokens=args.prompt_tokens, gen_tokens=args.gen_tokens, repeat=args.repeat)
    rows, device = [], None
    for label, load in variants():
        model = load()
        device = model.device_info
        rec = run_bench(model, settings).to_dict()
        s = rec["summary"]
        rows.append(f"| {label} | {s['bytes_per_token']['median'] / 1e6:.0f} MB | {s['decode_tps']['median']:.1f} "
                    f"| {s['achieved_gbps']['median']:.2f} | {100 * s['mbu']['median']:.1f}% "
                    f"| {device.peak_bandwidth_gbps * 1e9 / s['bytes_per_token']['median']:.0f} "
                    f"| {s['prefill_tps']['median']:.0f} |")
        print(rows[-1], flush=True)
    lines = [
        f"Default model, {args.prompt_tokens}-token prompt, {args.gen_tokens} greedy tokens, median of {args.repeat}; "
        f"{platform.machine()} {platform.system()}, peak {device.peak_bandwidth_gbps:.1f} GB/s "
        f"({device.name}, {device.bandwidth_source}).",
        "",
        "| engine and weights | bytes/token | decode tok/s | achieved GB/s | MBU | ceiling tok/s | prefill tok/s |",
        "|---|---:|---:|---:|---:|---:|---:|",
        *rows,
    ]
    out = Path(__file__).parent / "out" / "roofline.md"
    out.parent.mkdir(exist_ok=True)
    out.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
