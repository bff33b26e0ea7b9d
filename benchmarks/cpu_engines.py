"""CPU engines on the default model, in one run: decode, prefill, start-up, bytes per token and perplexity.

    python benchmarks/cpu_engines.py [--tokens 128] [--repeat 3] [--threads 2] [--ppl-tokens 4096]

Every measurement runs in a fresh process, the engines in rotation (so a
burst of load from elsewhere hits each alike), and the median of the repeats
is reported. Engines: umakit torch-CPU as ``--dtype auto`` loads it and in
each weight form (float32: dequantized once at load, exact; float16: FBGEMM's
float16 weights, float32 math; bfloat16: torch's int4 kernels on an exact
repack, bfloat16 inputs), umakit MLX-CPU, llama.cpp through llama-cpp-python
on the same GGUF (run by ``--llama-python``, a separate venv; skipped with a
note when absent), and Hugging Face transformers on the same GGUF dequantized
to float32.

Columns: decode tok/s (greedy, ``--tokens`` new tokens after a short prompt),
prefill tok/s of a 512-token prompt, seconds from process start to the first
token of a one-shot generation (the import already cached), weight bytes read
per token, the bandwidth that implies, and perplexity on the first
``--ppl-tokens`` tokens of the Austen corpus, in windows of 512 each scored
from its second token (one scoring for every engine, so llama.cpp's is
comparable), as a change from umakit's float32 path. Prints a markdown table
and writes it to benchmarks/out/cpu_engines.md.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
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
          "torch-float16": ("torch", "float16"), "torch-bfloat16": ("torch", "bfloat16"), "mlx": ("mlx", "float32")}
ENGINES = (*UMAKIT, "llama.cpp", "hf")
LLAMA_PYTHON = "/work/llama-venv/bin/python"


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


def worker_umakit(args, t0: float) -> dict:
    import torch

    torch.set_num_threads(args.threads)
    import umakit
    from umakit.sampling import SamplingParams

    backend, dtype = UMAKIT[args.worker]
    model = umakit.load(None, backend=backend, device="cpu", dtype=dtype)
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
    if args.ppl:
        out["nll"] = nll_of_windows(json.loads(Path(args.ppl).read_text()), engine.logits)
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

        out["nll"] = nll_of_windows(json.loads(Path(args.ppl).read_text()), logits_of)
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


# -- the driver ----------------------------------------------------------------------
def run_worker(engine: str, args, gguf: str, ppl: str | None) -> dict | None:
    python = args.llama_python if engine == "llama.cpp" else sys.executable
    cmd = [python, __file__, "--worker", engine, "--tokens", str(args.tokens), "--threads", str(args.threads),
           "--gguf", gguf, "--t0", repr(time.time())] + (["--ppl", ppl] if ppl else [])
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode:
        print(f"  {engine} failed:\n{done.stderr[-2000:]}", file=sys.stderr)
        return None
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=128, help="new tokens per decode run")
    ap.add_argument("--repeat", type=int, default=3, help="runs per engine, in rotation (the median is reported)")
    ap.add_argument("--threads", type=int, default=os.cpu_count(), help="threads of every engine")
    ap.add_argument("--ppl-tokens", type=int, default=4096, help="Austen tokens scored (0: no perplexity)")
    ap.add_argument("--engines", nargs="*", default=list(ENGINES), choices=ENGINES)
    ap.add_argument("--llama-python", default=LLAMA_PYTHON, help="a python with llama-cpp-python installed")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--gguf", help=argparse.SUPPRESS)
    ap.add_argument("--t0", type=float, help=argparse.SUPPRESS)
    ap.add_argument("--ppl", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        fn = worker_llama if args.worker == "llama.cpp" else worker_hf if args.worker == "hf" else worker_umakit
        print(json.dumps(fn(args, args.t0)))
        return

    import umakit
    from umakit.corpora import load_corpus
    from umakit.default_model import packaged_gguf

    umakit.resolve_model(None)  # imports the packaged GGUF on first use, outside the timed start-ups
    gguf = str(packaged_gguf())
    notes = []
    engines = list(args.engines)
    if "llama.cpp" in engines and not Path(args.llama_python).exists():
        engines.remove("llama.cpp")
        notes.append(f"llama.cpp skipped: no {args.llama_python} (see the issue's build line for llama-cpp-python)")
    with tempfile.TemporaryDirectory() as tmp:
        ppl = None
        if args.ppl_tokens:
            tokenizer = umakit.load(None, backend="torch", device="cpu", dtype="float32").tokenizer
            ids = tokenizer.encode(load_corpus("austen"))[:args.ppl_tokens]
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
    table = render(runs, args, load_before, load_after, notes)
    print(table)
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(table + "\n")


def render(runs: dict[str, list[dict]], args, load_before, load_after, notes: list[str]) -> str:
    ref = next((rs[0].get("nll") for e, rs in runs.items() if e == "torch-float32" and rs), None)
    lines = [
        f"CPU engines on the default model (SmolLM2-135M-Instruct Q4_1 GGUF), {time.strftime('%Y-%m-%d')}: "
        f"{args.tokens} new tokens greedy, median of {args.repeat} runs, each in its own process, in rotation; "
        f"{args.threads} threads each.",
        f"Machine: {platform.machine()} {platform.processor() or ''}, {os.cpu_count()} CPUs, load average "
        f"{load_before[0]:.1f} before / {load_after[0]:.1f} after (1-minute).",
        *notes,
        "",
        "| engine | weights | decode tok/s | prefill tok/s (512) | start to first token s | MB read/token | "
        "GB/s | perplexity (Austen) | vs float32 |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for e, rs in runs.items():
        if not rs:
            lines.append(f"| {e} | failed | | | | | | | |")
            continue
        med = {k: statistics.median(r[k] for r in rs) for k in ("decode", "prefill", "first", "bytes")}
        nll = rs[0].get("nll")
        ppl = f"{math.exp(nll):.3f}" if nll is not None else "n/a"
        delta = f"{100 * (math.exp(nll - ref) - 1):+.2f}%" if nll is not None and ref is not None else "n/a"
        lines.append(f"| {e} | {rs[0]['weights']} | {med['decode']:.1f} | {med['prefill']:.0f} | {med['first']:.2f} | "
                     f"{med['bytes'] / 1e6:.0f} | {med['bytes'] * med['decode'] / 1e9:.1f} | {ppl} | {delta} |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
