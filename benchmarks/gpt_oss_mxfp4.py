"""gpt-oss's MXFP4 experts on a CPU: umakit's packed forms against transformers' own CPU path, in one run.

    python benchmarks/gpt_oss_mxfp4.py [--layers 2] [--tokens 32] [--threads 2] [--mlx] [--no-transformers]

A random checkpoint in OpenAI's layout with gpt-oss-20b's widths (hidden 2880, 32 experts of 2880, 4 routed a
token, 64 query and 8 key-value heads of 64; a 32,000-token vocabulary instead of 201,088, the embedding not
being what is measured) and ``--layers`` of its 24 layers, the experts in MXFP4 (random codes, exponents around
gpt-oss's), the rest bfloat16. Each way in a process of its own: the load's seconds, peak resident memory
(VmHWM), and decode tok/s of ``--tokens`` greedy tokens after a 16-token prompt (and, for umakit's engines, of
8 rows decoded together, tok/s summed over the rows):

- umakit's torch engine (the default on a CPU, ``--backend torch``): umakit's compact gpt-oss code, each expert
  its own packed layer of exact 5-bit codes on umakit's affine kernel; loaded twice, the second load reading the
  packing the first kept;
- umakit's transformers engine (``--backend transformers``): transformers' model classes, each expert's
  projections the same packed layers; loaded twice likewise;
- transformers 5 itself, ``Mxfp4Config(dequantize=True)`` in bfloat16: what it does on a CPU, where its packed
  MXFP4 kernels (Triton, fetched from the Hub) do not run;
- with ``--mlx``, umakit on MLX (its ``mxfp4`` mode; MLX on x86 Linux is single-threaded).

Prints a markdown table and writes it to benchmarks/out/gpt_oss_mxfp4.md.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from datetime import date
from pathlib import Path

import runs

OUT = Path(__file__).parent / "out" / "gpt_oss_mxfp4.md"
HIDDEN, EXPERTS, HEADS, KV, HEAD_DIM, VOCAB = 2880, 32, 64, 8, 64, 32000
PROMPT = runs.PROMPT
BACKENDS = {"umakit-compact": "torch", "umakit-torch": "transformers", "umakit-mlx": "mlx"}


def write_checkpoint(path: Path, layers: int) -> None:
    """OpenAI's layout, written tensor by tensor (never the whole model in float)."""
    import torch
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(0)
    bf = dict(dtype=torch.bfloat16)
    tensors = {"model.embed_tokens.weight": (torch.randn(VOCAB, HIDDEN, generator=g) * 0.02).to(**bf),
               "lm_head.weight": (torch.randn(VOCAB, HIDDEN, generator=g) * 0.02).to(**bf),
               "model.norm.weight": torch.ones(HIDDEN, **bf)}
    for i in range(layers):
        p = f"model.layers.{i}."
        shapes = {"q_proj": HEADS * HEAD_DIM, "k_proj": KV * HEAD_DIM, "v_proj": KV * HEAD_DIM}
        for name, rows in shapes.items():
            tensors[p + f"self_attn.{name}.weight"] = (torch.randn(rows, HIDDEN, generator=g) * 0.02).to(**bf)
            tensors[p + f"self_attn.{name}.bias"] = torch.zeros(rows, **bf)
        tensors[p + "self_attn.o_proj.weight"] = (torch.randn(HIDDEN, HEADS * HEAD_DIM, generator=g) * 0.02).to(**bf)
        tensors[p + "self_attn.o_proj.bias"] = torch.zeros(HIDDEN, **bf)
        tensors[p + "self_attn.sinks"] = torch.zeros(HEADS, **bf)
        tensors[p + "input_layernorm.weight"] = torch.ones(HIDDEN, **bf)
        tensors[p + "post_attention_layernorm.weight"] = torch.ones(HIDDEN, **bf)
        tensors[p + "mlp.router.weight"] = (torch.randn(EXPERTS, HIDDEN, generator=g) * 0.02).to(**bf)
        tensors[p + "mlp.router.bias"] = torch.zeros(EXPERTS, **bf)
        for name, rows, cols in (("gate_up_proj", 2 * HIDDEN, HIDDEN), ("down_proj", HIDDEN, HIDDEN)):
            # random nibbles, exponents 2^-8..2^-5 (scale bytes 119..122): weights of about gpt-oss's size
            tensors[p + f"mlp.experts.{name}_blocks"] = torch.randint(0, 256, (EXPERTS, rows, cols // 32, 16),
                                                                      generator=g, dtype=torch.uint8)
            tensors[p + f"mlp.experts.{name}_scales"] = torch.randint(119, 123, (EXPERTS, rows, cols // 32),
                                                                      generator=g, dtype=torch.uint8)
            tensors[p + f"mlp.experts.{name}_bias"] = torch.zeros(EXPERTS, rows, **bf)
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    config = dict(
        architectures=["GptOssForCausalLM"], model_type="gpt_oss", vocab_size=VOCAB, hidden_size=HIDDEN,
        intermediate_size=HIDDEN, num_hidden_layers=layers, num_attention_heads=HEADS, num_key_value_heads=KV,
        head_dim=HEAD_DIM, num_local_experts=EXPERTS, num_experts_per_tok=4, experts_per_token=4,
        sliding_window=128, layer_types=["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)],
        max_position_embeddings=131072, rms_norm_eps=1e-5, attention_bias=True, swiglu_limit=7.0,
        tie_word_embeddings=False, torch_dtype="bfloat16", bos_token_id=1, eos_token_id=2, pad_token_id=0,
        rope_scaling={"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                      "original_max_position_embeddings": 4096}, rope_theta=150000.0,
        quantization_config={"quant_method": "mxfp4", "modules_to_not_convert": [
            "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]})
    (path / "config.json").write_text(json.dumps(config, indent=1))
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from support.tiny import write_tokenizer

    write_tokenizer(path)  # a small BPE: the prompt's ids are what is fed


def peak_rss() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return 0


def worker(args) -> dict:
    import torch

    torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    if args.worker == "transformers":
        import transformers

        model = transformers.AutoModelForCausalLM.from_pretrained(
            args.path, dtype=torch.bfloat16, quantization_config=transformers.Mxfp4Config(dequantize=True)).eval()
        load = time.perf_counter() - t0
        ids = torch.tensor([PROMPT])
        with torch.no_grad():
            out = model(ids, use_cache=True)
            cache, token = out.past_key_values, out.logits[:, -1:].argmax(-1)
            t = time.perf_counter()
            for _ in range(args.tokens):
                out = model(token, past_key_values=cache, use_cache=True)
                cache, token = out.past_key_values, out.logits[:, -1:].argmax(-1)
        decode = args.tokens / (time.perf_counter() - t)
    else:
        import umakit

        model = umakit.load(args.path, backend=BACKENDS[args.worker], device="cpu")
        load = time.perf_counter() - t0
        decode, rows = runs.decode_rates(model.engine, args.tokens)
        return dict(load=load, decode=decode, rows=rows, peak=peak_rss())
    return dict(load=load, decode=decode, rows=None, peak=peak_rss())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--mlx", action="store_true", help="umakit on MLX too (single-threaded on x86)")
    ap.add_argument("--no-transformers", action="store_true", help="leave transformers' own CPU path out")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--path", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        print(json.dumps(worker(args)))
        return
    # umakit's torch-side engines twice: a first load packs the experts and keeps the packing under $UMAKIT_HOME (a
    # folder of this run's), the second reads it
    ways = (["umakit-compact", "umakit-compact", "umakit-torch", "umakit-torch"]
            + ([] if args.no_transformers else ["transformers"]) + (["umakit-mlx"] if args.mlx else []))
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "gpt-oss-shaped"
        write_checkpoint(path, args.layers)
        size = (path / "model.safetensors").stat().st_size
        env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "UMAKIT_HOME": str(Path(tmp) / "home")}
        # the kernel library is built once per $UMAKIT_HOME: built here, outside the timings
        subprocess.run([sys.executable, "-c", "from umakit.backends.torch.cpu import build; build.ensure()"],
                       env=env, check=True)
        for way in ways:
            run = subprocess.run([sys.executable, __file__, "--worker", way, "--path", str(path), "--tokens",
                                  str(args.tokens), "--threads", str(args.threads)], capture_output=True, text=True,
                                 env=env)
            if run.returncode != 0:
                print(f"{way} failed:\n{run.stderr[-2000:]}", file=sys.stderr)
                continue
            r = json.loads(run.stdout.strip().splitlines()[-1])
            print(f"  {way}: load {r['load']:.1f} s, decode {r['decode']:.2f} tok/s, 8 rows {r['rows'] or 0:.2f} "
                  f"tok/s, peak {r['peak'] >> 20} MB", file=sys.stderr)
            rows.append((way + (", packing kept" if any(w == way for w, _ in rows) else ""), r))
    lines = [f"gpt-oss-20b's widths, {args.layers} of its 24 layers, MXFP4 experts ({size >> 20} MB checkpoint), "
             f"{date.today()}, {platform.processor() or platform.machine()}, {args.threads} threads, "
             f"{args.tokens} greedy tokens after 16.", "",
             "| way | load s | decode tok/s | 8 rows, tok/s summed | peak RSS MB |", "|---|---:|---:|---:|---:|"]
    names = {"umakit-compact": "umakit, torch engine (compact code, packed 5-bit experts), first load",
             "umakit-compact, packing kept": "umakit, torch engine, a later load (the packing kept)",
             "umakit-torch": "umakit, transformers engine (packed 5-bit experts), first load",
             "umakit-torch, packing kept": "umakit, transformers engine, a later load (the packing kept)",
             "transformers": "transformers, Mxfp4Config(dequantize=True), bfloat16",
             "umakit-mlx": "umakit, MLX (mxfp4 mode, CPU)"}
    lines += [f"| {names[w]} | {r['load']:.1f} | {r['decode']:.2f} | "
              f"{'-' if r['rows'] is None else format(r['rows'], '.2f')} | {r['peak'] >> 20} |" for w, r in rows]
    runs.publish(lines, OUT)


if __name__ == "__main__":
    main()
