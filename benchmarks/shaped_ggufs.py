"""GGUFs of real models' exact shapes with random weights, quantized by llama.cpp itself: what users download,
for benchmarks to run on without a network.

    python benchmarks/shaped_ggufs.py DIR [--models qwen2.5-0.5b qwen2.5-1.5b] [--types Q4_K_M Q5_K_M Q6_K Q8_0]

Each model is written once as float16 with the `gguf` package (the built-in
model's tokenizer, padded with unused tokens to Qwen's vocabulary), then
quantized by llama.cpp's own quantizer (llama-cpp-python's
``llama_model_quantize``, run by ``--llama-python``) to each type with
llama.cpp's default choices per tensor (a Q4_K_M keeps some tensors at Q6_K,
and where a row is not a multiple of 256 falls back to Q5_0/Q8_0, as on the
Hub's files). Random weights cost the same to load and run as real ones;
``smollm2-135m`` is a real model for perplexity: the built-in Q4_1 file
re-quantized by llama.cpp (its weights already on a 4-bit grid).
Files already in DIR are kept. Prints the paths written.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

import numpy as np

LLAMA_PYTHON = os.environ.get("LLAMA_PYTHON") or str(Path.home() / ".cache" / "umakit-peers" / "venv" / "bin" / "python")
QWEN = dict(vocab=151936, theta=1e6, eps=1e-6, context=32768, kv_heads=2)
SHAPES = {
    "qwen2.5-0.5b": dict(QWEN, layers=24, hidden=896, heads=14, inter=4864),
    "qwen2.5-1.5b": dict(QWEN, layers=28, hidden=1536, heads=12, inter=8960),
}
# llama.cpp's LLAMA_FTYPE_MOSTLY_* numbers
FTYPES = {"Q4_0": 2, "Q4_1": 3, "Q8_0": 7, "Q5_0": 8, "Q5_1": 9, "Q4_K_M": 15, "Q5_K_M": 17, "Q6_K": 18}
Q8_0_TYPE = 8  # GGML_TYPE_Q8_0

QUANTIZE = """
import sys, llama_cpp
p = llama_cpp.llama_model_quantize_default_params()
p.ftype, p.nthread, p.allow_requantize = int(sys.argv[3]), 2, True
if int(sys.argv[4]) >= 0:
    p.token_embedding_type = int(sys.argv[4])
assert llama_cpp.llama_model_quantize(sys.argv[1].encode(), sys.argv[2].encode(), p) == 0
"""


def write_f16(path: Path, shape: dict, name: str, tokenizer_from: Path) -> None:
    """A float16 GGUF of ``shape`` (Qwen2's architecture: q/k/v biases, tied embeddings), random weights, the given
    GGUF's tokenizer padded to the vocabulary."""
    import gguf

    s = shape
    src = gguf.GGUFReader(str(tokenizer_from))
    field = lambda key: src.fields[key].contents()  # noqa: E731
    tokens, types = field("tokenizer.ggml.tokens"), field("tokenizer.ggml.token_type")
    pad = s["vocab"] - len(tokens)
    w = gguf.GGUFWriter(str(path), "qwen2")
    w.add_name(f"{name}-shaped, random weights")
    w.add_context_length(s["context"])
    w.add_embedding_length(s["hidden"])
    w.add_block_count(s["layers"])
    w.add_feed_forward_length(s["inter"])
    w.add_head_count(s["heads"])
    w.add_head_count_kv(s["kv_heads"])
    w.add_rope_freq_base(s["theta"])
    w.add_layer_norm_rms_eps(s["eps"])
    w.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(field("tokenizer.ggml.pre"))
    w.add_token_list(tokens + [f"<|unused_{i}|>" for i in range(pad)])
    w.add_token_types(types + [gguf.TokenType.UNUSED] * pad)
    w.add_token_merges(field("tokenizer.ggml.merges"))
    w.add_bos_token_id(field("tokenizer.ggml.bos_token_id"))
    w.add_eos_token_id(field("tokenizer.ggml.eos_token_id"))
    w.add_add_bos_token(False)
    w.add_chat_template(field("tokenizer.chat_template"))
    rng = np.random.default_rng(0)
    h, hd = s["hidden"], s["hidden"] // s["heads"]
    kv = s["kv_heads"] * hd

    def rand(*dims):  # GGUF lists dimensions innermost first; numpy arrays are (out, in)
        return (rng.standard_normal(dims, dtype=np.float32) * 0.02).astype(np.float16)

    w.add_tensor("token_embd.weight", rand(s["vocab"], h))
    w.add_tensor("output_norm.weight", np.ones(h, dtype=np.float32))
    for i in range(s["layers"]):
        b = f"blk.{i}."
        w.add_tensor(b + "attn_norm.weight", np.ones(h, dtype=np.float32))
        w.add_tensor(b + "ffn_norm.weight", np.ones(h, dtype=np.float32))
        for part, rows in (("attn_q", h), ("attn_k", kv), ("attn_v", kv)):
            w.add_tensor(b + part + ".weight", rand(rows, h))
            w.add_tensor(b + part + ".bias", rand(rows).astype(np.float32))
        w.add_tensor(b + "attn_output.weight", rand(h, h))
        w.add_tensor(b + "ffn_gate.weight", rand(s["inter"], h))
        w.add_tensor(b + "ffn_up.weight", rand(s["inter"], h))
        w.add_tensor(b + "ffn_down.weight", rand(h, s["inter"]))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def quantize(llama_python: str, f16: Path, out: Path, qtype: str, embedding_type: int = -1) -> None:
    """``f16`` quantized by llama.cpp to ``qtype`` (``embedding_type``: a GGML type for the table, -1: llama.cpp's)."""
    part = out.with_suffix(".part")
    run = subprocess.run([llama_python, "-c", QUANTIZE, str(f16), str(part), str(FTYPES[qtype]), str(embedding_type)],
                         capture_output=True, text=True)
    if run.returncode:
        raise RuntimeError(f"llama.cpp could not quantize {f16.name} to {qtype}:\n{run.stderr[-2000:]}")
    part.rename(out)


def make(where: Path, model: str, types: list[str], llama_python: str = LLAMA_PYTHON) -> dict[str, Path]:
    """The GGUFs of ``model``'s shapes in each of ``types`` under ``where``, written where missing."""
    from umakit.checkpoint.default import packaged_gguf

    where.mkdir(parents=True, exist_ok=True)
    files = {t: where / f"{model}-shaped.{t}.gguf" for t in types}
    missing = [t for t, f in files.items() if not f.exists()]
    if model == "smollm2-135m":  # a real model: the built-in Q4_1 file, re-quantized by llama.cpp
        for t in missing:
            quantize(llama_python, packaged_gguf(), files[t], t)
        return files
    if missing:
        f16 = where / f"{model}-shaped.F16.gguf"
        if not f16.exists():
            write_f16(f16.with_suffix(".part"), SHAPES[model], model, packaged_gguf())
            f16.with_suffix(".part").rename(f16)
        for t in missing:
            quantize(llama_python, f16, files[t], t)
    return files


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("dir", type=Path)
    ap.add_argument("--models", nargs="*", default=list(SHAPES), choices=[*SHAPES, "smollm2-135m"],
                    help="shapes to write, or smollm2-135m: the built-in model's weights (Q4_1) re-quantized")
    ap.add_argument("--types", nargs="*", default=["Q4_K_M", "Q5_K_M", "Q6_K", "Q8_0"], choices=FTYPES)
    ap.add_argument("--llama-python", default=LLAMA_PYTHON)
    args = ap.parse_args()
    if not Path(args.llama_python).exists():
        sys.exit(f"no {args.llama_python}: llama-cpp-python is llama.cpp's quantizer here (see cpu_engines.py)")
    for model in args.models:
        for path in make(args.dir, model, args.types, args.llama_python).values():
            print(path)


if __name__ == "__main__":
    main()
