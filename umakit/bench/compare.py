"""Side-by-side comparison of bench records, with the plan's predictions.

Measurements from different machines (a Mac on unified memory, a PC with PCIe
offload) are lined up for one model, and next to them the roofline ceilings
`umakit plan` predicts for reference devices, always labelled as predicted.
"""

from __future__ import annotations

from dataclasses import dataclass

from umakit.core.affine import DEFAULT_GROUP_SIZE, FLOAT_BITS
from umakit.errors import InvalidArgumentError
from umakit.hardware import lookup_device
from umakit.plan.placement import ROUTED_EXPERTS
from umakit.plan.planner import DEFAULT_KV_BITS, REFERENCE_DEVICES, WEIGHT_BITS, plan_model


@dataclass
class Column:
    label: str
    kind: str  # "measured" | "predicted"
    device: str
    decode_tps: float | None
    achieved_gbps: float | None
    peak_gbps: float
    limiting_link: str
    fits: bool | None = None
    note: str = ""


def limiting_link(record: dict) -> str:
    """What bounds a measured run: unified memory, VRAM, PCIe, or (CPU) RAM."""
    offload = record.get("offload") or {}
    if offload.get("streamed_bytes_per_token"):
        return "PCIe"
    return {"apple": "unified memory", "nvidia": "VRAM"}.get(record["machine"]["kind"], "RAM")


def _bits(config: dict) -> tuple[int, int | None, int]:
    """(bits, embedding bits or None, group size) of a config's quantization block."""
    q = config.get("quantization") or {}
    embed = q.get("model.embed_tokens", {})
    return (q.get("bits", FLOAT_BITS), embed.get("bits") if isinstance(embed, dict) else None,
            q.get("group_size", DEFAULT_GROUP_SIZE))


def compare(records: list[dict], references: tuple[str, ...] = REFERENCE_DEVICES) -> list[Column]:
    """Measured columns for each record, then predicted columns for the reference devices."""
    if not records:
        raise InvalidArgumentError("give at least one bench record")
    keys = {(r["model"]["name"], r["model"]["quantization"]) for r in records}
    if len(keys) > 1:
        raise InvalidArgumentError(
            "the records are of different models or quantizations: "
            + "; ".join(f"{n} ({q})" for n, q in sorted(keys)) + " — compare one model at a time"
        )
    columns = []
    for r in records:
        s = r["summary"]
        columns.append(Column(
            label=f"{r['machine']['device']} ({r['model']['backend']}/{r['model']['device']})",
            kind="measured", device=r["machine"]["device"], decode_tps=s["decode_tps"]["median"],
            achieved_gbps=s["achieved_gbps"]["median"], peak_gbps=r["machine"]["peak_bandwidth_gbps"],
            limiting_link=limiting_link(r), note=r["machine"]["bandwidth_source"],
        ))
    config = records[0]["model"].get("config")
    if not config:
        return columns
    bits, embed_bits, group_size = _bits(config)
    bits = bits if bits in WEIGHT_BITS else FLOAT_BITS  # plan knows these widths; others are planned as float
    embed_bits = embed_bits if embed_bits in WEIGHT_BITS else None
    settings = records[0]["settings"]
    plan = plan_model(config, name=records[0]["model"]["name"], bits=bits, embed_bits=embed_bits, group_size=group_size,
                      kv_bits=settings.get("kv_bits") or DEFAULT_KV_BITS,
                      context=settings["prompt_tokens"] + settings["gen_tokens"] // 2,
                      devices=[lookup_device(n) for n in references])
    for d in plan.devices:
        if d.fits or d.offload is None:
            tps, link, note = d.ceiling_tps, "unified memory" if d.device.kind == "apple" else "VRAM", ""
        else:
            o = d.offload
            tps, link = o.ceiling_tps, "PCIe"
            what = "layers' experts" if o.placement == ROUTED_EXPERTS else "layers"
            note = f"{o.layers_resident}/{o.layers_total} {what} resident; unified-memory ceiling {d.ceiling_tps:.0f} tok/s"
        columns.append(Column(
            label=d.device.name, kind="predicted", device=d.device.name, decode_tps=tps,
            achieved_gbps=tps * plan.step_read_bytes / 1e9 if tps else None, peak_gbps=d.device.peak_bandwidth_gbps,
            limiting_link=link, fits=d.fits, note=note,
        ))
    return columns
