"""`umakit batch`: a JSON Lines file of prompts in, one result line per prompt out."""

from __future__ import annotations

from pathlib import Path

import click

from umakit.backends.base import BATCH
from umakit.generate.batch import DEFAULT_BATCH_SIZE

from umakit.cli.flags import (SAMPLING_KEYS, batch_kv_needs, constraint_options, deterministic_option,
                              follow_unless_leader, kv_bits_option, load_draft, load_model,
                              lookup_needs, lookup_options, model_argument, model_options, offload_options,
                              parallel_option, read_constraint, sampling_options)
from umakit.cli.format import Progress


@click.command("batch")
@model_argument
@click.option("--input", "-i", "input_path", required=True, type=click.Path(exists=True, dir_okay=False, path_type=Path),
              help='JSON Lines: {"id": ..., "prompt": "..."} or {"id": ..., "messages": [...]}, plus per-item settings '
                   '(max_tokens, stop, seed, system, sampling fields, schema, regex, choices, grammar); or OpenAI\'s '
                   'batch file ({"custom_id": ..., "method": "POST", "url": "/v1/chat/completions", "body": {...}}).')
@click.option("--output", "-o", "output_path", required=True, type=click.Path(dir_okay=False, path_type=Path),
              help="Results are appended here as they finish; ids already in it are skipped (resume).")
@click.option("--batch-size", "-b", type=click.IntRange(min=1), default=DEFAULT_BATCH_SIZE, show_default=True,
              help="Prompts decoded together (lowered if their KV cache would not fit in memory).")
@click.option("--system", "-s", default=None, help="System prompt for items without their own.")
@click.option("--raw", is_flag=True, help="Send prompts as plain text, without the chat template.")
@click.option("--stop", multiple=True, help="Stop string (repeatable), for items without their own.")
@kv_bits_option
@lookup_options
@constraint_options(for_items=True)
@sampling_options
@model_options
@deterministic_option
@offload_options
@parallel_option
def batch_cmd(model, input_path, output_path, batch_size, system, raw, stop, kv_bits, prompt_lookup, draft, draft_tokens,
              ngram, json_schema, regex, choices, grammar, max_tokens, seed, backend, device, dtype, peak_bandwidth,
              deterministic, gpu_layers, vram_budget, parallel, **sampling):
    """Generate a reply to every prompt of a JSON Lines file, in batches."""
    from umakit.cli import batch_openai
    from umakit.generate import batch_io
    from umakit.core import fsutil, validate
    from umakit.generate.sampling import SamplingParams
    from umakit.generate.speculative import batch_lookup

    batch_lookup(prompt_lookup, draft_tokens, ngram, draft)  # checked before anything loads
    load = dict(backend=backend, device=device, dtype=dtype, peak_bandwidth=peak_bandwidth,
                needs={BATCH} | batch_kv_needs(kv_bits) | lookup_needs(prompt_lookup or draft is not None),
                gpu_layers=gpu_layers, vram_budget=vram_budget, deterministic=deterministic)
    follow_unless_leader(parallel, model, **load)  # a follower reads no input and writes no output
    batch_io.check_paths(input_path, output_path)
    lookup = dict(prompt_lookup=prompt_lookup, draft=draft, draft_tokens=draft_tokens, ngram=ngram)
    load["parallel"] = parallel
    if batch_openai.is_openai_file(input_path):  # OpenAI's batch lines: each body is a whole request
        batch_openai.refuse_body_flags(click.get_current_context())
        with fsutil.locked(output_path):
            batch_openai.run(model, input_path, output_path, batch_size, kv_bits, lookup, load)
        return
    system = None if system is None else validate.text(system, "--system")
    stop = tuple(validate.text(s, "--stop") for s in stop)
    params = SamplingParams().with_overrides(**{k: sampling[k] for k in SAMPLING_KEYS})
    settings = dict(max_tokens=max_tokens, stop=stop, seed=seed, system=system, sampling=params,
                    **read_constraint(json_schema, regex, choices, grammar))
    with fsutil.locked(output_path):  # a second batch onto the same output is refused, not interleaved
        _run(model, input_path, output_path, batch_size, raw, kv_bits, settings, load, lookup)


def _run(model, input_path, output_path, batch_size, raw, kv_bits, settings, load_kwargs, lookup) -> None:
    from umakit.generate import batch, batch_io
    from umakit.errors import InvalidArgumentError

    items, errors = batch_io.read_items(input_path)  # duplicate ids stop here, before anything runs
    done = batch_io.prepare_output(output_path)
    todo = [it for it in items if batch_io.id_key(it.id) not in done]
    if len(todo) < len(items):
        click.echo(f"{len(items) - len(todo)} of {len(items)} items already in {output_path}: skipped", err=True)
    checked = []
    for it in todo:  # every setting of every line is checked before the model loads
        try:
            batch.check_item(it.fields, **settings)
            checked.append(it)
        except InvalidArgumentError as e:
            errors.append(batch_io.LineError(it.line, str(e), it.id))
    todo = checked
    m = stream = None
    if todo:
        m = load_model(model, **load_kwargs)
        lookup = {**lookup, "draft": load_draft(m, lookup["draft"])}

    def skip(i, error):  # i indexes todo
        errors.append(batch_io.LineError(todo[i].line, str(error), todo[i].id))

    try:
        if m is not None:
            stream = batch.stream_batch(m, [it.fields for it in todo], batch_size=batch_size, raw=raw,
                                        kv_bits=kv_bits, on_error=skip, **settings, **lookup)
    finally:  # the skipped lines are reported even when the batch then cannot run
        _report(errors, output_path)
    if stream is not None and len(stream):
        if stream.note:
            click.echo(click.style(f"Note: {stream.note}", fg="yellow"), err=True)
        progress = Progress(len(stream))
        with m.engine.wired(), batch_io.ResultWriter(output_path) as out:
            for i, result in stream:
                out.write(batch_io.result_record(todo[i].id, result))
                progress.update(result.stats.generated_tokens)
        progress.close()
    if errors:
        raise click.ClickException(f"{len(errors)} input line(s) skipped; see {batch_io.errors_path(output_path)}")


def _report(errors, output_path) -> None:
    """Each skipped line on stderr, in input order, and in the errors file beside the output."""
    from umakit.generate import batch_io

    errors.sort(key=lambda e: e.line)
    for e in errors:
        click.echo(f"Skipped {e}", err=True)
    batch_io.write_errors(batch_io.errors_path(output_path), errors)
