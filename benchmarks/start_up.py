"""Process start to first token, one-shot: `umakit generate` against llama-cpp-python on the same GGUF.

    python benchmarks/start_up.py [--repeat 3] [--threads 2] [--keep DIR] [--llama-server PATH]
        [--model GGUF ...] [--only] [--first-run]

Two models: the built-in SmolLM2-135M Q4_1 GGUF, and a GGUF of Qwen2.5-0.5B's
exact shapes (24 layers, hidden 896, 14/2 heads, q/k/v biases, 151,936-token
vocabulary, tied embeddings) with random weights, written here by
shaped_ggufs.py (the built-in model's tokenizer, padded with unused tokens to
Qwen's vocabulary) and quantized by llama.cpp itself to Q4_1 with a Q8_0
table, as the built-in one is. Random weights cost the same to load and run
as real ones; there is no 0.5B GGUF offline.

Each model is imported into umakit once first (``umakit import``, outside the
timings, as a user's first run does), then every measurement is a fresh
process, the engines in rotation, median of ``--repeat``: umakit's
``umakit generate -m FILE.gguf -p PROMPT --max-tokens 8 --temp 0`` until the
first byte of its reply on stdout, and a llama-cpp-python process (``--llama-python``, a separate venv;
see cpu_engines.py) that loads the file and evaluates a prompt until its first
token: the same token ids umakit's chat template makes of PROMPT (the same
work), and PROMPT's own few tokens (what earlier versions of this script
timed).

Attached, with a server already up and both models loaded in it: ``umakit
generate ... --server URL`` against a ``umakit serve`` (models by name), until
the first byte of its reply, and ``curl`` asking llama.cpp's own
``llama-server`` (one per model, built with the peers) for one token of the
same token ids, until curl exits. Neither server keeps prompts between
requests (``--prompt-cache-bytes 0``, ``"cache_prompt": false``): every run
prefills the whole prompt, as a one-shot process does. Then as servers are
run, with their prompt caches on (umakit's default, llama-server's
``cache_prompt``), each run asking a new question (QUESTIONS): what an earlier
request left (the chat template's system prompt) is reused, the question's
own tokens are prefilled.

First runs (``--first-run``, a table of its own): `umakit generate` on a GGUF it has never seen, in a fresh
``$UMAKIT_HOME`` that holds only what a machine makes once (the native library, the bandwidth probe), so the
run imports the file and packs it for the CPU kernel before its first token, against llama-cpp-python's run on
the same file (which has nothing to do first); seconds to the first byte and the process's peak resident memory
(its rusage), median of ``--repeat``.

Prints a markdown table and writes it to benchmarks/out/start_up.md.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

from shaped_ggufs import Q8_0_TYPE, SHAPES, quantize, write_f16

PROMPT = "What is the capital of France?"
# a new question for each run against a server with its prompt cache on (none of them PROMPT, which warms it)
QUESTIONS = ("What is the capital of Spain?", "Name a red fruit.", "Who wrote Hamlet?", "What is two plus two?",
             "Name a large animal.", "What colour is the sky?", "Where is Rome?")
OUT = Path(__file__).parent / "out" / "start_up.md"
# llama-cpp-python built for this machine (GGML_NATIVE=ON), in a venv of its own: $LLAMA_PYTHON, or where the
# peers are usually built
LLAMA_PYTHON = os.environ.get("LLAMA_PYTHON") or str(Path.home() / ".cache" / "umakit-peers" / "venv" / "bin" / "python")
LLAMA_SERVER = os.environ.get("LLAMA_SERVER") or str(Path.home() / ".cache" / "umakit-peers" / "bin" / "llama-server")
LLAMA_WORKER = """
import sys, time
t0 = float(sys.argv[3])
from llama_cpp import Llama
llm = Llama(sys.argv[1], n_threads=int(sys.argv[2]), n_ctx=512, verbose=False)
ids = sys.argv[4]
llm.eval([int(t) for t in ids.split(",")] if ids else llm.tokenize(sys.argv[5].encode()))
llm.sample(top_k=1, temp=0)
took = time.time() - t0
print(took, next(line.split()[1] for line in open("/proc/self/status") if line.startswith("VmHWM:")))
"""
# `umakit generate` with its peak resident memory (VmHWM, which exec resets; a forked child's rusage keeps the
# parent's peak) written to argv[1] as it exits
UMAKIT_WORKER = """
import atexit, sys
out = sys.argv.pop(1)
atexit.register(lambda: open(out, "w").write(next(line.split()[1] for line in open("/proc/self/status")
                                                   if line.startswith("VmHWM:"))))
from umakit.cli.main import main
main()
"""
MADE_ONCE = ("native", "hardware.json")  # what a first run's fresh $UMAKIT_HOME is given: a machine's, not a model's


def umakit_first_token(gguf_file: Path, threads: int, server: str | None = None, prompt: str = PROMPT,
                       home: str | None = None) -> float:
    """Seconds from spawning `umakit generate` to the first byte of its reply on stdout; in this process, or
    attached to the umakit server at ``server``."""
    return _umakit_run(gguf_file, threads, server, prompt, home)[0]


def _umakit_run(gguf_file: Path, threads: int, server: str | None = None, prompt: str = PROMPT,
                home: str | None = None) -> tuple[float, float]:
    """`umakit_first_token`, and the process's peak resident MB; ``home``: its $UMAKIT_HOME."""
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), **({"UMAKIT_HOME": home} if home else {})}
    where = ["--server", server] if server else ["--no-server"]
    with tempfile.NamedTemporaryFile("r") as peak:
        t0 = time.time()
        p = subprocess.Popen([sys.executable, "-c", UMAKIT_WORKER, peak.name, "generate", "-m", str(gguf_file), "-p",
                              prompt, "--max-tokens", "8", "--temp", "0", *where], stdout=subprocess.PIPE,
                             stderr=subprocess.DEVNULL, env=env)
        sampled = _sampling_rss(p.pid)
        first = p.stdout.read(1)
        took = time.time() - t0
        p.stdout.read()
        if p.wait() != 0 or not first:
            raise RuntimeError(f"umakit generate failed on {gguf_file}")
        return took, max(int(peak.read()), *sampled) / 1024


def _sampling_rss(pid: int, every_s: float = 0.02) -> list[int]:
    """The resident KB of process ``pid``, read every ``every_s`` until it exits, into the list returned (filled
    by a thread). VmHWM misses peaks that end without an unmap (memory handed back by madvise, as glibc's
    malloc_trim does), so a run's peak is the larger of the two."""
    seen: list[int] = [0]

    def sample():
        with contextlib.suppress(OSError, StopIteration, ValueError):
            while True:
                with open(f"/proc/{pid}/status") as f:
                    seen.append(int(next(line.split()[1] for line in f if line.startswith("VmRSS:"))))
                time.sleep(every_s)

    threading.Thread(target=sample, daemon=True).start()
    return seen


def umakit_first_run(gguf_file: Path, threads: int) -> tuple[float, float]:
    """`_umakit_run` on a GGUF umakit has never seen: a fresh $UMAKIT_HOME with only `MADE_ONCE` from the usual
    one, so the run imports and packs the file first."""
    from umakit.core.home import umakit_home

    with tempfile.TemporaryDirectory(dir=umakit_home().parent) as home:
        for name in MADE_ONCE:
            src, dst = umakit_home() / name, Path(home) / name
            if src.is_dir():
                shutil.copytree(src, dst)
            elif src.exists():
                shutil.copy2(src, dst)
        return _umakit_run(gguf_file, threads, home=home)


def llama_first_token(llama_python: str, gguf_file: Path, threads: int, ids: list[int] | None) -> float:
    """llama-cpp-python's start to first token, evaluating ``ids`` (None: PROMPT, tokenized by llama.cpp)."""
    return llama_run(llama_python, gguf_file, threads, ids)[0]


def llama_run(llama_python: str, gguf_file: Path, threads: int, ids: list[int] | None) -> tuple[float, float]:
    """`llama_first_token`, and the process's peak resident MB."""
    p = subprocess.Popen([llama_python, "-c", LLAMA_WORKER, str(gguf_file), str(threads), repr(time.time()),
                          ",".join(map(str, ids or [])), PROMPT], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True)
    sampled = _sampling_rss(p.pid)
    out, err = p.communicate()
    if p.returncode:
        raise RuntimeError(f"llama-cpp-python failed on {gguf_file}: {err[-500:]}")
    took, peak_kb = out.strip().splitlines()[-1].split()
    return float(took), max(int(peak_kb), *sampled) / 1024


def first_runs(models: dict[str, Path], args) -> str:
    """The first-run table (see the module's docstring)."""
    ids = {name: chat_ids(path) for name, path in models.items()}  # imports each into the usual home, untimed
    rows = {name: {"umakit": [], "llama": []} for name in models}
    for _ in range(args.repeat):
        for name, path in models.items():
            rows[name]["umakit"].append(umakit_first_run(path, args.threads))
            rows[name]["llama"].append(llama_run(args.llama_python, path, args.threads, ids[name]))
            print(f"  {name}: first run {rows[name]['umakit'][-1]}, llama.cpp {rows[name]['llama'][-1]}",
                  file=sys.stderr)
    lines = [f"A GGUF's first run, {time.strftime('%Y-%m-%d')}: median of {args.repeat}, each a fresh process "
             f"(umakit's with a fresh $UMAKIT_HOME), in rotation; {args.threads} threads.", "",
             "| model | GGUF size | umakit's first run: first token | its peak RSS | llama-cpp-python: first token "
             "| its peak RSS |", "|---|---:|---:|---:|---:|---:|"]
    for name, r in rows.items():
        med = {k: [statistics.median(x[i] for x in v) for i in (0, 1)] for k, v in r.items()}
        lines.append(f"| {name} | {models[name].stat().st_size / 1e6:.0f} MB | {med['umakit'][0]:.2f} s | "
                     f"{med['umakit'][1]:.0f} MB | {med['llama'][0]:.2f} s | {med['llama'][1]:.0f} MB |")
    return "\n".join(lines)


def curl_first_token(url: str, ids: list[int], cache: bool = False) -> float:
    """Seconds from spawning curl, asking a running llama-server for one token after ``ids``, to its exit."""
    body = json.dumps({"prompt": ids, "n_predict": 1, "temperature": 0, "cache_prompt": cache})
    t0 = time.time()
    subprocess.run(["curl", "-sf", "-o", "/dev/null", "-H", "Content-Type: application/json", "-d", body,
                    f"{url}/completion"], check=True)
    return time.time() - t0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _healthy(url: str, proc: subprocess.Popen, timeout_s: float = 300) -> None:
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server for {url} exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"no healthy server at {url} after {timeout_s} s")


@contextlib.contextmanager
def servers(models: dict[str, Path], threads: int, llama_server: str | None):
    """Two `umakit serve`s hosting the models by name, one without a prompt cache and one as it starts by default,
    and a llama-server per model (when ``llama_server``): yields (umakit's URLs, {model name: llama-server's URL}),
    all healthy; stopped on the way out."""
    procs, llama, urls = [], {}, []
    umakit = Path(sys.executable).with_name("umakit")
    try:
        for cache in (["--prompt-cache-bytes", "0"], []):
            urls.append(f"http://127.0.0.1:{_free_port()}")
            procs.append(subprocess.Popen([str(umakit), "serve", "--port", urls[-1].rsplit(":", 1)[1], "--keep-alive",
                                           "-1", *cache], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                          env={**os.environ, "OMP_NUM_THREADS": str(threads)}))
            _healthy(urls[-1], procs[-1])
        for name, path in (models.items() if llama_server else ()):
            llama[name] = f"http://127.0.0.1:{_free_port()}"
            procs.append(subprocess.Popen([llama_server, "-m", str(path), "--port", llama[name].rsplit(":", 1)[1],
                                           "-t", str(threads), "-c", "2048", "-np", "1"],
                                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
            _healthy(llama[name], procs[-1])
        yield urls, llama
    finally:
        for proc in procs:
            proc.terminate()
            proc.wait(timeout=30)


def chat_ids(gguf_file: Path, prompt: str = PROMPT) -> list[int]:
    """The token ids `umakit generate` feeds for ``prompt``: its chat template's."""
    import umakit

    return umakit.load(gguf_file).encode(prompt)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--llama-python", default=LLAMA_PYTHON)
    ap.add_argument("--keep", help="a directory to keep (and reuse) the 0.5B GGUF in")
    ap.add_argument("--llama-server", default=LLAMA_SERVER, help="llama.cpp's llama-server for the attached peer")
    ap.add_argument("--model", action="append", default=[], type=Path, metavar="GGUF",
                    help="one more GGUF to time (a type users download: benchmarks/shaped_ggufs.py writes them)")
    ap.add_argument("--first-run", action="store_true", help="time first runs only (fresh $UMAKIT_HOME)")
    ap.add_argument("--only", action="store_true", help="the --model files only, not the two built in here")
    args = ap.parse_args()
    if not Path(args.llama_python).exists():
        sys.exit(f"no {args.llama_python}: llama-cpp-python is the peer here (see cpu_engines.py's docstring)")
    from umakit.checkpoint.default import packaged_gguf

    builtin = packaged_gguf()
    with tempfile.TemporaryDirectory() as tmp:
        where = Path(args.keep or tmp)
        where.mkdir(parents=True, exist_ok=True)
        qwen = where / "qwen2.5-0.5b-shaped.Q4_1.gguf"
        if not qwen.exists() and not args.only:
            f16 = where / "qwen2.5-0.5b-shaped.F16.gguf"
            write_f16(f16, SHAPES["qwen2.5-0.5b"], "qwen2.5-0.5b", builtin)
            quantize(args.llama_python, f16, qwen, "Q4_1", Q8_0_TYPE)
            f16.unlink()
        models = {} if args.only else {"SmolLM2-135M-Instruct Q4_1 (built-in)": builtin,
                                       "Qwen2.5-0.5B shapes, Q4_1 (random)": qwen}
        models.update({f.name: f.resolve() for f in args.model})
        if args.first_run:
            table = first_runs(models, args)
            print(table)
            OUT.parent.mkdir(parents=True, exist_ok=True)
            OUT.write_text(table + "\n")
            return
        for path in models.values():  # the one-time import and first load, as a first run does, outside the timings
            umakit_first_token(path, args.threads)
        ids = {name: chat_ids(path) for name, path in models.items()}
        asked = {name: [chat_ids(path, q) for q in QUESTIONS] for name, path in models.items()}
        llama_server = args.llama_server if Path(args.llama_server).exists() else None
        load = os.getloadavg()[0]
        with servers(models, args.threads, llama_server) as ((fresh, cached), llama_urls):
            for name, path in models.items():  # each model loaded by each server, outside the timings
                for url in (fresh, cached):
                    umakit_first_token(path, args.threads, url)
                if llama_server:
                    curl_first_token(llama_urls[name], ids[name], cache=True)
            q = len(QUESTIONS)
            runs = {"umakit": lambda p, n, r: umakit_first_token(p, args.threads),
                    "umakit attached": lambda p, n, r: umakit_first_token(p, args.threads, fresh),
                    "llama.cpp, same tokens": lambda p, n, r: llama_first_token(args.llama_python, p, args.threads,
                                                                                ids[n]),
                    "llama.cpp, raw prompt": lambda p, n, r: llama_first_token(args.llama_python, p, args.threads,
                                                                               None),
                    "umakit attached, cache on": lambda p, n, r: umakit_first_token(p, args.threads, cached,
                                                                                    QUESTIONS[r % q])}
            if llama_server:
                runs["llama-server + curl"] = lambda p, n, r: curl_first_token(llama_urls[n], ids[n])
                runs["llama-server + curl, cache on"] = lambda p, n, r: curl_first_token(llama_urls[n],
                                                                                         asked[n][r % q], cache=True)
            times: dict[str, dict[str, list[float]]] = {m: {r: [] for r in runs} for m in models}
            for r in range(args.repeat):
                for name, path in models.items():
                    for run, timed in runs.items():
                        times[name][run].append(timed(path, name, r))
                    print(f"  {name}: " + ", ".join(f"{r} {t[-1]:.2f} s" for r, t in times[name].items()),
                          file=sys.stderr)
        sizes = {name: path.stat().st_size for name, path in models.items()}
    lines = [f"Process start to first token, {time.strftime('%Y-%m-%d')}: median of {args.repeat}, each run a fresh "
             f"process, in rotation; {args.threads} threads; load average {load:.1f} at the start.", "",
             "| model | GGUF size | prompt tokens | umakit generate (cached import) | llama-cpp-python, the same "
             "tokens | umakit / llama.cpp | llama-cpp-python, the raw prompt's tokens | umakit attached to "
             "`umakit serve` | curl to llama-server | attached umakit / llama-server | attached, prompt caches on, "
             "a new question each run | curl to llama-server, the same | ratio |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for name, t in times.items():
        m = {r: statistics.median(v) for r, v in t.items()}
        curl, curl_cached = m.get("llama-server + curl"), m.get("llama-server + curl, cache on")
        lines.append(f"| {name} | {sizes[name] / 1e6:.0f} MB | {len(ids[name])} | {m['umakit']:.2f} s | "
                     f"{m['llama.cpp, same tokens']:.2f} s | {m['umakit'] / m['llama.cpp, same tokens']:.2f}x | "
                     f"{m['llama.cpp, raw prompt']:.2f} s | {m['umakit attached']:.3f} s | "
                     + (f"{curl:.3f} s | {m['umakit attached'] / curl:.2f}x |" if curl else "not built | |")
                     + f" {m['umakit attached, cache on']:.3f} s | "
                     + (f"{curl_cached:.3f} s | {m['umakit attached, cache on'] / curl_cached:.2f}x |" if curl_cached
                        else "not built | |"))
    table = "\n".join(lines)
    print(table)
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(table + "\n")
    print(json.dumps(times), file=sys.stderr)


if __name__ == "__main__":
    main()
