"""lm-evaluation-harness against `umakit serve`, beside lm-eval's own transformers model on the same GGUF.

    python benchmarks/lm_eval_check.py [--lm-eval PATH] [--model GGUF] [--port 8765]

lm-eval runs in a venv of its own (``python3 -m venv V && V/bin/pip install torch==2.13.0 "lm-eval[api,hf]" gguf``;
``--lm-eval V/bin/lm_eval``). Two tasks made here from twelve questions (a JSON file, so nothing is downloaded): a
multiple-choice one (48 log-likelihood requests: each question's four answers) and a generation one (greedy, up to
16 tokens, cut at a newline or a full stop). Each runs twice, one model at a time:

- ``local-completions`` against a `umakit serve` of ``--model`` (default: the built-in SmolLM2-135M-Instruct Q4_1),
  lm-eval choosing its tokenizer backend itself (it finds umakit's ``/tokenizer_info`` and ``/tokenize``);
- lm-eval's ``hf`` model: transformers' reading of the same GGUF, in float32 on the CPU.

Compared, sample by sample (``--log_samples``): the log-likelihood of each answer, whether lm-eval judged it
greedy, accuracy, and the generations. Prints a markdown table and writes it to benchmarks/out/lm_eval_check.md.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

# (question, answer, three wrong answers): simple facts a small model mostly knows
FACTS = [
    ("The capital of France is", "Paris", ["Rome", "Berlin", "Madrid"]),
    ("The capital of Japan is", "Tokyo", ["Paris", "Cairo", "Lima"]),
    ("Water freezes at zero degrees", "Celsius", ["Kelvin", "Fahrenheit", "Rankine"]),
    ("The largest planet in the solar system is", "Jupiter", ["Mars", "Venus", "Mercury"]),
    ("The opposite of hot is", "cold", ["warm", "red", "fast"]),
    ("A week has seven", "days", ["years", "cats", "rivers"]),
    ("The sun rises in the", "east", ["west", "north", "south"]),
    ("Two plus two equals", "four", ["five", "seven", "nine"]),
    ("Bees make", "honey", ["milk", "steel", "glass"]),
    ("The color of grass is", "green", ["purple", "orange", "black"]),
    ("Ice is frozen", "water", ["sand", "bread", "iron"]),
    ("The first month of the year is", "January", ["June", "October", "March"]),
]
CHOICE_TASK = """task: umakit_facts
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_target: label
doc_to_choice: "{{{{choices}}}}"
target_delimiter: " "
metric_list:
  - metric: acc
"""
GENERATE_TASK = """task: umakit_gen
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: generate_until
doc_to_text: "{{{{question}}}}"
doc_to_target: "{{{{choices[label]}}}}"
generation_kwargs:
  until: ["\\n", "."]
  max_gen_toks: 16
  do_sample: false
metric_list:
  - metric: exact_match
"""
TASKS = ("umakit_facts", "umakit_gen")


def write_tasks(folder: Path) -> None:
    rows = []
    for i, (question, answer, wrong) in enumerate(FACTS):
        choices = wrong[:i % 4] + [answer] + wrong[i % 4:]  # the answer's place varies, fixed for every run
        rows.append({"question": question, "choices": choices, "label": choices.index(answer)})
    data = folder / "facts.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    (folder / "umakit_facts.yaml").write_text(CHOICE_TASK.format(data=data))
    (folder / "umakit_gen.yaml").write_text(GENERATE_TASK.format(data=data))


def builtin_gguf() -> Path:
    from umakit.checkpoint.default import packaged_gguf

    return packaged_gguf()


def serve(model: Path, port: int, home: Path, log: Path) -> subprocess.Popen:
    umakit = Path(sys.executable).parent / "umakit"
    proc = subprocess.Popen([str(umakit), "serve", str(model), "--port", str(port), "--peak-bandwidth", "100"],
                            stdout=log.open("w"), stderr=subprocess.STDOUT,
                            env={**os.environ, "UMAKIT_HOME": str(home)})
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                if json.load(r).get("status") == "ok":
                    return proc
        except OSError:
            pass
        if proc.poll() is not None:
            break
        time.sleep(1)
    proc.kill()
    raise SystemExit(f"umakit serve did not become healthy; see {log}")


def served_name(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=10) as r:
        return json.load(r)["data"][0]["id"]


def lm_eval(binary: str, args: list[str], tasks: Path, out: Path) -> float:
    t0 = time.perf_counter()
    env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"}
    done = subprocess.run([binary, *args, "--tasks", ",".join(TASKS), "--include_path", str(tasks),
                           "--output_path", str(out), "--log_samples"], env=env, capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"lm_eval failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    (out / "lm_eval.log").write_text(done.stdout + done.stderr)
    return time.perf_counter() - t0


def samples(out: Path, task: str) -> list[dict]:
    path = next(out.rglob(f"samples_{task}_*.jsonl"))
    return sorted((json.loads(line) for line in path.read_text().splitlines()), key=lambda s: s["doc_id"])


def compare(ours: Path, theirs: Path) -> dict:
    a, b = samples(ours, "umakit_facts"), samples(theirs, "umakit_facts")
    pairs = [(x[0], y[0]) for s, t in zip(a, b) for x, y in zip(s["resps"], t["resps"])]
    gaps = [abs(float(x[0]) - float(y[0])) for x, y in pairs]
    ga, gb = samples(ours, "umakit_gen"), samples(theirs, "umakit_gen")
    return {"requests": len(pairs), "max_gap": max(gaps), "mean_gap": sum(gaps) / len(gaps),
            "greedy_agree": sum(x[1] == y[1] for x, y in pairs),
            "acc": (sum(s["acc"] for s in a), sum(t["acc"] for t in b)), "questions": len(a),
            "same_generations": sum(s["resps"][0][0] == t["resps"][0][0] for s, t in zip(ga, gb)),
            "generations": len(ga)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--lm-eval", default=shutil.which("lm_eval") or "lm_eval", help="lm-eval's lm_eval command")
    p.add_argument("--model", type=Path, default=None, help="a GGUF (default: the built-in model)")
    p.add_argument("--port", type=int, default=8765)
    a = p.parse_args()
    model = a.model or builtin_gguf()
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        write_tasks(tmp)
        server = serve(model, a.port, tmp / "home", tmp / "serve.log")
        try:
            name = served_name(a.port)
            url = f"http://127.0.0.1:{a.port}/v1/completions"
            t_umakit = lm_eval(a.lm_eval, ["--model", "local-completions", "--model_args",
                                           f"model={name},base_url={url},num_concurrent=1,max_retries=1"],
                               tmp, tmp / "umakit")
            log = (tmp / "umakit" / "lm_eval.log").read_text()
            remote = "remote tokenizer" in log.lower()
        finally:
            server.terminate()
            server.wait(timeout=60)
        t_hf = lm_eval(a.lm_eval, ["--model", "hf", "--device", "cpu", "--model_args",
                                   f"pretrained={model.parent},gguf_file={model.name},dtype=float32"], tmp, tmp / "hf")
        c = compare(tmp / "umakit", tmp / "hf")
    date = time.strftime("%Y-%m-%d")
    table = "\n".join([
        f"lm-eval against `umakit serve` and lm-eval's `hf` model, {model.name}, {date}",
        "",
        "| | umakit serve (local-completions) | lm-eval hf (transformers, float32) |",
        "|---|---:|---:|",
        f"| multiple choice: accuracy | {c['acc'][0]:.0f}/{c['questions']} | {c['acc'][1]:.0f}/{c['questions']} |",
        f"| log-likelihoods, largest / mean difference (nats) | {c['max_gap']:.4f} / {c['mean_gap']:.4f} | |",
        f"| greedy flags agreeing | {c['greedy_agree']}/{c['requests']} | |",
        f"| generations identical | {c['same_generations']}/{c['generations']} | |",
        f"| tokenizer | {'the server (remote)' if remote else 'lm-eval local'} | transformers' |",
        f"| seconds, both tasks | {t_umakit:.1f} | {t_hf:.1f} |",
    ])
    print(table)
    out = Path(__file__).resolve().parent / "out"
    out.mkdir(exist_ok=True)
    (out / "lm_eval_check.md").write_text(table + "\n")


if __name__ == "__main__":
    main()
