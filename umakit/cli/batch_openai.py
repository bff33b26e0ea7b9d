"""`umakit batch` on OpenAI's batch files: the lines' requests through the server's stack, in process."""

from __future__ import annotations

import asyncio
from pathlib import Path

import click

from umakit.cli.flags import SAMPLING_KEYS

# what a line's body sets for itself: these flags would change no answer, so given, they are refused by name
BODY_FLAGS = ("system", "raw", "stop", "json_schema", "regex", "choices", "grammar", "max_tokens", "seed",
              *SAMPLING_KEYS)


def is_openai_file(path: Path) -> bool:
    from umakit.serve import batch_file

    return batch_file.is_request_line(batch_file.first_line(path))


def refuse_body_flags(ctx: click.Context) -> None:
    """A usage error naming the first sampling, prompt or constraint flag given: each body carries its own."""
    for name in BODY_FLAGS:
        source = ctx.get_parameter_source(name)
        if source is not None and source.name not in ("DEFAULT", "DEFAULT_MAP"):
            flag = next(p.opts[0] for p in ctx.command.params if p.name == name)
            raise click.UsageError(f"{flag} does not apply to an OpenAI batch file: each line's body sets its own "
                                   "(give it there)")


def run(model, input_path: Path, output_path: Path, batch_size: int, kv_bits, lookup: dict, load: dict) -> None:
    """Answer every request line not yet in ``output_path``; failed ones go to the errors file beside it."""
    from umakit.cli.format import Progress
    from umakit.cli.flags import load_draft, load_model
    from umakit.generate import batch_io
    from umakit.generate.speculative import batch_lookup
    from umakit.serve import batch_file
    from umakit.serve.scheduler import Scheduler
    from umakit.serve.types import SchedulerSettings

    lines, bad = batch_file.read(input_path)  # a repeated custom_id stops here, before anything runs
    done = batch_io.prepare_output(output_path, key="custom_id")
    todo = [line for line in lines if batch_io.id_key(line.custom_id) not in done]
    if len(todo) < len(lines):
        click.echo(f"{len(lines) - len(todo)} of {len(lines)} requests already in {output_path}: skipped", err=True)
    failed = [(n, batch_file.envelope_error(custom_id, f"line {n}: {why}")) for n, custom_id, why in bad]
    for n, _, why in bad:
        click.echo(f"Skipped line {n}: {why}", err=True)
    try:
        if todo:
            m = load_model(model, **load)
            lookup = batch_lookup(lookup["prompt_lookup"], lookup["draft_tokens"], lookup["ngram"],
                                  load_draft(m, lookup["draft"]), m)
            # no stream waits on a slice: each prompt prefills whole between two steps, as in a batch of items,
            # with no budget to measure (1.1x the throughput of the server's measured one on the built-in model)
            settings = SchedulerSettings(max_concurrency=batch_size, max_queue=2 * batch_size, request_timeout_s=None,
                                         kv_bits=kv_bits, lookup=lookup, step_tokens=SchedulerSettings.prefill_chunk)
            _answer(m, Scheduler(m, settings), todo, output_path, batch_size, failed, Progress(len(todo)))
    finally:  # in input order
        batch_io.write_errors(batch_io.errors_path(output_path), [rec for _, rec in sorted(failed, key=lambda x: x[0])])
    if failed:
        raise click.ClickException(f"{len(failed)} request(s) failed; see {batch_io.errors_path(output_path)}")


def _answer(m, scheduler, todo, output_path, batch_size, failed, progress) -> None:
    from umakit.generate import batch_io
    from umakit.serve import batch_file

    def finished(line, rec) -> None:
        if rec["response"]["status_code"] == 200:
            out.write(rec)
        else:
            failed.append((line.line, rec))
            message = rec["response"]["body"].get("error", {}).get("message", "")
            click.echo(("\r\x1b[K" if progress.tty else "") + f"Failed line {line.line} ({line.custom_id}): {message}",
                       err=True)
        progress.update(batch_file.usage_tokens(rec["response"]["body"]))

    scheduler.start()
    try:
        with m.engine.wired(), batch_io.ResultWriter(output_path) as out:
            asyncio.run(batch_file.run(m, scheduler, todo, finished, in_flight=2 * batch_size))
    finally:
        scheduler.stop()
        progress.close()
