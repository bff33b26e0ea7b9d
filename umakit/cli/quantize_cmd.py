"""`umakit quantize`: write an MLX-quantized copy of a float checkpoint."""

from __future__ import annotations

import json
from pathlib import Path

import click

from umakit.core.affine import BITS, DEFAULT_BITS, DEFAULT_GROUP_SIZE, GROUP_SIZES
from umakit.quantize.recipes import DEFAULT_RECIPE, RECIPES

from umakit.cli.format import size


@click.command("quantize")
@click.argument("src")
@click.option("--output", "-o", "dst", required=True, type=click.Path(path_type=Path), help="Directory to write.")
@click.option("--bits", type=click.Choice([str(b) for b in BITS]), default=str(DEFAULT_BITS), show_default=True)
@click.option("--group-size", type=click.Choice([str(g) for g in GROUP_SIZES]), default=str(DEFAULT_GROUP_SIZE),
              show_default=True, help="Weights sharing one scale and bias.")
@click.option("--recipe", type=click.Choice(list(RECIPES)), default=DEFAULT_RECIPE, show_default=True,
              help="; ".join(f"{r.name}: {r.description}" for r in RECIPES.values()))
@click.option("--force", is_flag=True, help="Replace OUTPUT if it exists.")
@click.option("--eval", "eval_file", type=click.Path(exists=True, dir_okay=False, path_type=Path),
              help="Text file: report perplexity before and after.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
def quantize_cmd(src, dst, bits, group_size, recipe, force, eval_file, as_json):
    """Quantize the float checkpoint SRC (directory or Hub id) into OUTPUT, mlx-lm's layout."""
    from umakit.quantize.pipeline import quantize

    from umakit.core import validate

    text = validate.read_text(eval_file, "text file") if eval_file else None
    r = quantize(src, dst, bits=int(bits), group_size=int(group_size), recipe=recipe, force=force, eval_text=text)
    out = {
        "dst": str(r.dst), "bits": r.bits, "group_size": r.group_size, "recipe": r.recipe,
        "layers": {f"{b}-bit": n for b, n in r.layers.items()}, "float_layers": r.float_layers,
        "source_bytes": r.source_bytes, "bytes": r.bytes, "bits_per_weight": round(r.bits_per_weight, 3),
        "notes": r.notes, "seconds": round(r.seconds, 2),
    }
    if r.ppl_change is not None:
        out |= {"ppl_before": r.ppl_before.ppl, "ppl_after": r.ppl_after.ppl, "ppl_change": r.ppl_change,
                "eval_tokens": r.ppl_after.tokens}
    if as_json:
        click.echo(json.dumps(out))
        return
    layers = ", ".join(f"{n} {b}-bit" for b, n in r.layers.items()) + f", {r.float_layers} float"
    click.echo(f"Wrote {r.dst}: {r.bits}-bit g{r.group_size}, {r.recipe} recipe ({layers} layers)")
    click.echo(f"weights {size(r.source_bytes)} -> {size(r.bytes)} on disk, {r.bits_per_weight:.2f} bits per weight")
    for note in r.notes:
        click.echo(f"note: {note}")
    if r.ppl_change is not None:
        click.echo(f"perplexity {r.ppl_before.ppl:.3f} -> {r.ppl_after.ppl:.3f} ({100 * r.ppl_change:+.2f}%) "
                   f"on {r.ppl_after.tokens} tokens of {eval_file.name}")
