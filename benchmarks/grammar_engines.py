"""Grammar engines on umakit's tokenizers: llguidance (what umakit uses) against xgrammar, in one run.

    python benchmarks/grammar_engines.py [--model PATH] [--repeat 20]

For the JSON schema of benchmarks/structured.py and the model's tokenizer (the built-in model's by default): the
time to build the engine's view of the vocabulary (once per model), to compile the schema (once per request), and
per token to compute the mask and accept the token, replaying one valid reply (its tokens as the model's
tokenizer writes them) ``--repeat`` times; medians. xgrammar is measured when it imports (it needs torch,
transformers and apache-tvm-ffi: ``pip install xgrammar``); else its row says so. Both are asked for the same
JSON: no free whitespace, ``", "`` and ``": "`` separators. Prints a markdown table and writes it to
benchmarks/out/grammar_engines.md.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from datetime import date
from pathlib import Path

from structured import SCHEMA

OUT = Path(__file__).parent / "out" / "grammar_engines.md"
REPLY = {"name": "Paris", "country": "France", "population": 2102650, "continent": "Europe",
         "location": {"lat": 48.8566, "lon": 2.3522},
         "landmarks": [{"name": "Eiffel Tower", "kind": "monument"}, {"name": "Louvre", "kind": "museum"}]}


def _median_ms(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e3


def llguidance_row(tokenizer, tokens: list[int], repeat: int) -> list[dict]:
    from umakit.generate import constrain
    from umakit.generate.constrain import Constraint

    t = time.perf_counter()
    constrain.vocabulary(tokenizer)
    vocab_s = time.perf_counter() - t
    constraint = Constraint.json_schema(SCHEMA)
    compile_ms = _median_ms(lambda: constraint.matcher(tokenizer), repeat)

    def replay():
        m = constraint.matcher(tokenizer)
        for tok in tokens:
            assert m.allowed()[tok]
            m.accept(tok)

    per_token = (_median_ms(replay, repeat) - compile_ms) * 1e3 / len(tokens)
    import numpy as np

    words = np.empty((constrain.vocabulary(tokenizer).vocab_size + 31) // 32, dtype=np.int32)

    def replay_raw():  # llguidance's own work: the mask into its packed bitmask, as xgrammar's row measures
        m = constraint.matcher(tokenizer)._m
        for tok in tokens:
            m.unsafe_compute_mask_ptr(words.ctypes.data, words.nbytes)
            assert m.consume_token(tok)

    raw = (_median_ms(replay_raw, repeat) - compile_ms) * 1e3 / len(tokens)
    return [{"engine": "llguidance, as umakit calls it (a boolean mask)", "vocab_s": vocab_s,
             "compile_ms": compile_ms, "us_per_token": per_token},
            {"engine": "llguidance, packed bitmask only", "vocab_s": vocab_s, "compile_ms": compile_ms,
             "us_per_token": raw}]


def xgrammar_row(tokenizer, tokens: list[int], repeat: int) -> dict:
    try:
        import xgrammar as xgr
        from tokenizers import Tokenizer as HFTokenizer
        from transformers import PreTrainedTokenizerFast
    except ImportError as e:
        return {"engine": f"xgrammar (not measured: {e})"}
    hf = PreTrainedTokenizerFast(tokenizer_object=HFTokenizer.from_str(tokenizer.backend_json()))
    t = time.perf_counter()
    info = xgr.TokenizerInfo.from_huggingface(hf, stop_token_ids=sorted(tokenizer.eos_ids))
    compiler = xgr.GrammarCompiler(info, cache_enabled=False)
    vocab_s = time.perf_counter() - t
    schema = json.dumps(SCHEMA)

    def compile_():
        return compiler.compile_json_schema(schema, any_whitespace=False, separators=(", ", ": "))

    compile_ms = _median_ms(compile_, repeat)
    compiled = compile_()
    bitmask = xgr.allocate_token_bitmask(1, info.vocab_size)

    def replay():
        m = xgr.GrammarMatcher(compiled)
        for tok in tokens:
            m.fill_next_token_bitmask(bitmask)
            assert m.accept_token(tok)

    per_token = _median_ms(replay, repeat) * 1e3 / len(tokens)
    from importlib.metadata import version

    return {"engine": f"xgrammar {version('xgrammar')}, packed bitmask", "vocab_s": vocab_s,
            "compile_ms": compile_ms, "us_per_token": per_token}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="a model directory or .gguf (default: the built-in model)")
    ap.add_argument("--repeat", type=int, default=20)
    args = ap.parse_args()

    from umakit import checkpoint
    from umakit.checkpoint.tokenizer import Tokenizer

    path = checkpoint.resolve(args.model)
    tokenizer = Tokenizer(path)
    tokens = tokenizer.encode(json.dumps(REPLY), add_special_tokens=False) + [min(tokenizer.eos_ids)]
    rows = [*llguidance_row(tokenizer, tokens, args.repeat), xgrammar_row(tokenizer, tokens, args.repeat)]
    import llguidance

    lines = [f"Measured {date.today()} on {platform.processor() or platform.machine()}, the tokenizer of {path.name} "
             f"({tokenizer.vocab_size} tokens); llguidance {llguidance.get_version()}; a {len(tokens)}-token reply "
             f"replayed, medians of {args.repeat}.", "",
             "| engine | vocabulary (once per model) | compile the schema | mask + accept, per token |",
             "|---|---:|---:|---:|"]
    for r in rows:
        if "compile_ms" not in r:
            lines.append(f"| {r['engine']} | | | |")
            continue
        lines.append(f"| {r['engine']} | {r['vocab_s']:.2f} s | {r['compile_ms']:.2f} ms | "
                     f"{r['us_per_token']:.0f} µs |")
    table = "\n".join(lines)
    print(table)
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(table + "\n")


if __name__ == "__main__":
    main()
