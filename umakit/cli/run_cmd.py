"""`umakit run`: chat with a model in the terminal (or answer piped lines)."""

from __future__ import annotations

import sys

import click

from umakit.cli.chat_ui import Repl
from umakit.cli.format import size
from umakit.cli.flags import (
    SAMPLING_KEYS,
    deterministic_option,
    follow_unless_leader,
    kv_bits_option,
    kv_needs,
    load_draft,
    load_model,
    model_argument,
    model_options,
    offload_options,
    parallel_option,
    quantize_option,
    sampling_options,
    server_option,
    speculative_options,
)


@click.command("run")
@model_argument
@click.argument("prompt", required=False)
@click.option("--system", "-s", default=None, help="System prompt.")
@click.option("--max-context", type=click.IntRange(min=16), default=None,
              help="Context limit in tokens (default: the model's); oldest turns are dropped beyond it.")
@kv_bits_option
@click.option("--stats/--no-stats", default=None, help="Stats footer after each reply (default: on in a terminal).")
@server_option("Chat through the umakit server here when one answers")
@click.option("--no-server", is_flag=True, help="Load the model in this process even when a server answers.")
@sampling_options
@model_options
@deterministic_option
@offload_options
@quantize_option
@speculative_options
@parallel_option
def run(model, prompt, system, max_context, kv_bits, stats, server_url, no_server, max_tokens, seed, backend, device,
        dtype, peak_bandwidth, deterministic, gpu_layers, vram_budget, quantize, draft, draft_tokens, prompt_lookup,
        ngram, parallel, **sampling):
    """Chat with MODEL (default: the built-in SmolLM2-135M-Instruct); with PROMPT, answer it once and exit
    (text piped in is added to it after a blank line: `cat notes.txt | umakit run MODEL "Summarize this"`).

    When a umakit server answers at --server (and no flag asks for how this process loads or runs the model:
    an engine option, --max-context, --kv-bits, --quantize, offload, speculation, --deterministic), the chat runs
    there, where the model may be loaded already; else, or with --no-server, the model loads here."""
    from umakit.generate.sampling import SamplingParams
    from umakit.generate.transcript import ChatSettings

    load = dict(backend=backend, device=device, dtype=dtype, peak_bandwidth=peak_bandwidth, quantize=quantize,
                needs=kv_needs(kv_bits), gpu_layers=gpu_layers, vram_budget=vram_budget, deterministic=deterministic)
    follow_unless_leader(parallel, model, **load)  # a follower reads no input
    once = None if prompt is None else _one_message(prompt)  # read and checked before the model loads
    tty = sys.stdin.isatty() and sys.stdout.isatty()
    settings = ChatSettings(system=system, max_tokens=max_tokens, max_context=max_context, kv_bits=kv_bits, seed=seed,
                            sampling=SamplingParams(**{k: sampling[k] for k in SAMPLING_KEYS}))
    local_only = (max_context, kv_bits, quantize, gpu_layers, vram_budget, draft, parallel, device, peak_bandwidth,
                  deterministic or None)
    if not no_server and not prompt_lookup and all(v is None for v in local_only) and backend == "auto" \
            and dtype == "auto":
        remote = _attached(server_url, model, settings)
        if remote is not None:
            return _chat(Repl(remote, color=tty, show_stats=tty if stats is None else stats),
                         f"{remote.model_name} · served by {remote.url} · /help for commands", once)
    from umakit.generate.chat import ChatSession

    m = load_model(model, show_progress=tty, parallel=parallel, **load)
    speculator = m.speculator(draft=load_draft(m, draft), draft_tokens=draft_tokens, prompt_lookup=prompt_lookup,
                              ngram=ngram)
    session = ChatSession(m, settings, speculator=speculator)
    repl = Repl(session, color=tty, show_stats=tty if stats is None else stats)
    i, w = m.info, m.info.weights
    offload = ""
    if i.offload:
        offload = (f"{i.offload.gpu_layers}/{i.offload.layers} layers on {i.device}, "
                   f"{size(i.offload.streamed_bytes)} streamed per token · ")
    with m.engine.wired():
        _chat(repl, f"{i.name} · {i.backend}/{i.device} {i.dtype}{' (deterministic)' if i.deterministic else ''} · "
                    f"{w.quantization} · context "
                    f"{session.settings.max_context} · weights {size(w.total_bytes)} · {offload}loaded in "
                    f"{i.load_s:.1f} s · /help for commands", once)


def _one_message(prompt: str) -> str:
    """PROMPT, and after a blank line whatever text is piped in."""
    from umakit.core import validate

    text = validate.text(prompt, "PROMPT")
    if not sys.stdin.isatty():
        piped = validate.decode_utf8(sys.stdin.buffer.read(), "stdin")
        if piped.strip():
            text = f"{text}\n\n{piped.rstrip()}"
    return text


def _chat(repl: Repl, banner: str, once: str | None = None) -> None:
    """A PROMPT: its one reply; piped input: one message a line; a terminal: the banner, then the chat."""
    if once is not None:
        with repl.rescuing():
            repl.reply_once(once)
        return
    if not sys.stdin.isatty():
        if not repl.piped(sys.stdin.buffer):
            sys.exit(1)  # each failed line has had its Error: line
        return
    click.echo(click.style(banner, dim=True), err=True)
    repl.interactive()


def _attached(url: str, model: str | None, settings):
    """A chat through the server at ``url`` when one answers and serves the model, else None."""
    from umakit.cli import attach
    from umakit.cli.remote_chat import RemoteChat

    return RemoteChat.connect(url, attach.served_name(model), settings, api_key=attach.api_key())
