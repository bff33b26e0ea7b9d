"""Plots of bench records (PNG, matplotlib imported lazily) and the model curves they draw.

`plot_records`: decode tok/s against context length, each record with its
roofline ceiling. `plot_sweep`: an offload sweep's tok/s and GB/s against the
share of layers streamed, with the modelled two-link ceiling.
"""

from __future__ import annotations

from umakit.errors import InvalidArgumentError
from umakit.core.fsutil import atomic_file
from umakit.plan.roofline import GB, offload_ceiling_tps


def ceiling_curve(record: dict, contexts: list[int]) -> list[float]:
    """The roofline ceiling (tok/s) of a record's model and machine at each context length."""
    m, peak = record["model"], record["machine"]["peak_bandwidth_gbps"]
    return [peak * GB / (m["bytes_per_token"] + m["kv_bytes_per_token"] * c) for c in contexts]


def modelled_sweep(record: dict) -> tuple[list[float], list[float]]:
    """(offloaded fractions, offload ceiling tok/s) at every layer count of a sweep record's model.

    Layers are taken as alike: each streamed layer moves the same bytes from
    the resident read (in its resident form) to the link (in its streamed form),
    both measured from the sweep's first and last steps.
    """
    points = sorted(record["offload_sweep"], key=lambda p: p["offloaded_fraction"])
    peak, link = record["machine"]["peak_bandwidth_gbps"], record["machine"]["pcie_h2d_gbps"]
    layers = points[0]["layers"]

    def split(p):  # (layers streamed, resident bytes per step, streamed bytes per step)
        k = layers - p["gpu_layers"]
        return k, p["bytes_per_token"] - p["streamed_bytes_per_token"], p["streamed_bytes_per_token"]

    (k0, r0, _), (k1, r1, s1) = split(points[0]), split(points[-1])
    if k1 == k0:
        return [k0 / layers], [peak * GB / r0]
    resident_per_layer, streamed_per_layer = (r0 - r1) / (k1 - k0), s1 / k1
    xs, ys = [], []
    for k in range(layers + 1):
        resident, streamed = max(r0 - (k - k0) * resident_per_layer, 1.0), k * streamed_per_layer
        xs.append(k / layers)
        ys.append(offload_ceiling_tps(resident, streamed, peak, link) if streamed else peak * GB / resident)
    return xs, ys


def plot_records(records: list[dict], path) -> None:
    """Decode tok/s against context length, each machine with its roofline ceiling (PNG)."""
    plt = _pyplot()

    fig, ax = plt.subplots(figsize=(8, 5))
    for i, rec in enumerate(records):
        points = rec.get("contexts") or []
        xs = [p["context"] for p in points] or [rec["settings"]["prompt_tokens"]]
        ys = [p["decode_tps"] for p in points] or [rec["summary"]["decode_tps"]["median"]]
        label = f"{rec['machine']['device']} · {rec['model']['name']} ({rec['model']['quantization']})"
        color = f"C{i}"
        ax.plot(xs, ys, "o-", color=color, label=f"{label}: measured")
        grid = sorted(set([1] + xs + [max(xs) * 2]))
        ax.plot(grid, ceiling_curve(rec, grid), "--", color=color, label=f"{label}: roofline ceiling")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("context length (tokens)")
    ax.set_ylabel("decode tok/s")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7)
    save_png(fig, path)


def plot_sweep(record: dict, path) -> None:
    """Decode tok/s and GB/s against the share of layers streamed, with the modelled curve (PNG)."""
    plt = _pyplot()

    points = record["offload_sweep"]
    xs = [100 * p["offloaded_fraction"] for p in points]
    grid, ceilings = modelled_sweep(record)
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 7), sharex=True)
    top.plot(xs, [p["decode_tps"] for p in points], "o-", label="measured")
    top.plot([100 * f for f in grid], ceilings, "--", label="modelled ceiling (memory + link)")
    top.set_ylabel("decode tok/s")
    top.set_yscale("log")
    top.set_title(f"{record['model']['name']} on {record['machine']['device']}: layers streamed over the link "
                  f"({record['machine']['pcie_h2d_gbps']:.1f} GB/s measured)", fontsize=9)
    bottom.plot(xs, [p["achieved_gbps"] for p in points], "o-", label="all bytes read per step")
    bottom.plot(xs, [p["pcie_gbps"] for p in points], "s-", label="bytes streamed over the link")
    bottom.axhline(record["machine"]["pcie_h2d_gbps"], color="gray", linestyle=":", label="link bandwidth (probe)")
    bottom.set_ylabel("GB/s")
    bottom.set_xlabel("layers streamed from host memory (%)")
    for ax in (top, bottom):
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    save_png(fig, path)


def _pyplot():
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise InvalidArgumentError("--plot needs matplotlib: pip install 'umakit[plot]'") from e
    return plt


def save_png(fig, path) -> None:
    """Write a matplotlib figure to ``path`` as PNG, atomically, and close it."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    with atomic_file(path, "wb") as f:
        fig.savefig(f, format="png", dpi=120)
    plt.close(fig)
