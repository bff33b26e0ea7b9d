"""`umakit run`: chat with a model in the terminal (or answer piped lines)."""

from __future__ import annotations

import sys

import click

from umakit.cli.chat_ui import Repl
from umakit.cli.format import size
from umakit.cli.flags import (
    SAMPLING_KEYS,
    follow_unless_leader,
    kv_bits_option,
    kv_needs,
    load_draft,
    load_model,
    model_options,
    offload_options,
    parallel_option,
    quantize_option,
    sampling_options,
    speculative_options,
)


@click.command("run")
@click.argument("model", required=False)
@click.option("--system", "-s", default=None, help="System prompt.")
@click.option("--max-context", type=click.IntRange(min=16), default=None,
              help="Context limit in tokens (default: the model's); oldest turns are dropped beyond it.")
@kv_bits_option
@click.option("--stats/--no-stats", default=None, help="Stats footer after each reply (default: on in a terminal).")
@sampling_options
@model_options
@offload_options
@quantize_option
@speculative_options
@parallel_option
def run(model, system, max_context, kv_bits, stats, max_tokens, seed, backend, device, dtype, peak_bandwidth,
        gpu_layers, vram_budget, quantize, draft, draft_tokens, prompt_lookup, ngram, parallel, **sampling):
    """Chat with MODEL (default: the built-in SmolLM2-135M-Instruct)."""
    import umakit
    from umakit.generate.chat import ChatSession, ChatSettings

    load = dict(backend=backend, device=device, dtype=dtype, peak_bandwidth=peak_bandwidth, quantize=quantize,
                needs=kv_needs(kv_bits), gpu_layers=gpu_layers, vram_budget=vram_budget)
    follow_unless_leader(parallel, model, **load)  # a follower reads no input
    tty = sys.stdin.isatty() and sys.stdout.isatty()
    m = load_model(model, show_progress=tty, parallel=parallel, **load)
    settings = ChatSettings(system=system, max_tokens=max_tokens, max_context=max_context, kv_bits=kv_bits, seed=seed,
                            sampling=umakit.SamplingParams(**{k: sampling[k] for k in SAMPLING_KEYS}))
    speculator = m.speculator(draft=load_draft(m, draft), draft_tokens=draft_tokens, prompt_lookup=prompt_lookup,
                              ngram=ngram)
    session = ChatSession(m, settings, speculator=speculator)
    repl = Repl(session, color=tty, show_stats=tty if stats is None else stats)
    with m.engine.wired():
        if not sys.stdin.isatty():
            if not repl.piped(sys.stdin.buffer):
                sys.exit(1)  # each failed line has had its Error: line
            return
        i, w = m.info, m.info.weights
        offload = ""
        if i.offload:
            offload = (f"{i.offload.gpu_layers}/{i.offload.layers} layers on {i.device}, "
                       f"{size(i.offload.streamed_bytes)} streamed per token · ")
        click.echo(click.style(
            f"{i.name} · {i.backend}/{i.device} {i.dtype} · {w.quantization} · context {session.settings.max_context} · "
            f"weights {size(w.total_bytes)} · {offload}loaded in {i.load_s:.1f} s · /help for commands", dim=True),
            err=True)
        repl.interactive()
