"""`umakit generate`: one prompt in, streamed text out, stats on stderr."""

from __future__ import annotations

import json
import os
import sys

import click

from umakit.cli.format import stats_line
from umakit.cli.flags import (
    SAMPLING_KEYS,
    constraint_options,
    deterministic_option,
    follow_unless_leader,
    kv_bits_option,
    kv_needs,
    load_model,
    load_draft,
    model_options,
    offload_options,
    parallel_option,
    quantize_option,
    read_constraint,
    sampling_options,
    server_option,
    speculative_options,
)


@click.command()
@click.option("--model", "-m", default=None, help="Model directory, .gguf file or Hub repo id (default: built-in SmolLM2-135M).")
@click.argument("words", metavar="[MODEL] [PROMPT]", nargs=-1)
@click.option("--prompt", "-p", default=None, help="The prompt (or PROMPT); '-' reads it from stdin.")
@click.option("--system", "-s", default=None, help="System prompt.")
@click.option("--raw", is_flag=True, help="Send the prompt as plain text, without the chat template.")
@click.option("--stop", multiple=True, help="Stop string (repeatable); it is not printed.")
@kv_bits_option
@constraint_options()
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object (text, tokens, finish reason, stats).")
@server_option("Send the prompt to the umakit server here when one answers")
@click.option("--no-server", is_flag=True, help="Load the model in this process even when a server answers.")
@sampling_options
@model_options
@deterministic_option
@offload_options
@quantize_option
@speculative_options
@parallel_option
def generate(model, words, prompt, system, raw, stop, kv_bits, json_schema, regex, choices, grammar, as_json,
             server_url, no_server, max_tokens, seed, backend, device, dtype, peak_bandwidth, deterministic, gpu_layers,
             vram_budget, quantize, draft, draft_tokens, prompt_lookup, ngram, parallel, **sampling):
    """Generate a reply to one prompt: `umakit generate [MODEL] PROMPT`, or with -m and -p.

    When a umakit server answers at --server (and no flag asks for how this process loads or runs the model:
    an engine option, --kv-bits, --quantize, offload, speculation, --deterministic, --json), the prompt goes
    there, where the model may be loaded already; else, or with --no-server, the model loads here."""
    from umakit.core import validate

    model, prompt = _model_and_prompt(words, model, prompt)
    load = dict(backend=backend, device=device, dtype=dtype, peak_bandwidth=peak_bandwidth, quantize=quantize,
                needs=kv_needs(kv_bits), gpu_layers=gpu_layers, vram_budget=vram_budget, deterministic=deterministic)
    follow_unless_leader(parallel, model, **load)  # a follower reads no input
    # Everything the user typed is checked before the model loads: no error after a reply.
    prompt = validate.decode_utf8(sys.stdin.buffer.read(), "stdin") if prompt == "-" else validate.text(prompt, "--prompt")
    system = None if system is None else validate.text(system, "--system")
    stop = tuple(validate.text(s, "--stop") for s in stop)
    constraint = read_constraint(json_schema, regex, choices, grammar)
    local_only = (kv_bits, quantize, gpu_layers, vram_budget, draft, parallel, device, peak_bandwidth,
                  deterministic or None)
    if not no_server and not as_json and not prompt_lookup and all(v is None for v in local_only) \
            and backend == "auto" and dtype == "auto" and _attached(server_url, model, prompt, system, raw, max_tokens,
                                                                    stop, seed, sampling, constraint):
        return
    from umakit.generate.stream import collect

    m = load_model(model, parallel=parallel, **load)
    m.device_info  # the stats line needs it: a probe whose cache cannot be written fails here, before any reply
    chunks = m.stream(prompt, system=system, raw=raw, max_tokens=max_tokens, stop=stop, seed=seed, kv_bits=kv_bits,
                      draft=load_draft(m, draft), draft_tokens=draft_tokens, prompt_lookup=prompt_lookup, ngram=ngram,
                      **constraint, **{k: sampling[k] for k in SAMPLING_KEYS})
    with m.engine.wired():
        if as_json:
            result = collect(chunks)
            out = {"model": m.info.name, "backend": m.info.backend, "device": m.info.device, **result.to_dict()}
            click.echo(json.dumps(out, ensure_ascii=False))
            return
        for chunk in chunks:
            click.echo(chunk.text, nl=False)
            if chunk.stats is not None:
                click.echo()
                click.echo(f"[{chunk.finish_reason}] " + stats_line(chunk.stats), err=True)


def _attached(url, model, prompt, system, raw, max_tokens, stop, seed, sampling, constraint) -> bool:
    """Run the prompt on the server at ``url``, if one answers and serves the model; False: it did not."""
    from umakit.cli import attach

    if not attach.server_at(url):
        return False
    reply = attach.stream(url, attach.served_name(model), prompt, system=system, raw=raw, max_tokens=max_tokens,
                          stop=stop, seed=seed, sampling={k: sampling[k] for k in SAMPLING_KEYS},
                          constraint=constraint, api_key=attach.api_key())
    if reply is None:  # the server does not serve this model: load it here
        return False
    for text in reply:
        click.echo(text, nl=False)
    click.echo()
    click.echo(f"[{reply.finish}] " + attach.stats_line(reply), err=True)
    return True


def _model_and_prompt(words: tuple[str, ...], model: str | None, prompt: str | None) -> tuple[str | None, str]:
    """MODEL and PROMPT as arguments, or with -m and -p, each exactly once. One argument is the prompt, or the
    model where -p gives the prompt; a lone argument that is a path on disk is a model missing its prompt."""
    if len(words) > 2:
        raise click.UsageError(f"{len(words)} arguments given: generate takes [MODEL] PROMPT "
                               "(quote a prompt of several words)")
    if len(words) == 1 and prompt is not None and model is None:  # `generate MODEL -p PROMPT`
        words = (words[0], None)
    if len(words) == 2:
        if model is not None and model != words[0]:
            raise click.UsageError(f"two models given, {words[0]!r} and -m {model!r}: give one")
        model, words = words[0], words[1:] if words[1] is not None else ()
    argument = words[0] if words else None
    if argument is not None and prompt is not None:
        raise click.UsageError("two prompts given, PROMPT and -p/--prompt: give one")
    if argument is None and prompt is None:
        raise click.UsageError("no prompt: give it as PROMPT or with -p/--prompt ('-' reads it from stdin)")
    if argument is not None and model is None and os.path.exists(argument):
        raise click.UsageError(f"{argument!r} is a model on disk, not a prompt: give the prompt too "
                               f"(umakit generate {argument} PROMPT)")
    return model, argument if argument is not None else prompt
