"""Quantization quality table: size, bits per weight, perplexity and decode speed.

    python benchmarks/quant_quality.py                 # the built-in SmolLM2-135M
    python benchmarks/quant_quality.py path/to/model --tokens 4096 --kv-tokens 2048

For each model: a float source (a model that is already quantized, like the
built-in Q4_1 import, is dequantized to float16 first), then one quantized
copy per --configs entry, written by `umakit.quantize.quantize`. Perplexity is
on the first --tokens tokens of the Austen and Wikipedia corpora (fetch them
with `python -m umakit.evaluate.corpora fetch`), windows of 512. Decode speed is MLX's.
The KV-cache rows feed --kv-tokens tokens through a float, 8-bit and 4-bit
cache (MLX) and time decoding at that context.

--eval-backend torch computes perplexity with umakit's torch engine on the
same quantized tensors (dequantize-then-matmul in float32): on an x86 CPU it
is many times faster than MLX-CPU; a cross-check row gives both engines' result.
Progress goes to stderr, the markdown table to stdout.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import umakit
from umakit import checkpoint
from umakit.checkpoint import writer as checkpoint_writer
from umakit.generate.stream import collect
from umakit.evaluate.corpora import load_corpus
from umakit.evaluate.perplexity import kv_perplexity, perplexity
from umakit.quantize.pipeline import quantize
from umakit.quantize.recipes import dequantize_model, quantized_layers

CORPORA = ("austen", "wiki")
DEFAULT_CONFIGS = "8:64:default,6:64:default,4:32:default,4:64:default,4:128:default,4:64:mixed,4:64:uniform,3:64:default"
PROMPT = "The history of the English novel"


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def disk_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.glob("*.safetensors"))


def float_source(path: Path, work: Path) -> tuple[Path, str]:
    """``path`` itself if its weights are float, else a float16 dequantized copy."""
    ckpt = checkpoint.open_checkpoint(path)
    if "quantization" not in ckpt.config:
        return path, "float source"
    engine = umakit.load(path, backend="mlx", device="cpu", dtype="float16").engine
    dequantize_model(engine.model)  # MLX's own pass, on the MLX engine's model
    config = json.loads((path / "config.json").read_text())
    config.pop("quantization"), config.pop("quantization_config", None)
    config["torch_dtype"] = "float16"
    dst = work / "float16"
    checkpoint_writer.write_model_dir(dst, engine.export_weights(), config, copy_from=path)
    return dst, f"float16 source (dequantized from {ckpt.config['quantization']['bits']}-bit import)"


def decode_tps(model, cache=None, tokens: int = 32, runs: int = 3) -> float:
    """Best of ``runs`` greedy decodes: the machine may be shared, the best run is its capability."""
    ids = model.tokenizer.encode(PROMPT)
    best = 0.0
    for _ in range(runs):
        c = cache if cache is not None else model.make_cache()
        offset = c.offset
        result = collect(model.stream_tokens(ids, c, max_tokens=tokens, temperature=0))
        best = max(best, result.stats.decode_tps)
        c.trim(c.offset - offset)  # back to the context being measured
    return best


def float_layers(model) -> str:
    """'quantizable layers left float / all quantizable layers' of an MLX model."""
    left = sum(1 for _, m in model.named_modules() if hasattr(m, "to_quantized"))
    return f"{left}/{left + len(quantized_layers(model))}"


def ppl_row(path: Path, texts: dict, backend: str) -> dict:
    m = umakit.load(path, backend=backend)
    return {c: perplexity(m, ids).ppl for c, ids in texts.items()}


def weight_rows(model_dir: Path, args, texts: dict, work: Path) -> list[dict]:
    rows = []
    src, label = float_source(model_dir, work)
    shipped = model_dir != src
    candidates = ([("as shipped", model_dir, None)] if shipped else []) + [(label, src, None)]
    for spec in args.configs.split(","):
        bits, group, recipe = spec.split(":")
        log(f"quantizing {bits}-bit g{group} {recipe}")
        r = quantize(src, work / spec.replace(":", "_"), bits=int(bits), group_size=int(group), recipe=recipe)
        candidates.append((f"{bits}-bit g{group} {recipe}", r.dst, r))
    base = None
    for name, path, report in candidates:
        log(f"evaluating {name}")
        mlx_model = umakit.load(path, backend="mlx")
        w = mlx_model.info.weights
        # bits per weight as stored (MLX-CPU holds scales in float32, so its memory figure is higher)
        row = {"name": name, "bytes": disk_bytes(path), "bpw": 8 * disk_bytes(path) / w.params,
               "bpw_memory": w.bits_per_weight, "float_layers": float_layers(mlx_model.engine.model),
               "ppl": ppl_row(path, texts, args.eval_backend), "tps": decode_tps(mlx_model)}
        if name.startswith("float"):
            base = row["ppl"]
        rows.append(row)
        del mlx_model
    for row in rows:
        row["change"] = {c: row["ppl"][c] / base[c] - 1 for c in texts} if base else None
    return rows


def kv_rows(model_dir: Path, args, corpora_text: dict) -> list[dict]:
    m = umakit.load(model_dir, backend="mlx")
    rows = []
    for bits in (None, 8, 4):
        row = {"kv": f"{bits}-bit" if bits else f"float ({m.info.dtype})", "ppl": {}}
        for c, text in corpora_text.items():
            log(f"KV {row['kv']} on {c}")
            cache = m.make_cache(bits)
            r = kv_perplexity(m, text, kv_bits=bits, max_tokens=args.kv_tokens, cache=cache)
            row["ppl"][c] = r.ppl
            row["bytes_per_token"] = r.cache_bytes_per_token
            row["context"] = r.cache_tokens
            if c == CORPORA[0]:
                row["tps"] = decode_tps(m, cache)
        rows.append(row)
    for row in rows:
        row["change"] = {c: row["ppl"][c] / rows[0]["ppl"][c] - 1 for c in row["ppl"]}
    return rows


def cross_check(path: Path, ids: list[int]) -> tuple[float, float]:
    return tuple(perplexity(umakit.load(path, backend=b), ids).ppl for b in ("mlx", "torch"))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("models", nargs="*", help="model directories (default: the built-in model)")
    p.add_argument("--tokens", type=int, default=4096, help="perplexity tokens per corpus")
    p.add_argument("--configs", default=DEFAULT_CONFIGS, help="bits:group:recipe,...")
    p.add_argument("--kv-tokens", type=int, default=2048,
                   help="tokens through the KV cache (0: skip); a multiple of 256 makes bytes/token exact")
    p.add_argument("--eval-backend", default="mlx", choices=["mlx", "torch"])
    p.add_argument("--json", type=Path, help="also write the raw numbers here")
    args = p.parse_args()
    out: dict = {"args": vars(args) | {"json": str(args.json)}, "models": {}}
    for model in args.models or [None]:
        model_dir = checkpoint.resolve(model)
        tok = umakit.load(model_dir, backend="mlx").tokenizer
        raw = {c: load_corpus(c, max_chars=args.tokens * 8) for c in CORPORA}
        texts = {c: tok.encode(t)[: args.tokens] for c, t in raw.items()}
        with tempfile.TemporaryDirectory() as work:
            rows = weight_rows(model_dir, args, texts, Path(work))
            check = None
            if args.eval_backend == "torch":
                log("cross-check: mlx and torch perplexity, 4-bit g64 default, first 512 austen tokens")
                path = Path(work) / "4_64_default"
                check = (*cross_check(path, texts["austen"][:512]), len(texts["austen"][:512])) \
                    if path.is_dir() else None
        kv = kv_rows(model_dir, args, {c: tok.encode(raw[c])[: args.kv_tokens] for c in CORPORA}) \
            if args.kv_tokens else []
        out["models"][str(model_dir)] = {"weights": rows, "kv": kv, "cross_check": check,
                                         "tokens": {c: len(t) for c, t in texts.items()}}
        print(render(str(model or model_dir.name), rows, kv, check, args))
    if args.json:
        args.json.write_text(json.dumps(out, indent=2))


def render(name, rows, kv, check, args) -> str:
    lines = [f"### {name}", "",
             f"Perplexity: first {args.tokens} tokens of each corpus, windows of 512 ({args.eval_backend} engine); "
             "Δ against the float source; decode: MLX, greedy, best of 3 runs of 32 tokens after a short prompt. "
             "Float layers: quantizable layers left float (input width not divisible by the group size).", "",
             "| weights | size on disk | bits/weight (disk) | (MLX-CPU memory) | float layers | ppl austen | Δ "
             "| ppl wiki | Δ | decode tok/s |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        ch = r["change"] or {}
        lines.append(f"| {r['name']} | {r['bytes'] / 2**20:.1f} MiB | {r['bpw']:.2f} | {r['bpw_memory']:.2f} | "
                     f"{r['float_layers']} | "
                     f"{r['ppl']['austen']:.3f} | "
                     f"{100 * ch.get('austen', 0):+.2f}% | {r['ppl']['wiki']:.3f} | {100 * ch.get('wiki', 0):+.2f}% | "
                     f"{r['tps']:.1f} |")
    if check:
        lines += ["", f"Cross-check, 4-bit g64 default, first {check[2]} austen tokens: MLX ppl {check[0]:.4f}, "
                      f"torch ppl {check[1]:.4f}."]
    if kv:
        lines += ["", f"KV cache ({kv[0]['context']} tokens fed through one cache, 256 a step; decode timed at that "
                      "context; model as shipped):", "",
                  "| KV cache | bytes/token | ppl austen | Δ | ppl wiki | Δ | decode tok/s |",
                  "|---|---:|---:|---:|---:|---:|---:|"]
        for r in kv:
            lines.append(f"| {r['kv']} | {r['bytes_per_token']:,.0f} | {r['ppl']['austen']:.3f} | "
                         f"{100 * r['change']['austen']:+.2f}% | {r['ppl']['wiki']:.3f} | "
                         f"{100 * r['change']['wiki']:+.2f}% | {r['tps']:.1f} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
