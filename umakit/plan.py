"""Memory anatomy of a model before downloading it, and what each device makes of it.

Everything comes from config.json shapes. Formulas (sizes in bytes, B = batch):

* weights: parameters x stored bits per weight / 8 by category; quantized
  matrices carry an fp16 scale and bias per group (4-bit, group 64 -> 4.5 bits);
  norms, biases and MoE routers stay in 16 bits.
* KV cache and working memory: as `umakit.shapes` counts them (the offload
  planner, and so the torch engine, reserve the same amounts).
* decode ceiling: bandwidth / bytes read per step, where a step reads every
  weight it uses (one embedding row per sequence; for MoE only the routed
  experts) and the whole KV cache, and yields B tokens.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from .affine import DEFAULT_GROUP_SIZE, FLOAT_BITS, GROUP_SIZES, KV_BITS, bits_per_weight
from .errors import ConfigError, InvalidArgumentError, ModelNotFoundError
from .hardware import GiB, DeviceInfo, detect_local, lookup_device
from .offload import plan_layers
from .roofline import offload_ceiling_tps
from .shapes import FLOAT_BYTES, ModelShape, kv_cache_bytes, kv_layer_bytes_per_token, working_bytes
from .shapes import PREFILL_CHUNK  # noqa: F401 (re-exported: plan reports the chunk it sizes)

PRESET_DIR = Path(__file__).parent / "presets"
DEFAULT_PRESET = "smollm2-135m"
DEFAULT_CONTEXT = 8192
DEFAULT_PLAN_BITS = FLOAT_BITS  # plan an unquantized model unless told (`umakit quantize` defaults to 4)
DEFAULT_KV_BITS = FLOAT_BITS
DEFAULT_BATCH = 1
WEIGHT_BITS = (FLOAT_BITS, 8, 4)  # the weight widths plan offers (--bits, --embed-bits)
KV_CACHE_BITS = (FLOAT_BITS, *sorted(KV_BITS, reverse=True))  # an unquantized cache or the engines' widths
REFERENCE_DEVICES = ("M2 Ultra 192GB", "M4 Max 128GB", "RTX 4090 24GB", "H100 80GB")
LOCAL_DEVICE = "local"
# Host-to-device copy rates seen in practice on an x16 link (theoretical 15.8 / 31.5 / 63 GB/s).
PCIE_EFFECTIVE_GBPS = {3: 12.0, 4: 25.0, 5: 50.0}
CUDA_RESERVED_BYTES = GiB  # CUDA context and allocator slack kept out of the VRAM budget


@dataclass(frozen=True)
class WeightCategory:
    """Parameters and bytes of one part of the model."""

    name: str  # embedding | attention | mlp | head | norms
    params: int
    bits_per_weight: float  # stored bits of its quantized matrices (16: unquantized)
    bytes: int
    read_bytes_per_step: int  # bytes one decode step reads from this category


@dataclass(frozen=True)
class OffloadEstimate:
    """A discrete GPU that cannot hold everything: whole layers resident, the rest streamed per step."""

    layers_resident: int
    layers_total: int
    resident_read_bytes: int  # read from VRAM per step
    streamed_bytes: int  # copied host -> device per step
    pcie_gbps: float
    pcie_source: str
    ceiling_tps: float | None  # None: embeddings, KV cache and working memory alone exceed VRAM


@dataclass(frozen=True)
class DevicePlan:
    """One device's verdict on a plan."""

    device: DeviceInfo
    budget_bytes: int  # what the model may occupy there
    fits: bool
    ceiling_tps: float  # decode tokens/s with everything resident (the unified-memory ceiling)
    offload: OffloadEstimate | None = None


@dataclass(frozen=True)
class Plan:
    """A model's memory anatomy at given bits, context and batch, and how each device takes it."""

    model: str
    model_type: str
    bits: int
    embed_bits: int
    group_size: int
    kv_bits: int
    context: int
    batch: int
    params: int
    num_layers: int
    categories: tuple[WeightCategory, ...]
    weight_bytes: int
    weight_read_bytes_per_step: int
    kv_bytes_per_token: int  # all layers, one sequence
    kv_bytes: int  # whole cache at context x batch
    working_bytes: int
    total_bytes: int
    step_read_bytes: int  # weights read + KV cache read per decode step
    layer_bytes: int  # one transformer layer's weights (for offload splits)
    layer_read_bytes: int
    fixed_bytes: int  # resident outside the layers: embedding, head, final norm, KV cache, working memory
    fixed_read_bytes: int
    notes: tuple[str, ...] = ()
    devices: tuple[DevicePlan, ...] = ()


def choices_text(values: Sequence[int]) -> str:
    """The accepted values as errors and help texts list them: "16, 8 or 4"."""
    return f"{', '.join(map(str, values[:-1]))} or {values[-1]}"


def _bits_per_weight(bits: int, group_size: int) -> float:
    return float(FLOAT_BITS) if bits == FLOAT_BITS else bits_per_weight(bits, group_size, FLOAT_BYTES)


def _weight_bytes(params: float, bits: int, group_size: int) -> float:
    return params * _bits_per_weight(bits, group_size) / 8


def _check(bits, embed_bits, group_size, kv_bits, context, batch) -> None:
    for flag, value in (("--bits", bits), ("--embed-bits", embed_bits)):
        if value not in WEIGHT_BITS:
            raise InvalidArgumentError(f"{flag} must be {choices_text(WEIGHT_BITS)} (got {value})")
    if kv_bits not in KV_CACHE_BITS:
        raise InvalidArgumentError(f"--kv-bits must be {choices_text(KV_CACHE_BITS)} (got {kv_bits})")
    if group_size not in GROUP_SIZES:
        raise InvalidArgumentError(f"--group-size must be one of {', '.join(map(str, GROUP_SIZES))} (got {group_size})")
    if context < 1 or batch < 1:
        raise InvalidArgumentError(f"--context and --batch must be at least 1 (got {context}, {batch})")


def plan_model(
    config: dict,
    *,
    name: str = "model",
    bits: int = DEFAULT_PLAN_BITS,
    group_size: int = DEFAULT_GROUP_SIZE,
    embed_bits: int | None = None,
    kv_bits: int = DEFAULT_KV_BITS,
    context: int = DEFAULT_CONTEXT,
    batch: int = DEFAULT_BATCH,
    devices: Sequence[DeviceInfo] = (),
    vram_budget: int | None = None,
) -> Plan:
    """Weights by category, KV cache, working memory and totals; one DevicePlan per device.

    ``embed_bits`` (default: ``bits``) sets the embedding and output head, which
    umakit's quantizer keeps at 8 bits when asked for 4. ``vram_budget`` (bytes)
    caps what a discrete GPU may hold, as ``--vram-budget`` does when running.
    """
    embed_bits = bits if embed_bits is None else embed_bits
    _check(bits, embed_bits, group_size, kv_bits, context, batch)
    s = ModelShape.from_config(config)
    H, L, D = s.hidden_size, s.num_layers, s.head_dim
    q_out, kv_out = s.q_out, s.kv_out

    # Per layer: quantized matrices and 16-bit extras (biases, norms, router).
    attn_q = H * q_out * 2 + H * kv_out * 2
    attn_f = (q_out + 2 * kv_out if s.qkv_bias else 0) + (H if s.o_bias else 0)
    if s.num_experts:
        expert = 3 * H * s.intermediate_size
        # Distinct experts a step touches when B tokens route independently and uniformly.
        active = s.num_experts * (1 - (1 - s.experts_per_token / s.num_experts) ** batch)
        shared = 3 * H * s.shared_expert_intermediate_size
        mlp_q, mlp_f = s.num_experts * expert + shared, H * s.num_experts + (H if shared else 0)
        mlp_read = _weight_bytes(active * expert + shared, bits, group_size) + mlp_f * FLOAT_BYTES
    else:
        mlp_q, mlp_f = 3 * H * s.intermediate_size, 0
        mlp_read = None
    layer_norms = s.norms_per_layer * H + (2 * D if s.qk_norm else 0)
    attn_bytes = _weight_bytes(attn_q, bits, group_size) + attn_f * FLOAT_BYTES
    mlp_bytes = _weight_bytes(mlp_q, bits, group_size) + mlp_f * FLOAT_BYTES
    mlp_read = mlp_bytes if mlp_read is None else mlp_read
    embed_bytes = _weight_bytes(s.vocab_size * H, embed_bits, group_size)
    head_params = 0 if s.tie_word_embeddings else s.vocab_size * H
    norm_params = L * layer_norms + H

    bpw, embed_bpw = _bits_per_weight(bits, group_size), _bits_per_weight(embed_bits, group_size)
    categories = (
        WeightCategory("embedding", s.vocab_size * H, embed_bpw, round(embed_bytes),
                       round(embed_bytes / s.vocab_size * batch)),
        WeightCategory("attention", L * (attn_q + attn_f), bpw, round(L * attn_bytes), round(L * attn_bytes)),
        WeightCategory("mlp", L * (mlp_q + mlp_f), bpw, round(L * mlp_bytes), round(L * mlp_read)),
        # A tied head has no parameters of its own but still reads the whole embedding matrix.
        WeightCategory("head", head_params, embed_bpw, round(embed_bytes) if head_params else 0,
                       round(embed_bytes)),
        WeightCategory("norms", norm_params, float(FLOAT_BITS), norm_params * FLOAT_BYTES, norm_params * FLOAT_BYTES),
    )
    weight_bytes = sum(c.bytes for c in categories)
    weight_read = sum(c.read_bytes_per_step for c in categories)

    kv_layer = kv_layer_bytes_per_token(s, kv_bits, group_size)
    kv_total = kv_cache_bytes(s, context, batch, kv_bits, group_size)
    working = working_bytes(s, context, batch)
    layer_bytes = round(attn_bytes + mlp_bytes + layer_norms * FLOAT_BYTES)
    layer_read = round(attn_bytes + mlp_read + layer_norms * FLOAT_BYTES)
    head_bytes = categories[3].bytes
    notes = []
    if s.sliding_layers and s.sliding_window < context:
        notes.append(f"{s.sliding_layers} of {L} layers attend to a {s.sliding_window}-token window; "
                     "their KV cache is capped there (a rotating cache)")
    if s.num_experts:
        notes.append(f"MoE: {s.num_experts} experts, {s.experts_per_token} routed per token; a decode step reads"
                     f" only the experts its tokens use (about {active:.1f} at batch {batch}, routing uniform)")
    if "vision_config" in config:
        notes.append("the vision tower is not counted")
    plan = Plan(
        model=name, model_type=s.model_type, bits=bits, embed_bits=embed_bits, group_size=group_size,
        kv_bits=kv_bits, context=context, batch=batch,
        params=sum(c.params for c in categories), num_layers=L, categories=categories,
        weight_bytes=weight_bytes, weight_read_bytes_per_step=weight_read,
        kv_bytes_per_token=kv_layer * L, kv_bytes=kv_total, working_bytes=working,
        total_bytes=weight_bytes + kv_total + working, step_read_bytes=weight_read + kv_total,
        layer_bytes=layer_bytes, layer_read_bytes=layer_read,
        fixed_bytes=categories[0].bytes + head_bytes + H * FLOAT_BYTES + kv_total + working,
        fixed_read_bytes=categories[0].read_bytes_per_step + categories[3].read_bytes_per_step
        + H * FLOAT_BYTES + kv_total,
        notes=tuple(notes),
    )
    return dataclasses.replace(plan, devices=tuple(plan_device(plan, d, vram_budget) for d in devices))


def plan_device(plan: Plan, device: DeviceInfo, vram_budget: int | None = None) -> DevicePlan:
    """Does ``plan`` fit on ``device``, its decode ceiling, and the PCIe-offload split where it does not."""
    budget = device.usable_bytes
    if device.kind == "nvidia":
        budget = max(device.memory_bytes - CUDA_RESERVED_BYTES, 0)
        if vram_budget is not None:
            budget = min(budget, vram_budget)
    fits = plan.total_bytes <= budget
    ceiling = plan.batch * device.peak_bandwidth_gbps * 1e9 / plan.step_read_bytes
    offload = None
    if device.kind == "nvidia" and not fits:
        offload = offload_split(plan, device, budget)
    return DevicePlan(device=device, budget_bytes=budget, fits=fits, ceiling_tps=ceiling, offload=offload)


def offload_split(plan: Plan, device: DeviceInfo, budget_bytes: int) -> OffloadEstimate:
    """The engine's own split (umakit.offload.plan_layers): embeddings, head, KV cache and working
    memory resident first, then as many whole layers as fit next to the streaming ring; the rest streamed."""
    if device.pcie_h2d_gbps:
        pcie, source = device.pcie_h2d_gbps, "measured"
    else:
        gen = device.pcie_gen or 4
        pcie, source = PCIE_EFFECTIVE_GBPS[gen], f"PCIe {gen}.0 x16 typical" + ("" if device.pcie_gen else " (assumed)")
    layers = plan.num_layers
    reserved = plan.kv_bytes + plan.working_bytes
    try:
        split = plan_layers([plan.layer_bytes] * layers, plan.fixed_bytes - reserved, vram_budget=max(budget_bytes, 1),
                            reserved_bytes=reserved)
    except InvalidArgumentError:  # not even the resident minimum fits
        return OffloadEstimate(0, layers, plan.fixed_read_bytes, layers * plan.layer_read_bytes, pcie, source, None)
    resident = split.gpu_layers
    streamed = (layers - resident) * plan.layer_read_bytes
    resident_read = plan.fixed_read_bytes + resident * plan.layer_read_bytes
    ceiling = plan.batch * offload_ceiling_tps(resident_read, streamed, device.peak_bandwidth_gbps, pcie)
    return OffloadEstimate(int(resident), int(layers), int(resident_read), int(streamed), pcie, source, ceiling)


def resolve_devices(names: Sequence[str] = (), override_gbps: float | None = None) -> list[DeviceInfo]:
    """Devices by name; "local" is this machine (``override_gbps`` applies to it). Default: local + references."""
    names = list(names) or [LOCAL_DEVICE, *REFERENCE_DEVICES]
    if override_gbps is not None and LOCAL_DEVICE not in (n.lower() for n in names):
        raise InvalidArgumentError("--peak-bandwidth sets the local device's bandwidth: add --device local")
    return [detect_local(override_gbps=override_gbps) if n.lower() == LOCAL_DEVICE else lookup_device(n)
            for n in names]


def resolve_config(model: str | None = None, preset: str | None = None, config: str | None = None) -> tuple[str, dict]:
    """(display name, config dict) from exactly one of: a model directory (or preset name), a preset, a config.json."""
    given = [x for x in (model, preset, config) if x is not None]
    if len(given) > 1:
        raise InvalidArgumentError("give only one of MODEL, --preset and --config")
    if config is not None:
        path = Path(config)
        return (path.parent.resolve().name if path.name == "config.json" else path.stem), load_config(path)
    if model is not None and not Path(model).exists() and model.lower() in list_presets():
        preset = model
    if model is not None and preset is None:
        return Path(model).resolve().name, load_config(model)
    preset = preset or DEFAULT_PRESET
    return preset.lower(), load_preset(preset)


def list_presets() -> list[str]:
    """Names of the built-in config shapes (umakit/presets/*.json)."""
    return sorted(p.stem for p in PRESET_DIR.glob("*.json"))


def load_preset(name: str) -> dict:
    """The config.json of a built-in preset such as "llama-3-8b"."""
    path = PRESET_DIR / f"{name.lower()}.json"
    if not path.is_file():
        raise ModelNotFoundError(f"unknown preset {name!r}; choose from {', '.join(list_presets())}")
    return json.loads(path.read_text(encoding="utf-8"))


def load_config(path: str | Path) -> dict:
    """A config.json file, or the config.json inside a model directory."""
    path = Path(path)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise ModelNotFoundError(
            f"{path} not found: give a model directory with config.json, --config FILE or --preset NAME"
        )
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ConfigError(f"cannot read {path}: {e}") from e
    if not isinstance(config, dict):
        raise ConfigError(f"{path} is not a JSON object")
    return config


def plan_to_dict(plan: Plan) -> dict:
    """Plain JSON-ready dict of a plan (bytes as integers, bandwidths in GB/s)."""
    return dataclasses.asdict(plan)
