"""`umakit plan`: memory anatomy and per-device decode ceilings, before any download."""

from __future__ import annotations

import json

import click

from umakit import plan as P
from umakit.affine import DEFAULT_GROUP_SIZE, FLOAT_BITS
from umakit.offload import parse_size


@click.command("plan")
@click.argument("model", required=False)
@click.option("--preset", help=f"A built-in config shape (default {P.DEFAULT_PRESET}); a wrong name lists them.")
@click.option("--config", "config_path", type=click.Path(dir_okay=False), help="A Hugging Face config.json.")
# Bits are checked by the library (plan_model), whose one-line errors list the accepted values.
@click.option("--bits", type=int, default=P.DEFAULT_PLAN_BITS, show_default=True,
              help=f"Weight bits: {P.choices_text(P.WEIGHT_BITS)}.")
@click.option("--embed-bits", type=int, help="Bits of the embedding and output head (default: --bits).")
@click.option("--group-size", type=int, default=DEFAULT_GROUP_SIZE, show_default=True)
@click.option("--kv-bits", type=int, default=P.DEFAULT_KV_BITS, show_default=True,
              help=f"KV cache bits: {P.choices_text(P.KV_CACHE_BITS)}.")
@click.option("--context", type=int, default=P.DEFAULT_CONTEXT, show_default=True, help="Tokens of context.")
@click.option("--batch", type=int, default=P.DEFAULT_BATCH, show_default=True)
@click.option("--device", "devices", multiple=True,
              help="Repeatable: 'local' or a name like 'M4 Max 128GB' "
                   f"(default: local, {', '.join(P.REFERENCE_DEVICES)}).")
@click.option("--peak-bandwidth", type=float, help="The local device's peak bandwidth in GB/s (overrides detection).")
@click.option("--vram-budget", metavar="SIZE", help="Cap a GPU's memory for the model (e.g. 8GB), as when running with it.")
@click.option("--json", "as_json", is_flag=True, help="Print the plan as JSON.")
def plan(model, preset, config_path, bits, embed_bits, group_size, kv_bits, context, batch, devices,
         peak_bandwidth, vram_budget, as_json):
    """Weights, KV cache and working memory of MODEL (a directory with config.json, or a preset
    name), whether it fits each device, and the decode tok/s ceiling there."""
    name, config = P.resolve_config(model, preset, config_path)
    p = P.plan_model(config, name=name, bits=bits, embed_bits=embed_bits, group_size=group_size,
                     kv_bits=kv_bits, context=context, batch=batch,
                     devices=P.resolve_devices(devices, peak_bandwidth),
                     vram_budget=parse_size(vram_budget) if vram_budget is not None else None)
    if as_json:
        click.echo(json.dumps(P.plan_to_dict(p), indent=2))
        return
    group = f", group {p.group_size}" if min(p.bits, p.embed_bits) < FLOAT_BITS else ""
    click.echo(f"{p.model} ({p.model_type}): {_count(p.params)} parameters; {p.bits}-bit weights, embedding/head "
               f"{p.embed_bits}-bit{group}; {p.kv_bits}-bit KV cache; context {p.context}; batch {p.batch}\n")
    rows = [["weights", "params", "bits/weight", "size", "read/step"]]
    rows += [[f"  {c.name}", _count(c.params), f"{c.bits_per_weight:.2f}", _size(c.bytes),
              _size(c.read_bytes_per_step)] for c in p.categories]
    rows.append(["  total", _count(p.params), "", _size(p.weight_bytes), _size(p.weight_read_bytes_per_step)])
    click.echo(_table(rows, right=(1, 2, 3, 4)))
    click.echo(f"KV cache        {_size(p.kv_bytes_per_token)}/token x {p.context} tokens x {p.batch}"
               f" = {_size(p.kv_bytes)}")
    click.echo(f"working memory  {_size(p.working_bytes)} (logits, activations and attention scores of a "
               f"{min(p.context, P.PREFILL_CHUNK)}-token prefill chunk)")
    click.echo(f"total           {_size(p.total_bytes)}")
    click.echo(f"decode step     reads {_size(p.step_read_bytes)} (weights {_size(p.weight_read_bytes_per_step)}"
               f" + KV cache {_size(p.kv_bytes)})")
    for note in p.notes:
        click.echo(f"note: {note}")
    total = f" (total of {p.batch} sequences)" if p.batch > 1 else ""
    rows = [["device", "usable / memory", "peak bandwidth", "fits", f"decode ceiling{total}"]]
    rows += [_device_row(d) for d in p.devices]
    click.echo("\n" + _table(rows, right=(1,)))
    split = next((d.offload for d in p.devices if d.offload is not None and d.offload.ceiling_tps), None)
    if split is not None:
        click.echo(f"\nto run with this split: umakit run MODEL --backend cuda --gpu-layers {split.layers_resident}")


def _device_row(d: P.DevicePlan) -> list[str]:
    dev, o = d.device, d.offload
    ceiling = f"{d.ceiling_tps:,.1f} tok/s"
    if o is not None:
        pcie = f"PCIe {o.pcie_gbps:.0f} GB/s, {o.pcie_source}"
        if o.ceiling_tps is None:
            ceiling += f" if it fit; KV cache and working memory alone exceed VRAM ({pcie})"
        else:
            ceiling += (f" if it fit; offload: {o.layers_resident}/{o.layers_total} layers resident,"
                        f" {_size(o.streamed_bytes)}/step over {pcie} -> {o.ceiling_tps:,.2f} tok/s")
    return [dev.name, f"{_size(d.budget_bytes)} / {_size(dev.memory_bytes)}",
            f"{dev.peak_bandwidth_gbps:,.0f} GB/s {dev.bandwidth_source}", "yes" if d.fits else "no", ceiling]


def _table(rows: list[list[str]], right: tuple[int, ...] = ()) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths)))
                     .rstrip() for r in rows)


def _size(n: float) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n:.0f} B"


def _count(n: int) -> str:
    for unit, scale in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return str(n)
