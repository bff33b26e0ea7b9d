"""`umakit bench`: decode throughput against the memory-bandwidth roofline."""

from __future__ import annotations

import sys

import click

from umakit.bench import (
    DEFAULT_BATCH,
    DEFAULT_GEN_TOKENS,
    DEFAULT_PROMPT_TOKENS,
    DEFAULT_REPEAT,
    DEFAULT_SWEEP_STEPS,
    DEFAULT_WARMUP,
)

from umakit.cli.format import size
from umakit.cli.flags import (
    QUANTIZE_BITS,
    echo_warnings,
    kv_bits_option,
    load_draft,
    load_model,
    model_argument,
    model_options,
    offload_options,
    parallel_option,
    speculative_options,
)


def _contexts(ctx, param, value):
    try:
        return tuple(int(v) for v in value.split(",") if v.strip()) if value else ()
    except ValueError:
        raise click.BadParameter("give context lengths as comma-separated integers, e.g. 256,1024,4096")


@click.command("bench")
@model_argument
@click.option("--prompt-tokens", type=click.IntRange(min=1), default=DEFAULT_PROMPT_TOKENS, show_default=True)
@click.option("--gen-tokens", type=click.IntRange(min=2), default=DEFAULT_GEN_TOKENS, show_default=True)
@click.option("--repeat", type=click.IntRange(min=1), default=DEFAULT_REPEAT, show_default=True)
@click.option("--warmup", type=click.IntRange(min=0), default=DEFAULT_WARMUP, show_default=True)
@click.option("--batch", type=click.IntRange(min=1), default=DEFAULT_BATCH, show_default=True,
              help="Sequences decoded together; decode tok/s is then the aggregate.")
@kv_bits_option
@click.option("--contexts", callback=_contexts, default=None, help="Context lengths for the decode-vs-context sweep, e.g. 256,1024,4096.")
@click.option("--synthetic", metavar="PRESET", default=None, help="Random weights in a preset's exact shapes (see umakit plan).")
@click.option("--bits", type=click.Choice([str(b) for b in QUANTIZE_BITS]), default=None,
              help="With --synthetic: quantize to these bits.")
@click.option("--json", "json_out", type=click.Path(dir_okay=False), default=None, help="Write the record here.")
@click.option("--compare", "compare", multiple=True, type=click.Path(exists=True, dir_okay=False),
              help="Bench JSON files to show side by side (repeatable; no run).")
@click.option("--plot", type=click.Path(dir_okay=False), default=None,
              help="PNG: decode tok/s vs context with roofline ceilings (with --offload-sweep: vs layers streamed).")
@click.option("--offload-sweep", is_flag=True,
              help="Measure with 0%..100% of the layers streamed from host memory (torch backend), against the model.")
@click.option("--sweep-steps", type=click.IntRange(min=2), default=DEFAULT_SWEEP_STEPS, show_default=True,
              help="Steps of the offload sweep (5: 0, 25, 50, 75, 100% of the layers streamed).")
@click.option("--speculative", is_flag=True,
              help="Plain against speculative decoding of a copy-heavy prompt, in one run (prompt lookup unless --draft).")
@click.option("--probe", is_flag=True,
              help="Measure this machine's bandwidth (and host link) again, best of several runs; cache it and exit.")
@speculative_options
@model_options
@offload_options
@parallel_option
def bench(model, prompt_tokens, gen_tokens, repeat, warmup, batch, kv_bits, contexts, synthetic, bits, json_out, compare,
          plot, offload_sweep, sweep_steps, speculative, probe, draft, draft_tokens, prompt_lookup, ngram, backend,
          device, dtype, peak_bandwidth, gpu_layers, vram_budget, parallel):
    """Measure TTFT, prefill and decode speed, achieved GB/s and % of peak bandwidth."""
    from umakit import bench as lib
    from umakit.core.fsutil import check_writable

    if probe:
        click.echo(_probe(device))
        return
    for out in filter(None, (json_out, plot)):  # a run of minutes must not end on an unwritable path
        check_writable(out)
    if compare:
        records = [lib.load_record(p) for p in compare]
        click.echo(compare_table(records))
    else:
        if offload_sweep and (gpu_layers is not None or vram_budget is not None):
            raise click.UsageError("--offload-sweep chooses the resident layers itself: drop --gpu-layers/--vram-budget")
        if bits and not synthetic:
            raise click.UsageError("--bits applies to --synthetic models; quantize a checkpoint with umakit quantize")
        if parallel and (synthetic or offload_sweep or speculative or compare):
            raise click.UsageError("--parallel measures a model directory: drop --synthetic/--offload-sweep/--speculative")
        settings = lib.BenchSettings(prompt_tokens, gen_tokens, repeat, warmup,
                                     kv_bits, contexts, batch=batch)
        speculative = speculative or prompt_lookup or draft is not None
        if speculative and (offload_sweep or synthetic):
            raise click.UsageError("--speculative measures a model with a tokenizer: drop --offload-sweep/--synthetic")
        if speculative:
            lib.check_speculative_settings(settings)  # before the model is looked up
        load, layers_of = _loader(model, synthetic, bits, backend, device, dtype, peak_bandwidth, settings.needs)
        if speculative:
            m = load(gpu_layers=gpu_layers, vram_budget=vram_budget)
            decoder = m.speculator(draft=load_draft(m, draft), prompt_lookup=draft is None, draft_tokens=draft_tokens,
                                   ngram=ngram)
            with click.progressbar(length=settings.warmup + repeat, label="benchmarking", file=sys.stderr) as bar:
                record = lib.run_speculative_bench(m, decoder, settings, progress=lambda what, done, total: bar.update(1))
        elif offload_sweep:
            layers = layers_of()
            steps = len(lib.sweep_gpu_layers(layers, sweep_steps))
            with click.progressbar(length=steps, label="offload sweep", file=sys.stderr) as bar:
                record = lib.run_offload_sweep(lambda n: load(gpu_layers=n), layers, settings, sweep_steps,
                                               progress=lambda what, done, total: bar.update(1))
        else:
            m = load(gpu_layers=gpu_layers, vram_budget=vram_budget, **({"parallel": parallel} if parallel else {}))
            with click.progressbar(length=settings.steps, label="benchmarking", file=sys.stderr) as bar:
                record = lib.run_bench(m, settings, progress=lambda what, done, total: bar.update(1))
        records = [record.to_json()]
        click.echo(compare_table(records))
        if records[0].get("offload_sweep"):
            click.echo()
            click.echo(sweep_table(records[0]))
        if records[0].get("speculative"):
            click.echo()
            click.echo(speculative_table(records[0]))
        if json_out:
            lib.write_record(records[0], json_out)
            click.echo(f"wrote {json_out}", err=True)
    if plot:
        if records[0].get("offload_sweep"):
            lib.plot_sweep(records[0], plot)
        else:
            lib.plot_records(records, plot)
        click.echo(f"wrote {plot}", err=True)


def _probe(device) -> str:
    """Re-measure the local device's cached figures; one line saying what they are now."""
    from umakit.hardware import detect_local

    dev = detect_local(device or "auto", remeasure=True, link=True)
    link = f"; host link {dev.pcie_h2d_gbps:.1f} GB/s (measured)" if dev.pcie_h2d_gbps else ""
    return f"{dev.name}: peak bandwidth {dev.peak_bandwidth_gbps:.1f} GB/s ({dev.bandwidth_source}){link}"


def _loader(model, synthetic, bits, backend, device, dtype, peak_bandwidth, needs):
    """(load(gpu_layers=, vram_budget=) -> umakit.Model, layers() -> the model's layer count)."""
    import umakit
    from umakit.bench import layer_count

    if synthetic:
        from umakit.plan.planner import load_preset

        def load(**offload):
            m = umakit.load_synthetic(synthetic, backend=backend, device=device, dtype=dtype,
                                      bits=int(bits) if bits else None, peak_bandwidth=peak_bandwidth, needs=needs,
                                      **offload)
            echo_warnings(m.info.warnings)
            return m

        return load, lambda: layer_count(load_preset(synthetic))
    from umakit.plan.planner import load_config

    path = umakit.resolve_model(model)  # once: a sweep loads it again per step

    def load(**offload):
        return load_model(path, backend=backend, device=device, dtype=dtype, peak_bandwidth=peak_bandwidth,
                          needs=needs, **offload)

    return load, lambda: layer_count(load_config(path))


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


def speculative_table(record: dict) -> str:
    """Plain against speculative decode speed of one record, with the acceptance figures."""
    s, plain = record["speculative"], record["summary"]["decode_tps"]["median"]
    lines = [f"speculative decoding ({s['method'].replace('_', ' ')}, up to {s['max_draft_tokens']} tokens a step), "
             f"copy-heavy prompt of {record['settings']['prompt_tokens']} tokens",
             "| | decode tok/s | vs plain | x one-token roofline | accepted | tok per target step | same tokens |",
             "|---|---:|---:|---:|---:|---:|---|",
             f"| plain | {plain:.2f} | 1.00x | {record['summary']['mbu']['median']:.2f} | | 1.00 | |",
             f"| speculative | {s['summary']['decode_tps']['median']:.2f} | {s['speedup']:.2f}x | "
             f"{s['over_one_token_roofline']:.2f} | {s['acceptance_rate']:.0%} | {s['tokens_per_step']:.2f} | "
             f"{'yes' if s['same_tokens'] else 'NO'} |"]
    return "\n".join(lines)


def sweep_table(record: dict) -> str:
    """The offload sweep, one row per step: measured against the modelled ceiling."""
    link = record["machine"].get("pcie_h2d_gbps") or 0.0
    lines = [f"offload sweep ({record['machine']['device']}, link {link:.1f} GB/s measured)",
             "| layers streamed | resident | streamed/token | decode tok/s | GB/s | link GB/s | ceiling tok/s | of ceiling |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for p in record["offload_sweep"]:
        lines.append(f"| {p['offloaded_fraction']:.0%} | {p['gpu_layers']}/{p['layers']} | "
                     f"{size(p['streamed_bytes_per_token'])} | {p['decode_tps']:.2f} | {p['achieved_gbps']:.2f} | "
                     f"{p['pcie_gbps']:.2f} | {p['ceiling_tps']:.2f} | {p['efficiency']:.0%} |")
    return "\n".join(lines)
