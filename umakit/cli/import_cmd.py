"""`umakit import FILE.gguf -o DIR`: convert a GGUF into a model directory."""

from __future__ import annotations

import click

from umakit.cli.format import size


@click.command("import")
@click.argument("gguf_file", type=click.Path(dir_okay=False, path_type=str))
@click.option("--output", "-o", "out_dir", required=True, type=click.Path(file_okay=False), help="Directory to write.")
@click.option("--force", is_flag=True, help="Replace the output directory if it exists.")
def import_cmd(gguf_file, out_dir, force):
    """Convert a GGUF file into a directory `umakit load` serves."""
    from umakit.checkpoint.gguf import import_gguf

    report = import_gguf(gguf_file, out_dir, force=force)
    click.echo(f"Wrote {report.out_dir} ({size(report.bytes_written)}) in {report.seconds:.1f} s")
    click.echo(f"  {report.exact_tensors} tensors converted exactly")
    if report.lossy_tensors:
        click.echo(f"  {len(report.lossy_tensors)} tensors re-quantized (no exact MLX form):")
        for t in report.lossy_tensors:
            click.echo(f"    {t.name}: {t.from_type} -> {t.to_bits}-bit, max abs error {t.max_abs_err:.3g}")
    for warning in report.warnings:
        click.echo(f"Warning: {warning}", err=True)
