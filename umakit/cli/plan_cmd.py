"""`umakit plan`: memory anatomy and per-device decode ceilings, before any download."""

from __future__ import annotations

import json

import click

from umakit.plan import planner as P
from umakit.core.affine import DEFAULT_GROUP_SIZE, FLOAT_BITS
from umakit.plan.placement import WHOLE_LAYERS, parse_size
from umakit.quantize.recipes import DEFAULT_RECIPE, RECIPES

from umakit.cli.flags import model_argument
from umakit.cli.parallel_plan import parallel_dict, parallel_lines, parallel_plans


@click.command("plan")
@model_argument
@click.option("--preset", help=f"A built-in config shape (default {P.DEFAULT_PRESET}); a wrong name lists them.")
@click.option("--config", "config_path", type=click.Path(dir_okay=False), help="A Hugging Face config.json.")
# Bits are checked by the library (plan_model), whose one-line errors list the accepted values.
@click.option("--bits", type=int, default=P.DEFAULT_PLAN_BITS,
              help=f"Weight bits: {P.choices_text(P.WEIGHT_BITS)}, as `umakit quantize --bits` writes them "
                   "(default: a checkpoint's own quantization, else 16).")
@click.option("--recipe", help=f"With --bits: the quantize recipe ({', '.join(RECIPES)}; default {DEFAULT_RECIPE}).")
@click.option("--embed-bits", type=int, help="Bits of the embedding and output head (default: the recipe's).")
@click.option("--group-size", type=int, default=DEFAULT_GROUP_SIZE, show_default=True)
@click.option("--kv-bits", type=int, default=P.DEFAULT_KV_BITS, show_default=True,
              help=f"KV cache bits: {P.choices_text(P.KV_CACHE_BITS)}.")
@click.option("--context", type=int, default=P.DEFAULT_CONTEXT, show_default=True, help="Tokens of context.")
@click.option("--batch", type=int, default=P.DEFAULT_BATCH, show_default=True)
@click.option("--device", "devices", multiple=True,
              help="Repeatable: 'local' or a name like 'M4 Max 128GB' "
                   f"(default: local, {', '.join(P.REFERENCE_DEVICES)}).")
@click.option("--peak-bandwidth", type=float, help="The local device's peak bandwidth in GB/s (overrides detection).")
@click.option("--vram-budget", metavar="SIZE",
              help="Cap a GPU's memory for the model, as when running with it: 8GB is 8x10^9 bytes, 8GiB 8x2^30.")
@click.option("--nodes", type=int, default=None,
              help="Plan tensor and pipeline parallel over this many of each device (2 or more).")
@click.option("--link", default=None, help="With --nodes: what joins them (see umakit.plan.parallel.LINKS).")
@click.option("--json", "as_json", is_flag=True, help="Print the plan as JSON.")
def plan(model, preset, config_path, bits, recipe, embed_bits, group_size, kv_bits, context, batch, devices,
         peak_bandwidth, vram_budget, nodes, link, as_json):
    """Weights, KV cache and working memory of MODEL (a directory with config.json, a GGUF file, or a
    preset name), whether it fits each device, and the decode tok/s ceiling there."""
    name, config = P.resolve_config(model, preset, config_path)
    p = P.plan_model(config, name=name, bits=bits, recipe=recipe, embed_bits=embed_bits, group_size=group_size,
                     kv_bits=kv_bits, context=context, batch=batch,
                     devices=P.resolve_devices(devices, peak_bandwidth),
                     vram_budget=parse_size(vram_budget) if vram_budget is not None else None)
    parallel = parallel_plans(p, config, nodes, link)
    if as_json:
        click.echo(json.dumps({**P.plan_to_dict(p), **parallel_dict(parallel)}, indent=2))
        return
    group = f", group {p.group_size}" if min(p.bits, p.embed_bits) < FLOAT_BITS else ""
    click.echo(f"{p.model} ({p.model_type}): {_count(p.params)} parameters; {p.bits}-bit weights, embedding/head "
               f"{p.embed_bits}-bit{group} ({p.quantization}); {p.kv_bits}-bit KV cache; context {p.context}; "
               f"batch {p.batch}")
    click.echo(f"sizes in GiB/MiB/KiB (2^30/2^20/2^10 bytes), bandwidths in GB/s (10^9 bytes/s)\n")
    rows = [["weights", "params", "bits/weight", "size (KiB-GiB)", "read/step (KiB-GiB)"]]
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
    budget = f"; --vram-budget {vram_budget} = {_size(parse_size(vram_budget))}" if vram_budget is not None else ""
    rows = [["device", "usable / memory (GiB)", "peak bandwidth (GB/s)", "fits", f"decode ceiling{total}"]]
    rows += [_device_row(d) for d in p.devices]
    click.echo(f"\ndevices (memory as sold: \"24GB\" = 24 GiB{budget})\n" + _table(rows, right=(1,)))
    for d in p.devices:
        if d.offload is not None:
            click.echo(_offload_lines(p, d))
    split = next((d.offload for d in p.devices if d.offload is not None and d.offload.ceiling_tps), None)
    if split is not None and split.engines:
        kept = "" if split.placement == WHOLE_LAYERS else " (layers whose experts stay resident)"
        click.echo(f"\nto run with this split: umakit run MODEL --backend cuda --gpu-layers {split.layers_resident}"
                   f"{kept}")
    elif split is not None:
        click.echo(f"\nno engine streams {p.architecture} layers from host memory yet: it needs a GPU that holds it")
    if parallel:
        click.echo("\n" + parallel_lines(parallel))


def _device_row(d: P.DevicePlan) -> list[str]:
    dev = d.device
    ceiling = f"{d.ceiling_tps:,.1f} tok/s" + (" if it fit; offload below" if d.offload is not None else "")
    return [dev.name, f"{_size(d.budget_bytes)} / {_size(dev.memory_bytes)}",
            f"{dev.peak_bandwidth_gbps:,.0f} GB/s {dev.bandwidth_source}", "yes" if d.fits else "no", ceiling]


def _offload_lines(p: P.Plan, d: P.DevicePlan) -> str:
    """A GPU too small for the model: the split the engine makes, then (MoE) whole layers for comparison."""
    o = d.offload
    lines = [f"offload on {d.device.name} (PCIe {o.pcie_gbps:.0f} GB/s, {o.pcie_source}; reserve for KV and "
             f"working memory {_size(p.reserve_bytes)}):"]
    for e, compared in ((o, False), (d.whole_layers, True)):
        if e is None:
            continue
        what = "whole layers" if e.placement == WHOLE_LAYERS else "routed experts"
        runs = ("for comparison: no engine streams MoE layers whole" if compared
                else f"{', '.join(e.engines)} engine" if e.engines else "no engine yet")
        unit = "layers resident" if e.placement == WHOLE_LAYERS else "layers' experts resident"
        if e.ceiling_tps is None:
            lines.append(f"  {what} ({runs}): the resident minimum alone exceeds VRAM")
        else:
            lines.append(f"  {what} ({runs}): {e.layers_resident}/{e.layers_total} {unit},"
                         f" {_size(e.streamed_bytes)}/step over PCIe -> {e.ceiling_tps:,.2f} tok/s")
    return "\n".join(lines)


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
