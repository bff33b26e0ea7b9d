"""`umakit bench`: decode throughput against the memory-bandwidth roofline."""

from __future__ import annotations

import json
import sys

import click

from umakit.bench import DEFAULT_GEN_TOKENS, DEFAULT_PROMPT_TOKENS, DEFAULT_REPEAT

from .format import size
from .options import model_options


def _contexts(ctx, param, value):
    try:
        return tuple(int(v) for v in value.split(",") if v.strip()) if value else ()
    except ValueError:
        raise click.BadParameter("give context lengths as comma-separated integers, e.g. 256,1024,4096")


@click.command("bench")
@click.argument("model", required=False)
@click.option("--prompt-tokens", type=click.IntRange(min=1), default=DEFAULT_PROMPT_TOKENS, show_default=True)
@click.option("--gen-tokens", type=click.IntRange(min=2), default=DEFAULT_GEN_TOKENS, show_default=True)
@click.option("--repeat", type=click.IntRange(min=1), default=DEFAULT_REPEAT, show_default=True)
@click.option("--warmup", type=click.IntRange(min=0), default=1, show_default=True)
@click.option("--batch", type=click.IntRange(min=1), default=1, show_default=True,
              help="Sequences decoded together; decode tok/s is then the aggregate.")
@click.option("--kv-bits", type=click.Choice(["4", "8"]), default=None)
@click.option("--contexts", callback=_contexts, default=None, help="Context lengths for the decode-vs-context sweep, e.g. 256,1024,4096.")
@click.option("--synthetic", metavar="PRESET", default=None, help="Random weights in a preset's exact shapes (see umakit plan).")
@click.option("--bits", type=click.Choice(["4", "8"]), default=None, help="With --synthetic: quantize to these bits.")
@click.option("--json", "json_out", type=click.Path(dir_okay=False), default=None, help="Write the record here.")
@click.option("--compare", "compare", multiple=True, type=click.Path(exists=True, dir_okay=False),
              help="Bench JSON files to show side by side (repeatable; no run).")
@click.option("--plot", type=click.Path(dir_okay=False), default=None, help="PNG: decode tok/s vs context with roofline ceilings.")
@model_options
def bench(model, prompt_tokens, gen_tokens, repeat, warmup, batch, kv_bits, contexts, synthetic, bits, json_out, compare,
          plot, backend, device, dtype, peak_bandwidth):
    """Measure TTFT, prefill and decode speed, achieved GB/s and % of peak bandwidth."""
    from umakit import bench as lib

    if compare:
        records = [lib.load_record(p) for p in compare]
        click.echo(compare_table(records))
    else:
        needs = ({"kv_bits"} if kv_bits else set()) | ({"batch"} if batch > 1 else set())
        engine, name, dev = _engine(model, synthetic, bits, backend, device, dtype, peak_bandwidth, needs)
        settings = lib.BenchSettings(prompt_tokens, gen_tokens, repeat, warmup,
                                     int(kv_bits) if kv_bits else None, contexts, batch=batch)
        with click.progressbar(length=settings.warmup + repeat + len(contexts), label="benchmarking",
                               file=sys.stderr) as bar:
            record = lib.run_bench(engine, name, dev, settings, synthetic=bool(synthetic),
                                   progress=lambda what, done, total: bar.update(1))
        records = [json.loads(json.dumps(record.to_dict()))]
        click.echo(compare_table(records))
        if json_out:
            from umakit.fsutil import atomic_file

            with atomic_file(json_out, "w") as f:
                json.dump(records[0], f, indent=2)
            click.echo(f"wrote {json_out}", err=True)
    if plot:
        lib.plot_records(records, plot)
        click.echo(f"wrote {plot}", err=True)


def _engine(model, synthetic, bits, backend, device, dtype, peak_bandwidth, needs):
    import umakit
    from umakit.hardware import detect_local

    if synthetic:
        from umakit.backends import engine_class, resolve
        from umakit.plan import load_preset

        engine_name, device = resolve(backend, device, frozenset(needs))
        cls = engine_class(engine_name)
        engine = cls.synthetic(load_preset(synthetic), device=device, dtype=dtype, bits=int(bits) if bits else None)
        return engine, synthetic, detect_local(device, override_gbps=peak_bandwidth)
    if bits:
        raise click.UsageError("--bits applies to --synthetic models; quantize a checkpoint with umakit quantize")
    m = umakit.load(model, backend=backend, device=device, dtype=dtype, peak_bandwidth=peak_bandwidth, needs=needs)
    return m.engine, m.info.name, m.device_info


ROWS = [
    ("TTFT (s)", "ttft_s", "{:.3f}"),
    ("prefill tok/s", "prefill_tps", "{:.1f}"),
    ("decode tok/s", "decode_tps", "{:.2f}"),
    ("achieved GB/s", "achieved_gbps", "{:.2f}"),
    ("MBU", "mbu", "{:.1%}"),
]


def compare_table(records: list[dict]) -> str:
    """Records side by side: machine, model, then median (min-max) of each metric."""
    head = [("machine", lambda r: f"{r['machine']['device']}"),
            ("peak bandwidth", lambda r: f"{r['machine']['peak_bandwidth_gbps']:.0f} GB/s ({r['machine']['bandwidth_source']})"),
            ("model", lambda r: r["model"]["name"] + (" [synthetic]" if r.get("synthetic") else "")),
            ("engine", lambda r: f"{r['model']['backend']}/{r['model']['device']} {r['model']['dtype']}"),
            ("weights", lambda r: f"{size(r['model']['weight_bytes'])} · {r['model']['bits_per_weight']:.2f} bits/weight"),
            ("bytes/token", lambda r: size(r["summary"]["bytes_per_token"]["median"])),
            ("prompt/gen tokens", lambda r: f"{r['settings']['prompt_tokens']}/{r['settings']['gen_tokens']} ×{r['settings']['repeat']}"
                                            + (f", batch {r['settings'].get('batch', 1)}" if r["settings"].get("batch", 1) > 1 else ""))]
    rows = [(label, [f(r) for r in records]) for label, f in head]
    for label, key, fmt in ROWS:
        rows.append((label, [f"{fmt.format(s['median'])} ({fmt.format(s['min'])}-{fmt.format(s['max'])})"
                             for s in (r["summary"][key] for r in records)]))
    rows.append(("peak memory", [size(r["summary"]["peak_memory_bytes"]["median"]) for r in records]))
    for r_i, r in enumerate(records):
        for p in r.get("contexts") or []:
            label = f"decode @ {p['context']} ctx"
            row = next((row for row in rows if row[0] == label), None)
            if row is None:
                row = (label, [""] * len(records))
                rows.append(row)
            row[1][r_i] = f"{p['decode_tps']:.2f} tok/s · {p['mbu']:.1%} (ceiling {p['ceiling_tps']:.0f})"
    width = max(len(label) for label, _ in rows)
    cols = [max(len(row[1][i]) for row in rows) for i in range(len(records))]
    return "\n".join(f"{label:<{width}}  " + "  ".join(f"{v:<{cols[i]}}" for i, v in enumerate(vals)).rstrip()
                     for label, vals in rows)
