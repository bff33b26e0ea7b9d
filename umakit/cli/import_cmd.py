"""`umakit import SOURCE -o DIR`: a GGUF file, or a GPTQ, AWQ or compressed-tensors checkpoint, as a model
directory in MLX's layout."""

from __future__ import annotations

from pathlib import Path

import click

from umakit.cli.format import size

NAMES = {"gptq": "GPTQ", "awq": "AWQ", "compressed-tensors": "compressed-tensors"}


@click.command("import")
@click.argument("source", type=click.Path(path_type=str))
@click.option("--output", "-o", "out_dir", required=True, type=click.Path(file_okay=False), help="Directory to write.")
@click.option("--force", is_flag=True, help="Replace the output directory if it exists.")
def import_cmd(source, out_dir, force):
    """Convert a GGUF file, or a GPTQ, AWQ or compressed-tensors checkpoint directory, into a directory every
    engine loads (a model given by its path is imported this way on first use, into umakit's cache)."""
    from umakit.cli.flags import ImportBar

    bar = ImportBar(source, note="")
    if Path(source).is_dir():
        from umakit.checkpoint.hfquant import import_checkpoint

        try:
            r = import_checkpoint(source, out_dir, force=force, progress=bar)
        finally:
            bar.close()
        click.echo(f"Wrote {r.out_dir} ({size(r.bytes_written)}) in {r.seconds:.1f} s")
        click.echo(f"  {r.layers} layers converted exactly from {NAMES[r.method]} {r.bits}-bit groups "
                   f"(MLX groups of {r.group})")
        return
    from umakit.checkpoint.gguf import import_gguf

    try:
        report = import_gguf(source, out_dir, force=force, progress=bar)
    finally:
        bar.close()
    click.echo(f"Wrote {report.out_dir} ({size(report.bytes_written)}) in {report.seconds:.1f} s")
    click.echo(f"  {report.exact_tensors} tensors converted exactly")
    if report.lossy_tensors:
        click.echo(f"  {len(report.lossy_tensors)} tensors re-quantized (no exact MLX form):")
        for t in report.lossy_tensors:
            click.echo(f"    {t.name}: {t.from_type} -> {t.to_bits}-bit, max abs error {t.max_abs_err:.3g}")
    if report.exact16:
        click.echo(f"  {len(report.exact16)} of them also kept exactly, in groups of 16, for the torch engine's "
                   "CPU kernel")
    for warning in report.warnings:
        click.echo(f"Warning: {warning}", err=True)
