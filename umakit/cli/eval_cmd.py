"""`umakit eval`: perplexity of a model on a text file or a cached corpus."""

from __future__ import annotations

import json
from pathlib import Path

import click

from umakit.core.affine import KV_BITS
from umakit.evaluate.corpora import CORPORA, DEFAULT_TOKENS, FETCH_COMMAND
from umakit.evaluate.perplexity import DEFAULT_CHUNK, DEFAULT_WINDOW

from umakit.cli.flags import kv_needs, load_model, model_argument, model_options

FLOAT_CACHE = "float"  # --kv-bits: one cache in the compute dtype, unquantized


@click.command("eval")
@model_argument
@click.option("--text", "text_file", type=click.Path(exists=True, dir_okay=False, path_type=Path),
              help="Text file to score.")
@click.option("--corpus", type=click.Choice(list(CORPORA)), help=f"A cached corpus ({FETCH_COMMAND}).")
@click.option("--window", type=click.IntRange(min=2), default=DEFAULT_WINDOW, show_default=True,
              help="Tokens per forward pass.")
@click.option("--stride", type=click.IntRange(min=1), default=None,
              help="Tokens between window starts (default: the window); below it, every scored token "
                   "keeps window-stride tokens of context.")
@click.option("--max-tokens", type=click.IntRange(min=2), default=None,
              help=f"Score only the first N tokens (default with --corpus: {DEFAULT_TOKENS}).")
@click.option("--kv-bits", type=click.Choice([FLOAT_CACHE, *(str(b) for b in sorted(KV_BITS, reverse=True))]),
              default=None,
              help="Feed the whole text through one KV cache (float or quantized) instead of windows.")
@click.option("--bos-per-window/--no-bos-per-window", default=None,
              help="Start every window with the BOS (default: when the tokenizer adds one); "
                   "--no-bos-per-window puts it before the first window only.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
@model_options
def eval_cmd(model, text_file, corpus, window, stride, max_tokens, kv_bits, bos_per_window, as_json, backend, device,
             dtype, peak_bandwidth):
    """Perplexity of MODEL (default: the built-in model) on --text FILE or --corpus NAME."""
    from umakit.evaluate.corpora import load_corpus
    from umakit.evaluate.perplexity import kv_perplexity, perplexity

    if (text_file is None) == (corpus is None):
        raise click.UsageError("give exactly one of --text FILE or --corpus NAME")
    if corpus and max_tokens is None:
        max_tokens = DEFAULT_TOKENS
    from umakit.core import validate

    # a token is rarely 8 characters: read no more of a corpus than the tokens need
    text = validate.read_text(text_file, "text file") if text_file else load_corpus(corpus, max_chars=8 * max_tokens)
    bits = None if kv_bits in (None, FLOAT_CACHE) else int(kv_bits)
    m = load_model(model, backend=backend, device=device, dtype=dtype, peak_bandwidth=peak_bandwidth,
                   needs=kv_needs(bits))
    if kv_bits is None:
        r = perplexity(m, text, window=window, stride=stride, max_tokens=max_tokens, bos_per_window=bos_per_window)
        how = f"windows of {r.window}, stride {r.stride}" + (", BOS per window" if r.bos_per_window else "")
    else:
        r = kv_perplexity(m, text, kv_bits=bits, chunk=DEFAULT_CHUNK, max_tokens=max_tokens)
        how = f"one {kv_bits}{'-bit' if bits else ''} KV cache, {r.cache_bytes_per_token:,.0f} cache bytes/token"
    source = str(text_file) if text_file else corpus
    if as_json:
        out = {"model": m.info.name, "text": source, "tokens": r.tokens, "nll": r.nll, "ppl": r.ppl,
               "seconds": r.seconds, "window": r.window, "stride": r.stride, "bos_per_window": r.bos_per_window}
        if kv_bits is not None:
            out |= {"kv_bits": kv_bits, "cache_bytes_per_token": r.cache_bytes_per_token}
        click.echo(json.dumps(out))
        return
    click.echo(f"perplexity {r.ppl:.3f} (nll {r.nll:.4f}) on {r.tokens} tokens of {source}; {how}; "
               f"{r.tokens_per_s:.1f} tok/s")
