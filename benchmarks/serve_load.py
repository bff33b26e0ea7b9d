"""Serving throughput and latency against peer servers, on the default model, in one run.

    python benchmarks/serve_load.py [--levels 1,2,4,8,16] [--max-tokens 48] [--prompt-tokens 256]
        [--shared-prefix 1000] [--requests 2] [--llama-server PATH] [--llama-python PATH] [--skip-mlx]
        [--step-tokens 32,48] [--steps separate,mixed,deterministic]

Starts each server in turn on 127.0.0.1 (umakit serve; mlx-lm's server on the
same imported weights; llama.cpp's own llama-server on the same GGUF, built
for this machine by ../shared/tools/build_llama_peers.sh from the llama.cpp
sources in llama-cpp-python's sdist (`cmake --build ... --target
llama-server`, GGML_NATIVE=ON), skipped with a note where it is absent; and
llama-cpp-python's server when a Python with `llama_cpp.server` is given),
then at each concurrency level runs that many clients, each sending
--requests streaming chat requests (greedy, at most --max-tokens tokens) one
after the other; a request that fails is counted as failed, never retried.

With --prompt-tokens N each request's message is its own N-token slice of
Jane Austen's novels (`umakit corpora fetch austen`), as llama-benchy sends;
without it, a short question. --shared-prefix N puts the same N-token system
prompt before every request (a few-shot header, an agent's instructions): a
server that shares its prompt cache across requests prefills it once, and
umakit's /metrics say how many prompt tokens came from the cache.

Reports aggregate completion tok/s (streamed chunks over the level's wall
time), prefill tok/s (each request's prompt tokens over its time to first
token, averaged), p50/p95 time to first token and inter-token latency. One
server runs at a time: this is a 2-core machine. Prints a markdown table and
writes it to benchmarks/out/serve_load.md.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

import umakit
from umakit.checkpoint.default import packaged_gguf

OUT = Path(__file__).parent / "out" / "serve_load.md"
LLAMA_SERVER = Path.home() / ".cache" / "umakit-peers" / "bin" / "llama-server"  # where build_llama_peers.sh puts it
QUESTIONS = [
    "What is the capital of France?", "Name three primary colours.", "Why is the sky blue?",
    "Give me a synonym for happy.", "What is 12 times 12?", "Write a haiku about rain.",
    "Who wrote Pride and Prejudice?", "What does a CPU do?", "How many legs does a spider have?",
    "Suggest a name for a cat.", "What is photosynthesis?", "Translate 'good morning' to French.",
    "What is the boiling point of water?", "Describe a rainbow in one sentence.", "What is an atom?",
    "List two uses of copper.",
]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_ready(url: str, proc: subprocess.Popen, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode}")
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"{url} did not answer in {timeout:.0f} s")


def served_model(base: str) -> str:
    """The id /v1/models lists; mlx-lm's server lists Hub caches there and answers "default_model" to any."""
    try:
        return httpx.get(f"{base}/v1/models", timeout=30).json()["data"][0]["id"]
    except (ValueError, KeyError, IndexError, httpx.HTTPError):
        return "default_model"


class Prompts:
    """What each request sends: a short question, or its own slice of Austen of about ``tokens`` tokens, after a
    shared system prompt of about ``shared`` tokens (0: none)."""

    def __init__(self, tokens: int, shared: int):
        self.tokens, self.system = tokens, None
        if not tokens and not shared:
            return
        from umakit.evaluate.corpora import fetch

        words = fetch("austen").read_text(encoding="utf-8").split()
        tok = umakit.load(backend="torch").tokenizer
        per_word = len(tok.encode(" ".join(words[:2000]), add_special_tokens=False)) / 2000
        self.words, self.per_word = words, per_word
        if shared:
            self.system = "Answer in the voice of the narrator. " + " ".join(words[-int(shared / per_word):])

    def messages(self, k: int) -> list[dict]:
        if not self.tokens:
            user = QUESTIONS[k % len(QUESTIONS)]
        else:
            n = int(self.tokens / self.per_word)
            user = "Continue this passage: " + " ".join(self.words[k * n:(k + 1) * n])
        return ([{"role": "system", "content": self.system}] if self.system else []) + \
            [{"role": "user", "content": user}]


def one_request(base: str, model: str, messages: list[dict], max_tokens: int) -> tuple[float, list[float], int]:
    """(time to first token, inter-token gaps, chunks) of one streaming chat request."""
    body = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0, "stream": True}
    t0 = time.perf_counter()
    times = []
    with httpx.stream("POST", f"{base}/v1/chat/completions", json=body, timeout=600) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            choices = chunk.get("choices") or []
            if choices and (choices[0].get("delta") or {}).get("content"):
                times.append(time.perf_counter())
    if not times:
        return time.perf_counter() - t0, [], 0
    return times[0] - t0, [b - a for a, b in zip(times, times[1:])], len(times)


def level(base: str, model: str, clients: int, max_tokens: int, prompts: Prompts, requests: int,
          counted: dict) -> dict:
    ttfts, gaps, chunks, failed, prefill = [], [], [], [], []
    lock = threading.Lock()

    def client(k: int) -> None:
        for j in range(requests):
            messages = prompts.messages(counted["next"] + requests * k + j)  # never a prompt sent before
            try:
                t, g, n = one_request(base, model, messages, max_tokens)
            except httpx.HTTPError as e:  # counted, never hidden: a server that drops requests says so in the table
                with lock:
                    failed.append(type(e).__name__)
                continue
            with lock:
                ttfts.append(t)
                gaps.extend(g)
                chunks.append(n)
                if prompts.tokens and t > 0:
                    prefill.append(prompts.tokens / t)

    t0 = time.perf_counter()
    counted["next"] += clients * requests
    threads = [threading.Thread(target=client, args=(k,)) for k in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    q = lambda xs, p: statistics.quantiles(xs, n=20)[int(p * 20) - 1] if len(xs) >= 2 else (xs[0] if xs else 0.0)  # noqa: E731
    if not ttfts:
        return {"clients": clients, "requests": 0, "failed": len(failed), "tokens": 0, "tps": 0.0, "ttft_p50": 0.0,
                "ttft_p95": 0.0, "itl_p50": 0.0, "itl_p95": 0.0, "prefill_tps": 0.0}
    return {"clients": clients, "requests": len(chunks), "failed": len(failed), "tokens": sum(chunks),
            "tps": sum(chunks) / wall, "prefill_tps": statistics.mean(prefill) if prefill else 0.0,
            "ttft_p50": statistics.median(ttfts), "ttft_p95": q(ttfts, 0.95),
            "itl_p50": statistics.median(gaps) if gaps else 0.0, "itl_p95": q(gaps, 0.95)}


def run_server(name: str, cmd: list[str], health: str, levels, max_tokens: int, prompts: Prompts,
               requests: int) -> list:
    port = free_port()
    cmd = [c.replace("{port}", str(port)) for c in cmd]
    base = f"http://127.0.0.1:{port}"
    print(f"starting {name}: {' '.join(cmd)}", file=sys.stderr)
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_ready(base + health, proc)
        model_id = served_model(base)
        if name.startswith("umakit") and "--step-tokens" not in cmd:  # the budget it measured at start
            name += f", step budget {int(umakit_metrics(base).get('umakit_step_tokens', 0))} (measured)"
        counted = {"next": 1}
        one_request(base, model_id, prompts.messages(0), 8)  # warm up (and, with a shared prefix, cache it)
        rows = []
        for c in levels:
            row = {"server": name, **level(base, model_id, c, max_tokens, prompts, requests, counted)}
            if name.startswith("umakit"):
                row["cached_share"] = cached_share(base)
            print(f"  {name} x{c}: {row['tps']:.1f} tok/s, prefill {row['prefill_tps']:.0f} tok/s", file=sys.stderr)
            rows.append(row)
        return rows
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()


def umakit_metrics(base: str) -> dict[str, float]:
    """umakit's server's /metrics figures (empty where it does not answer)."""
    try:
        text = httpx.get(f"{base}/metrics", timeout=10).text
    except httpx.HTTPError:
        return {}
    return {line.split()[0]: float(line.split()[1]) for line in text.splitlines()
            if line.startswith("umakit_") and len(line.split()) == 2}


def cached_share(base: str) -> float | None:
    """The share of prompt tokens umakit's server took from its prompt cache so far (its /metrics)."""
    values = umakit_metrics(base)
    prompt, cached = values.get("umakit_prompt_tokens_total"), values.get("umakit_cached_tokens_total")
    return cached / prompt if prompt and cached is not None else None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--levels", default="1,2,4,8,16")
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--llama-python", default=os.environ.get("LLAMA_PYTHON"),
                    help="A Python with llama-cpp-python[server] installed (a separate venv).")
    ap.add_argument("--skip-mlx", action="store_true")
    ap.add_argument("--prompt-tokens", type=int, default=0, help="each request its own N-token slice of Austen")
    ap.add_argument("--shared-prefix", type=int, default=0, help="an N-token system prompt shared by every request")
    ap.add_argument("--requests", type=int, default=2, help="requests each client sends, one after the other")
    ap.add_argument("--llama-server", default=str(LLAMA_SERVER))
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--skip-umakit", action="store_true")
    ap.add_argument("--model", type=Path, help="a GGUF to serve instead of the built-in model (both servers)")
    ap.add_argument("--step-tokens", default="", help="comma-separated --step-tokens values: umakit once with each")
    ap.add_argument("--steps", default="", help="comma-separated 'separate', 'mixed' and 'deterministic': umakit "
                                                "once with each of --separate-steps, --mixed-steps and "
                                                "--deterministic (default: none of them)")
    args = ap.parse_args()
    levels = [int(x) for x in args.levels.split(",")]
    prompts = Prompts(args.prompt_tokens, args.shared_prefix)
    # the imported default model, as mlx-lm reads it too; or a GGUF of the user's, which umakit serve imports
    path = str(args.model.resolve()) if args.model else str(umakit.resolve_model(None))
    notes, rows = [], []
    top = max(levels)
    runs = [(step, how) for step in (args.step_tokens.split(",") if args.step_tokens else [""])
            for how in (args.steps.split(",") if args.steps else [""])]
    for step, how in ([] if args.skip_umakit else runs):
        flags = (["--step-tokens", step] if step else []) + (
            ["--deterministic"] if how == "deterministic" else [f"--{how}-steps"] if how else [])
        rows += run_server(" ".join(["umakit serve (torch-CPU)" + ("," if flags else ""), *flags]),
                           [sys.executable, "-m", "umakit.cli.main", "serve", path, "--port", "{port}",
                            "--max-concurrency", str(max(top, 16)), *flags],
                           "/health", levels, args.max_tokens, prompts, args.requests)
    if args.model and not args.skip_mlx:
        notes.append("mlx-lm's server was not run: it does not read a GGUF file.")
    elif not args.skip_mlx:
        rows += run_server("mlx_lm.server (MLX-CPU)", [sys.executable, "-m", "mlx_lm", "server", "--model", path,
                                                       "--port", "{port}", "--decode-concurrency", "16"],
                           "/health", levels, args.max_tokens, prompts, args.requests)
    gguf = args.model.resolve() if args.model else packaged_gguf()
    if Path(args.llama_server).exists():
        per_slot = args.prompt_tokens + args.shared_prefix + args.max_tokens + 256
        rows += run_server("llama-server (llama.cpp, native)",
                           [args.llama_server, "-m", str(gguf), "--port", "{port}", "-np", str(top), "-t",
                            str(args.threads), "-c", str(top * per_slot)],
                           "/health", levels, args.max_tokens, prompts, args.requests)
    else:
        notes.append(f"llama-server was not run: none at {args.llama_server} (build it with "
                     "../shared/tools/build_llama_peers.sh).")
    if args.llama_python:
        rows += run_server("llama-cpp-python server", [args.llama_python, "-m", "llama_cpp.server", "--model",
                                                       str(gguf), "--port", "{port}", "--n_ctx", "4096",
                                                       # queue concurrent requests: by default a new one aborts the
                                                       # stream in progress
                                                       "--interrupt_requests", "False"],
                           "/v1/models", levels, args.max_tokens, prompts, args.requests)
    else:
        notes.append("llama-cpp-python's server was not run: no --llama-python given (it needs its own venv; see "
                     "benchmarks/cpu_engines.py for the build flags that work on these VMs).")
    what = (f"each request its own {args.prompt_tokens}-token slice of Austen" if args.prompt_tokens
            else "short questions") + (f" after a shared {args.shared_prefix}-token system prompt"
                                       if args.shared_prefix else "")
    lines = [f"Serving load on {args.model.name if args.model else 'the default model'}, {time.strftime('%Y-%m-%d')}, 127.0.0.1, streaming chat requests "
             f"(greedy, at most {args.max_tokens} tokens), {what}, each client sending {args.requests} in a row; "
             f"{args.threads} threads.", "",
             "| server | clients | requests | failed | tokens | aggregate tok/s | prefill tok/s | TTFT p50 (s) | "
             "TTFT p95 (s) | ITL p50 (ms) | ITL p95 (ms) | prompt tokens from the cache |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        share = r.get("cached_share")
        lines.append(f"| {r['server']} | {r['clients']} | {r['requests']} | {r['failed']} | {r['tokens']} | "
                     f"{r['tps']:.1f} | {r['prefill_tps']:.0f} | "
                     f"{r['ttft_p50']:.2f} | {r['ttft_p95']:.2f} | {1000 * r['itl_p50']:.0f} | "
                     f"{1000 * r['itl_p95']:.0f} | {'' if share is None else f'{100 * share:.0f}%'} |")
    theirs = {r["clients"]: r["tps"] for r in rows if r["server"].startswith("llama-server")}
    lines.append("")
    for name in dict.fromkeys(r["server"] for r in rows if r["server"].startswith("umakit")):
        ours = {r["clients"]: r["tps"] for r in rows if r["server"] == name}
        if 1 in ours and 8 in ours:
            lines.append(f"- {name} at 8 clients: {ours[8] / ours[1]:.2f}x its aggregate tok/s at 1 client")
        for c in sorted(set(ours) & set(theirs)):
            lines.append(f"- {c} client(s): {name} {ours[c] / theirs[c]:.2f}x llama-server's aggregate tok/s")
    for n in notes:
        lines.append(f"- {n}")
    table = "\n".join(lines)
    print(table)
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(table + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
