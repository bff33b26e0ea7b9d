"""CPU engines on the default model (or ``--model`` GGUF), in one run: decode, prefill, start-up, bytes per token and perplexity.

    python benchmarks/cpu_engines.py [--tokens 128] [--repeat 3] [--threads 2] [--ppl-tokens 4096] [--corpus wiki]
    python benchmarks/cpu_engines.py --model other.gguf --ppl-tokens 0 --engines torch-auto llama.cpp

Every measurement runs in a fresh process, the engines in rotation (so a
burst of load from elsewhere hits each alike), and the median of the repeats
is reported. Engines: umakit torch-CPU as ``--dtype auto`` loads it and in
each weight form (float32: dequantized once at load, exact; float16: FBGEMM's
float16 weights, float32 math; bfloat16: the packed kernels, per layer
torch's int4 kernel or umakit's affine one), umakit MLX-CPU, llama.cpp through
llama-cpp-python on the same GGUF (run by ``--llama-python``, a separate venv
built for this machine; skipped with a note when absent; ``llama.cpp-avx2``:
the same library built for AVX2 only, run by ``--llama-avx2``; ``torch-auto-avx2``: umakit's default as a CPU
with AVX2 only runs it, torch told so by ``ATEN_CPU_CAPABILITY=avx2``), and Hugging
Face transformers on the same GGUF dequantized
to float32, and mlx-lm on umakit's MLX import of the GGUF (the same 4-bit
weights, mlx-community's layout).

Columns: decode tok/s (greedy, ``--tokens`` new tokens after a short prompt),
prefill tok/s of a 512-token prompt, seconds from process start to the first
token of a one-shot generation (the import already cached; umakit's in a
process of its own, started as `umakit generate` starts it), weight bytes read
per token, the bandwidth that implies, the decode process's peak resident
memory (VmHWM: Python, the library and the model), and perplexity on the first
``--ppl-tokens`` tokens of the Austen corpus (or ``--corpus wiki``, the
Wikipedia leads), in windows of 512 each scored from its second token (one
scoring for every engine, so llama.cpp's is comparable), as a change from umakit's float32 path, twice: as a prompt is
read (all of a window in one forward pass) and as a reply is made (one decode
step per token, the step `generate` runs: on torch-CPU the fused C++ step).
MLX engines are not scored by default (``--ppl-mlx``: about 9 minutes each on
MLX-CPU). Prints a markdown table and writes it to benchmarks/out/cpu_engines.md.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

PROMPT = "The history of the English novel begins"
LONG = "It is a truth universally acknowledged, that a single man in possession of a good fortune, must be in want of a wife. "
WINDOW = 512
OUT = Path(__file__).parent / "out" / "cpu_engines.md"
UMAKIT = {"torch-auto": ("torch", "auto"), "torch-float32": ("torch", "float32"),
          "torch-float16": ("torch", "float16"), "torch-bfloat16": ("torch", "bfloat16"), "mlx": ("mlx", "float32"),
          "torch-auto-avx2": ("torch", "auto"),
          "auto": ("auto", "auto")}  # umakit's own pick for the model (an architecture the torch engine's compact
# code lacks: the transformers engine)
# engines run as on a CPU with AVX2 only: torch dispatches, and umakit's C++ is built, for AVX2 (FBGEMM, which
# reads the CPU itself, keeps its AVX-512 code)
AS_AVX2 = {"ATEN_CPU_CAPABILITY": "avx2"}
ENV_OF = {"torch-auto-avx2": AS_AVX2}
ENGINES = (*UMAKIT, "llama.cpp", "llama.cpp-avx2", "hf", "mlx-lm")
# llama-cpp-python built for this machine (GGML_NATIVE=ON), in a venv of its own: $LLAMA_PYTHON, or where the
# peers are usually built
LLAMA_PYTHON = os.environ.get("LLAMA_PYTHON") or str(Path.home() / ".cache" / "umakit-peers" / "venv" / "bin" / "python")
# the same llama-cpp-python built for AVX2 only (GGML_NATIVE=OFF GGML_AVX2=ON GGML_AVX512=OFF), to label a row so
LLAMA_AVX2 = os.environ.get("LLAMA_AVX2") or str(Path.home() / ".cache" / "umakit-peers-avx2" / "venv" / "bin" / "python")


# -- workers: each runs in its own process and prints one JSON line ---------------
def nll_of_windows(ids: list[int], logits_of) -> float:
    """Mean negative log-likelihood of ``ids`` in windows of WINDOW, each scored from its second token."""
    import numpy as np

    total, count = 0.0, 0
    for i in range(0, len(ids) - 1, WINDOW):
        chunk = ids[i:i + WINDOW]
        if len(chunk) < 2:
            break
        z = np.asarray(logits_of(chunk), dtype=np.float64)[:-1]  # (n-1, V): predictions of chunk[1:]
        z = z - z.max(axis=-1, keepdims=True)
        logp = z[np.arange(len(chunk) - 1), chunk[1:]] - np.log(np.exp(z).sum(axis=-1))
        total, count = total - logp.sum(), count + len(chunk) - 1
    return total / count


def stepwise(logits_of_one, chunk: list[int]):
    """Logits (n, V) of ``chunk`` fed one decode step at a time; ``logits_of_one(token, first)``."""
    import numpy as np

    return np.stack([np.asarray(logits_of_one(t, i == 0), dtype=np.float32).reshape(-1) for i, t in enumerate(chunk)])


def peak_rss() -> int:
    """This process's peak resident bytes: VmHWM, which an exec resets (getrusage's ru_maxrss keeps the parent's)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def worker_first_token(args, t0: float) -> dict:
    """Start to first token as `umakit generate` starts (threads from OMP_NUM_THREADS, which run_worker sets)."""
    import umakit
    from umakit.generate.sampling import SamplingParams

    backend, dtype = UMAKIT[args.worker]
    model = umakit.load(args.mlx_path, backend=backend, device="cpu", dtype=dtype)
    engine = model.engine
    stream = engine.generate_tokens(model.tokenizer.encode(PROMPT), engine.make_cache(), SamplingParams(temperature=0))
    next(stream)
    return dict(first=time.time() - t0)


def worker_umakit(args, t0: float) -> dict:
    import torch

    torch.set_num_threads(args.threads)
    import umakit
    from umakit.generate.sampling import SamplingParams

    backend, dtype = UMAKIT[args.worker]
    model = umakit.load(args.mlx_path, backend=backend, device="cpu", dtype=dtype)
    engine = model.engine
    ids = model.tokenizer.encode(PROMPT)
    stream = engine.generate_tokens(ids, engine.make_cache(), SamplingParams(temperature=0))
    next(stream)
    first = time.time() - t0
    t = time.perf_counter()
    for _ in range(args.tokens):
        next(stream)
    decode = args.tokens / (time.perf_counter() - t)
    stream.close()
    long = model.tokenizer.encode(LONG * 60)[:WINDOW]
    t = time.perf_counter()
    engine.prefill(long, engine.make_cache())
    prefill = len(long) / (time.perf_counter() - t)
    out = dict(first=first, decode=decode, prefill=prefill, bytes=model.info.weights.bytes_per_token,
               weights=f"{model.info.weights.quantization}; {model.info.dtype}")
    if args.ppl and (backend != "mlx" or args.ppl_mlx):
        ids = json.loads(Path(args.ppl).read_text())
        out["nll"] = nll_of_windows(ids, engine.logits)
        caches = []

        def one(token, first):
            if first:
                caches[:] = [engine.make_cache()]
            return engine.logits([token], caches[0])

        out["nll_step"] = nll_of_windows(ids, lambda chunk: stepwise(one, chunk))
    return out


def worker_llama(args, t0: float) -> dict:
    from llama_cpp import Llama

    llm = Llama(args.gguf, n_threads=args.threads, n_threads_batch=args.threads, n_ctx=1024, n_batch=WINDOW,
                logits_all=bool(args.ppl), verbose=False)
    llm.eval(llm.tokenize(PROMPT.encode()))
    tok = llm.sample(top_k=1, temp=0)
    first = time.time() - t0
    t = time.perf_counter()
    for _ in range(args.tokens):
        llm.eval([tok])
        tok = llm.sample(top_k=1, temp=0)
    decode = args.tokens / (time.perf_counter() - t)
    long = llm.tokenize((LONG * 60).encode())[:WINDOW]
    llm.reset()
    t = time.perf_counter()
    llm.eval(long)
    prefill = len(long) / (time.perf_counter() - t)
    out = dict(first=first, decode=decode, prefill=prefill, bytes=os.path.getsize(args.gguf),
               weights="the GGUF as is")
    if args.ppl:
        def logits_of(chunk):
            llm.reset()
            llm.eval(chunk)
            return llm.scores[:len(chunk)]

        ids = json.loads(Path(args.ppl).read_text())
        out["nll"] = nll_of_windows(ids, logits_of)

        def one(token, first):
            if first:
                llm.reset()
            llm.eval([token])
            return llm.scores[llm.n_tokens - 1]

        out["nll_step"] = nll_of_windows(ids, lambda chunk: stepwise(one, chunk))
    return out


def worker_hf(args, t0: float) -> dict:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(args.threads)
    gguf = Path(args.gguf)
    hf = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    greedy = dict(do_sample=False, temperature=None, top_p=None, top_k=None, pad_token_id=0)
    x = torch.tensor([tok.encode(PROMPT)])
    with torch.inference_mode():
        hf.generate(x, max_new_tokens=1, min_new_tokens=1, **greedy)
        first = time.time() - t0
        t = time.perf_counter()
        hf.generate(x, max_new_tokens=1, min_new_tokens=1, **greedy)
        one = time.perf_counter() - t
        t = time.perf_counter()
        hf.generate(x, max_new_tokens=args.tokens + 1, min_new_tokens=args.tokens + 1, **greedy)
        decode = args.tokens / (time.perf_counter() - t - one)
        long = torch.tensor([tok.encode(LONG * 60)[:WINDOW]])
        t = time.perf_counter()
        hf(long)
        prefill = long.shape[1] / (time.perf_counter() - t)
        out = dict(first=first, decode=decode, prefill=prefill, bytes=4 * hf.num_parameters(),
                   weights="GGUF dequantized to float32")
        if args.ppl:
            out["nll"] = nll_of_windows(json.loads(Path(args.ppl).read_text()),
                                        lambda c: hf(torch.tensor([c])).logits[0].float().numpy())
    return out


def worker_mlx_lm(args, t0: float) -> dict:
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm import load, stream_generate
    from mlx_lm.sample_utils import make_sampler

    model, tok = load(args.mlx_path)
    greedy = make_sampler(temp=0.0)
    stream = stream_generate(model, tok, PROMPT, max_tokens=args.tokens + 1, sampler=greedy)
    next(stream)
    first = time.time() - t0
    last = None
    for last in stream:
        pass
    long = tok.encode(LONG * 60)[:WINDOW]
    done = None
    for done in stream_generate(model, tok, long, max_tokens=1, sampler=greedy):
        pass
    out = dict(first=first, decode=last.generation_tps, prefill=done.prompt_tps,
               bytes=sum(v.nbytes for _, v in tree_flatten(model.parameters())), weights="umakit's MLX import, 4-bit")
    if args.ppl and args.ppl_mlx:
        import numpy as np

        out["nll"] = nll_of_windows(json.loads(Path(args.ppl).read_text()),
                                    lambda c: np.array(model(mx.array([c]))[0].astype(mx.float32)))
    return out


# -- the driver ----------------------------------------------------------------------
def run_worker(engine: str, args, gguf: str, ppl: str | None, first_only: bool = False) -> dict | None:
    python = {"llama.cpp": args.llama_python, "llama.cpp-avx2": args.llama_avx2}.get(engine, sys.executable)
    cmd = [python, __file__, "--worker", engine, "--tokens", str(args.tokens), "--threads", str(args.threads),
           "--gguf", gguf, "--mlx-path", args.mlx_path or "", "--t0", repr(time.time())]
    cmd += (["--ppl", ppl] if ppl else []) + (["--ppl-mlx"] if args.ppl_mlx else [])
    cmd += ["--first-only"] if first_only else []
    # as installed packages start: compiled modules cached (pip compiles them at install; this shell may not)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    env.update(ENV_OF.get(engine, {}), OMP_NUM_THREADS=str(args.threads))
    done = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if done.returncode:
        print(f"  {engine} failed:\n{done.stderr[-2000:]}", file=sys.stderr)
        return None
    out = json.loads(done.stdout.strip().splitlines()[-1])
    if engine in UMAKIT and not first_only:  # the start as `umakit generate` makes it, in a process of its own
        start = run_worker(engine, args, gguf, None, first_only=True)
        out["first_whole_engine"], out["first"] = out["first"], start["first"] if start else float("nan")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=128, help="new tokens per decode run")
    ap.add_argument("--repeat", type=int, default=3, help="runs per engine, in rotation (the median is reported)")
    ap.add_argument("--threads", type=int, default=os.cpu_count(), help="threads of every engine")
    ap.add_argument("--ppl-tokens", type=int, default=4096, help="Austen tokens scored (0: no perplexity)")
    ap.add_argument("--corpus", default="austen", choices=("austen", "wiki"), help="the text perplexity is scored on")
    ap.add_argument("--ppl-mlx", action="store_true", help="score the MLX engines' perplexity too (slow on CPU)")
    ap.add_argument("--engines", nargs="*", default=list(ENGINES), choices=ENGINES)
    ap.add_argument("--llama-python", default=LLAMA_PYTHON, help="a python with llama-cpp-python installed")
    ap.add_argument("--llama-avx2", default=LLAMA_AVX2,
                    help="a python with llama-cpp-python built for AVX2 only (engine llama.cpp-avx2)")
    ap.add_argument("--model", help="a GGUF to measure instead of the built-in one (imported once, outside the "
                                    "timings; perplexity means little on random weights: --ppl-tokens 0)")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--gguf", help=argparse.SUPPRESS)
    ap.add_argument("--t0", type=float, help=argparse.SUPPRESS)
    ap.add_argument("--ppl", help=argparse.SUPPRESS)
    ap.add_argument("--mlx-path", help=argparse.SUPPRESS)
    ap.add_argument("--first-only", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        fn = {"llama.cpp": worker_llama, "llama.cpp-avx2": worker_llama, "hf": worker_hf,
              "mlx-lm": worker_mlx_lm}.get(args.worker, worker_umakit)
        fn = worker_first_token if args.first_only else fn
        out = fn(args, args.t0)
        out["peak"] = peak_rss()
        print(json.dumps(out))
        return

    import umakit
    from umakit.evaluate.corpora import load_corpus
    notes = []
    from umakit.checkpoint.default import packaged_gguf

    # the import (umakit's and mlx-lm's input), made on first use, outside the timings
    args.mlx_path = str(umakit.resolve_model(args.model))
    gguf = args.model or str(packaged_gguf())
    from umakit.backends.torch.cpu import build

    if not build.ensure():  # built once per machine, outside the timed start-ups
        notes.append(f"the fused CPU decode step is off ({build.reason()}): torch-CPU decodes eagerly")
    if "torch-auto-avx2" in args.engines:  # and its AVX2 build
        subprocess.run([sys.executable, "-c", "from umakit.backends.torch.cpu import build; build.ensure()"],
                       env={**os.environ, **AS_AVX2}, check=True)
    engines = list(args.engines)
    for engine, python in (("llama.cpp", args.llama_python), ("llama.cpp-avx2", args.llama_avx2)):
        if engine in engines and not Path(python).exists():
            engines.remove(engine)
            notes.append(f"{engine} skipped: no {python} (../shared/tools/build_llama_peers.sh builds the native one)")
    with tempfile.TemporaryDirectory() as tmp:
        ppl = None
        if args.ppl_tokens:
            tokenizer = umakit.load(args.mlx_path, device="cpu", dtype="float32").tokenizer
            ids = tokenizer.encode(load_corpus(args.corpus))[:args.ppl_tokens]
            ppl = str(Path(tmp) / "ids.json")
            Path(ppl).write_text(json.dumps(ids))
        load_before = os.getloadavg()
        runs: dict[str, list[dict]] = {e: [] for e in engines}
        for r in range(args.repeat):
            for e in engines:  # perplexity is deterministic: scored in the first round only
                out = run_worker(e, args, gguf, ppl if r == 0 else None)
                if out:
                    runs[e].append(out)
                    print(f"  {e}: decode {out['decode']:.1f} tok/s, prefill {out['prefill']:.0f} tok/s, "
                          f"first token {out['first']:.2f} s", file=sys.stderr)
        load_after = os.getloadavg()
    table = render(runs, args, Path(gguf).name, load_before, load_after, notes)
    print(table)
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(table + "\n")


def render(runs: dict[str, list[dict]], args, model: str, load_before, load_after, notes: list[str]) -> str:
    ref = next((rs[0] for e, rs in runs.items() if e == "torch-float32" and rs), {})
    lines = [
        f"CPU engines on {model}, {time.strftime('%Y-%m-%d')}: "
        f"{args.tokens} new tokens greedy, median of {args.repeat} runs, each in its own process, in rotation; "
        f"{args.threads} threads each.",
        f"Machine: {platform.machine()} {platform.processor() or ''}, {os.cpu_count()} CPUs, load average "
        f"{load_before[0]:.1f} before / {load_after[0]:.1f} after (1-minute).",
        *notes,
        "",
        "| engine | weights | decode tok/s | prefill tok/s (512) | start to first token s | MB read/token | "
        f"GB/s | peak RSS MB | perplexity ({args.corpus}), prompt | vs float32 | perplexity, decode steps | "
        "vs float32 |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for e, rs in runs.items():
        if not rs:
            lines.append(f"| {e} | failed | | | | | | | | | | |")
            continue
        med = {k: statistics.median(r[k] for r in rs) for k in ("decode", "prefill", "first", "bytes", "peak")}
        cells = []
        for key in ("nll", "nll_step"):
            nll, base = rs[0].get(key), ref.get(key)
            cells.append(f"{math.exp(nll):.3f}" if nll is not None else "n/a")
            cells.append(f"{100 * (math.exp(nll - base) - 1):+.2f}%" if nll is not None and base is not None else "n/a")
        lines.append(f"| {e} | {rs[0]['weights']} | {med['decode']:.1f} | {med['prefill']:.0f} | {med['first']:.2f} | "
                     f"{med['bytes'] / 1e6:.0f} | {med['bytes'] * med['decode'] / 1e9:.1f} | {med['peak'] / 1e6:.0f} | "
                     f"{' | '.join(cells)} |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
