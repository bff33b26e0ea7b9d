"""`umakit compare`: bench records from several machines, side by side with predictions."""

from __future__ import annotations

import click


@click.command("compare")
@click.argument("records", nargs=-1, required=True, type=click.Path(exists=True, dir_okay=False))
@click.option("--device", "devices", multiple=True, help="Reference devices for predictions (default: a standard set).")
@click.option("--plot", type=click.Path(dir_okay=False), default=None, help="PNG: decode tok/s vs context with ceilings.")
def compare_cmd(records, devices, plot):
    """Compare `umakit bench --json` RECORDS (same model and bits) with the plan's predicted ceilings."""
    from umakit.bench import load_record, plot_records
    from umakit.bench.compare import compare
    from umakit.plan.planner import REFERENCE_DEVICES

    data = [load_record(p) for p in records]
    columns = compare(data, tuple(devices) or REFERENCE_DEVICES)
    model = data[0]["model"]
    click.echo(f"{model['name']} · {model['quantization']} · {model['bits_per_weight']:.2f} bits/weight")
    rows = [("", [c.label for c in columns]), ("", [c.kind.upper() for c in columns]),
            ("decode tok/s", [_num(c.decode_tps, "{:.1f}") for c in columns]),
            ("achieved GB/s", [_num(c.achieved_gbps, "{:.1f}") for c in columns]),
            ("peak GB/s", [f"{c.peak_gbps:.0f}" for c in columns]),
            ("limiting link", [c.limiting_link for c in columns]),
            ("fits", ["" if c.fits is None else ("yes" if c.fits else "no: offload") for c in columns])]
    widths = [max(len(r[1][i]) for r in rows) for i in range(len(columns))]
    label_w = max(len(r[0]) for r in rows)
    for label, vals in rows:
        click.echo(f"{label:<{label_w}}  " + "  ".join(f"{v:>{widths[i]}}" for i, v in enumerate(vals)))
    for c in columns:
        if c.note and c.kind == "predicted":
            click.echo(f"  {c.label}: {c.note}")
    if len(data) == 1:
        click.echo("Only one machine measured: the other columns are predicted ceilings, not measurements.")
    if plot:
        plot_records(data, plot)
        click.echo(f"wrote {plot}", err=True)


def _num(value, fmt):
    return "n/a" if value is None else fmt.format(value)
