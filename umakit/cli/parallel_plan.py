"""The --nodes/--link part of `umakit plan`: tensor and pipeline parallel over several machines."""

from __future__ import annotations

import dataclasses

from umakit.plan import parallel as PP


def parallel_plans(plan, config: dict, nodes: int | None, link: str | None) -> list:
    """The library's plans for --nodes (none without it); --link alone is refused."""
    if nodes is None:
        if link is not None:
            import click

            raise click.UsageError("--link describes what joins --nodes: give --nodes too")
        return []
    return PP.plan_parallel(plan, config, nodes, link or PP.DEFAULT_LINK)


def parallel_dict(plans: list) -> dict:
    return {"parallel": [{**dataclasses.asdict(p), "link_share": p.link_share} for p in plans]} if plans else {}


def parallel_lines(plans: list) -> str:
    link = PP.LINKS[plans[0].link]
    head = (f"{plans[0].nodes} nodes over {link.name} ({link.gbps:g} GB/s, {link.latency_us:g} us a message: "
            f"{link.source})")
    rows = [["device", "mode", "per node (GiB)", "fits", "reads/token", "sent/token", "messages", "link share",
             "decode ceiling", "one node"]]
    for p in plans:
        rows.append([p.device, p.mode, f"{p.node_bytes / 2**30:.1f}", "yes" if p.fits else "no",
                     _size(p.node_read_bytes), _size(p.link_bytes_per_token), str(p.messages_per_token),
                     f"{p.link_share:.0%}", f"{p.ceiling_tps:,.1f} tok/s", f"{p.single_node_tps:,.1f} tok/s"])
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    table = "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows)
    return (f"{head}\n{table}\n"
            "tensor: two all-reduces of the hidden state per layer per token; pipeline: one hop per stage, and a "
            "single stream\nvisits the stages in turn, so it gains memory, not speed (\"one node\": the device alone, "
            "were it to hold the model)")


def _size(n: float) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n:.0f} B"
