"""Memory anatomy of a model before downloading it, and what each device makes of it.

Everything comes from config.json shapes. Formulas (sizes in bytes, B = batch):

* weights: every matrix at the bits it is stored at (`umakit.plan.weights`: a
  checkpoint's ``quantization`` block, or ``--bits`` through `umakit quantize`'s
  recipes), norms and biases in 16 bits.
* KV cache and working memory: as `umakit.plan.shapes` counts them.
* decode ceiling: bandwidth / bytes read per step, where a step reads every
  weight it uses (one embedding row per sequence; for MoE only the routed
  experts) and the whole KV cache, and yields B tokens.
* offload (a discrete GPU too small for the model): the torch engine's own
  split, with the KV reserve it makes (`umakit.plan.placement.reserved_bytes`):
  whole layers for a dense model (`umakit.plan.placement.plan_layers`), routed experts
  for MoE (`umakit.plan.placement.plan_experts`; whole layers shown beside it, for
  comparison only); `umakit.plan.placement.streamed_bytes_per_token` counts what each copies.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Sequence

from umakit.core.affine import DEFAULT_GROUP_SIZE, FLOAT_BITS, GROUP_SIZES, KV_BITS, describe
from umakit.checkpoint.config import architecture
from umakit.errors import InvalidArgumentError
from umakit.hardware import GiB, DeviceInfo, detect_local, lookup_device
from umakit.plan.placement import (
    ROUTED_EXPERTS,
    WHOLE_LAYERS,
    LayerBytes,
    OffloadPlan,
    expected_active_experts,
    plan_experts,
    plan_layers,
    reserve_tokens,
    reserved_bytes,
)
from umakit.plan.sources import (  # noqa: F401 (plan's API)
    DEFAULT_PRESET, PRESET_DIR, list_presets, load_config, load_preset, resolve_config)
from umakit.plan.weights import CATEGORIES, checkpoint_bits, count_weights, model_matrices, recipe_bits, stored_bits
from umakit.plan.roofline import offload_ceiling_tps
from umakit.plan.shapes import FLOAT_BYTES, ModelShape, kv_bytes_all_layers, kv_cache_bytes, working_bytes
from umakit.plan.shapes import PREFILL_CHUNK  # noqa: F401 (re-exported: plan reports the chunk it sizes)

DEFAULT_CONTEXT = 8192
DEFAULT_PLAN_BITS = None  # a checkpoint's own quantization block, else unquantized 16-bit weights
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
    bits_per_weight: float  # stored bits of its quantizable matrices (16: unquantized)
    bytes: int
    read_bytes_per_step: int  # bytes one decode step reads from this category


@dataclass(frozen=True)
class OffloadEstimate:
    """A discrete GPU that cannot hold everything: a placement's split and its decode ceiling."""

    layers_resident: int  # whole layers (WHOLE_LAYERS) or layers whose experts stay resident (ROUTED_EXPERTS)
    layers_total: int
    resident_read_bytes: int  # read from VRAM per step
    streamed_bytes: int  # copied host -> device per step
    pcie_gbps: float
    pcie_source: str
    ceiling_tps: float | None  # None: the resident minimum alone exceeds VRAM
    placement: str = WHOLE_LAYERS
    engines: tuple[str, ...] = ()  # engines that offload this architecture with this placement


@dataclass(frozen=True)
class DevicePlan:
    """One device's verdict on a plan."""

    device: DeviceInfo
    budget_bytes: int  # what the model may occupy there
    fits: bool
    ceiling_tps: float  # decode tokens/s with everything resident (the unified-memory ceiling)
    offload: OffloadEstimate | None = None  # the split the torch engine makes (`engine_placement`)
    whole_layers: OffloadEstimate | None = None  # MoE: whole layers streamed, for comparison only (no engine does)


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
    layer_bytes: int  # the largest transformer layer's weights
    layer_read_bytes: int  # what a step reads of it
    fixed_bytes: int  # resident outside the layers: embedding, head, final norm, KV cache, working memory
    fixed_read_bytes: int
    notes: tuple[str, ...] = ()
    devices: tuple[DevicePlan, ...] = ()
    quantization: str = "none"  # where the bits come from, e.g. "checkpoint: 4-bit g32, some layers 8-bit"
    recipe: str | None = None  # the quantize recipe planned with (--bits), None otherwise
    layers: tuple[LayerBytes, ...] = ()  # each layer's weights, split as the offload placements see them
    active_experts: float = 0.0  # distinct experts a decode step reads per MoE layer
    reserve_tokens: int = 0  # the context the engine reserves KV for when it splits layers by a budget
    reserve_bytes: int = 0  # what a split sets aside: the engine's reserve, or the cache at context x batch if more
    offload_fixed_bytes: int = 0  # resident outside the layers in a split: embedding, head, final norm, reserve
    architecture: str = ""  # the language model's model_type, as the engines match it (gemma3_text in a gemma3)


def choices_text(values: Sequence[int]) -> str:
    """The accepted values as errors and help texts list them: "16, 8 or 4"."""
    return f"{', '.join(map(str, values[:-1]))} or {values[-1]}"


def _check(bits, embed_bits, group_size, kv_bits, context, batch) -> None:
    for flag, value in (("--bits", bits), ("--embed-bits", embed_bits)):
        if value is not None and value not in WEIGHT_BITS:
            raise InvalidArgumentError(f"{flag} must be {choices_text(WEIGHT_BITS)} (got {value})")
    if kv_bits not in KV_CACHE_BITS:
        raise InvalidArgumentError(f"--kv-bits must be {choices_text(KV_CACHE_BITS)} (got {kv_bits})")
    if group_size not in GROUP_SIZES:
        raise InvalidArgumentError(f"--group-size must be one of {', '.join(map(str, GROUP_SIZES))} (got {group_size})")
    if context < 1 or batch < 1:
        raise InvalidArgumentError(f"--context and --batch must be at least 1 (got {context}, {batch})")


def quantization_block(config: dict) -> dict | None:
    """A checkpoint's quantization block (mlx-lm writes ``quantization``, transformers ``quantization_config``)."""
    from umakit.checkpoint.hfquant.detect import foreign_block

    foreign = foreign_block(config)  # GPTQ, AWQ, compressed-tensors: as their import will hold them
    if foreign is not None:
        return foreign
    for key in ("quantization", "quantization_config"):
        block = config.get(key)
        if isinstance(block, dict) and "bits" in block:
            return block
    return None


def plan_model(
    config: dict,
    *,
    name: str = "model",
    bits: int | None = DEFAULT_PLAN_BITS,
    group_size: int = DEFAULT_GROUP_SIZE,
    recipe: str | None = None,
    embed_bits: int | None = None,
    kv_bits: int = DEFAULT_KV_BITS,
    context: int = DEFAULT_CONTEXT,
    batch: int = DEFAULT_BATCH,
    devices: Sequence[DeviceInfo] = (),
    vram_budget: int | None = None,
) -> Plan:
    """Weights by category, KV cache, working memory and totals; one DevicePlan per device.

    ``bits`` None plans the checkpoint as stored (its ``quantization`` block, per-layer
    overrides included; none: 16-bit). ``bits`` 8 or 4 plans what `umakit quantize`
    writes with ``recipe`` (default: quantize's): embedding and head at 8 bits unless
    ``embed_bits`` says otherwise. ``vram_budget`` (bytes) caps what a discrete GPU may
    hold, as ``--vram-budget`` does when running.
    """
    from umakit.quantize.recipes import DEFAULT_RECIPE, get_recipe

    _check(bits, embed_bits, group_size, kv_bits, context, batch)
    if recipe is not None:
        get_recipe(recipe)  # a one-line error naming the recipes
    s = ModelShape.from_config(config)
    H, L = s.hidden_size, s.num_layers
    block = quantization_block(config)
    if bits is None and block is not None and embed_bits is None and recipe is None:
        bits_of, quantization, used_recipe = checkpoint_bits(block), f"checkpoint: {describe(block)}", None
        bits, group_size = int(block["bits"]), int(block["group_size"])
    else:
        bits = FLOAT_BITS if bits is None else bits
        used_recipe = (recipe or DEFAULT_RECIPE) if bits != FLOAT_BITS else None
        bits_of = recipe_bits(bits, group_size, used_recipe or DEFAULT_RECIPE, L, embed_bits)
        quantization = f"--bits {bits}, {used_recipe} recipe" if used_recipe else "none (16-bit)"
        if embed_bits is not None:
            quantization += f", --embed-bits {embed_bits}"
    w = count_weights(s, bits_of)

    active = expected_active_experts(s.num_experts, s.experts_per_token, batch)
    layer_read = [lb.dense + round(min(active, lb.experts) * lb.expert) for lb in w.layers]
    expert_read = sum(layer_read) - sum(lb.dense for lb in w.layers)
    size = {c: round(w.bytes[c]) for c in CATEGORIES}
    embed_bytes = size["embedding"]
    table = model_matrices(s)[0][0]  # the token table a tied head reads (gemma4's per-layer one is looked up only)
    table_bytes = round(table.params * stored_bits(bits_of(table)) / 8)
    read = {
        "embedding": round(embed_bytes / s.vocab_size * batch),
        "attention": size["attention"],
        "mlp": size["mlp"] - round(w.expert_matrix_bytes) + expert_read,
        # A tied head has no parameters of its own but still reads the whole embedding matrix.
        "head": size["head"] if size["head"] else table_bytes,
        "norms": size["norms"],
    }
    categories = tuple(
        WeightCategory(c, w.params[c], _mean_bits(w, c, w.embed_pair), size[c], read[c]) for c in CATEGORIES)
    weight_bytes = sum(c.bytes for c in categories)
    weight_read = sum(c.read_bytes_per_step for c in categories)

    kv_layers = kv_bytes_all_layers(s, kv_bits)
    kv_total = kv_cache_bytes(s, context, batch, kv_bits)
    working = working_bytes(s, context, batch)
    outer = size["embedding"] + size["head"] + H * FLOAT_BYTES  # embedding, head, final norm
    notes = _notes(s, config, context, active, batch)
    # Never less than the engine reserves when it splits by budget; more when --context x --batch needs it
    # (the split is then run with --gpu-layers, which reserves nothing of its own).
    reserve = max(reserved_bytes(config), kv_total + working)
    plan = Plan(
        model=name, model_type=s.model_type, bits=bits,
        embed_bits=w.embed_pair[0] if w.embed_pair else FLOAT_BITS, group_size=group_size,
        kv_bits=kv_bits, context=context, batch=batch,
        params=sum(c.params for c in categories), num_layers=L, categories=categories,
        weight_bytes=weight_bytes, weight_read_bytes_per_step=weight_read,
        kv_bytes_per_token=kv_layers, kv_bytes=kv_total, working_bytes=working,
        total_bytes=weight_bytes + kv_total + working, step_read_bytes=weight_read + kv_total,
        layer_bytes=max(lb.total for lb in w.layers), layer_read_bytes=max(layer_read),
        fixed_bytes=outer + kv_total + working,
        fixed_read_bytes=read["embedding"] + read["head"] + H * FLOAT_BYTES + kv_total,
        notes=tuple(notes), quantization=quantization, recipe=used_recipe, layers=w.layers, active_experts=active,
        reserve_tokens=reserve_tokens(config), reserve_bytes=reserve,
        offload_fixed_bytes=outer + reserve, architecture=architecture(config) or s.model_type,
    )
    return dataclasses.replace(plan, devices=tuple(plan_device(plan, d, vram_budget) for d in devices))


def _mean_bits(w, category: str, embed_pair) -> float:
    if w.matrix_params[category]:
        return 8 * w.matrix_bytes[category] / w.matrix_params[category]
    if category == "head":  # tied: the embedding's
        return stored_bits(embed_pair)
    return float(FLOAT_BITS)


def _notes(s: ModelShape, config: dict, context: int, active: float, batch: int) -> list[str]:
    notes = []
    if s.sliding_layers and s.sliding_window < context:
        notes.append(f"{s.sliding_layers} of {s.num_layers} layers attend to a {s.sliding_window}-token window; "
                     "their KV cache is capped there on MLX (a rotating cache); the torch engine keeps every "
                     "position, masked, so that its cache can be trimmed")
    if s.num_experts:
        notes.append(f"MoE: {s.num_experts} experts, {s.experts_per_token} routed per token; a decode step reads"
                     f" only the experts its tokens use (about {active:.1f} at batch {batch}, routing uniform)")
    if s.kv_latent_dim:
        notes.append(f"multi-head latent attention: the cache holds one {s.kv_latent_dim}-element latent vector"
                     " per token and layer (kv_lora_rank + qk_rope_head_dim)")
    if config.get("num_nextn_predict_layers"):
        notes.append("the multi-token-prediction layer is not counted (engines do not run it)")
    if "vision_config" in config:
        notes.append("the vision tower is not counted")
    return notes


def engine_placement(plan: Plan) -> str:
    """The placement the torch engine offloads ``plan``'s model with: routed experts for MoE, else whole layers."""
    return ROUTED_EXPERTS if plan.active_experts else WHOLE_LAYERS


def offload_engines(model_type: str) -> tuple[str, ...]:
    """Engines that stream weights from host memory on a GPU and run ``model_type`` (`config_compat.architecture`)."""
    from umakit.backends import ENGINES
    from umakit.backends.base import OFFLOAD

    return tuple(name for name, spec in ENGINES.items()
                 if OFFLOAD in spec.features and "cuda" in spec.devices and spec.runs(model_type))


def plan_device(plan: Plan, device: DeviceInfo, vram_budget: int | None = None) -> DevicePlan:
    """Does ``plan`` fit on ``device``, its decode ceiling, and the PCIe-offload splits where it does not."""
    budget = device.usable_bytes
    if device.kind == "nvidia":
        budget = max(device.memory_bytes - CUDA_RESERVED_BYTES, 0)
        if vram_budget is not None:
            budget = min(budget, vram_budget)
    fits = plan.total_bytes <= budget
    ceiling = plan.batch * device.peak_bandwidth_gbps * 1e9 / plan.step_read_bytes
    offload = whole = None
    if device.kind == "nvidia" and not fits:
        offload = offload_split(plan, device, budget, engine_placement(plan))
        if offload.placement != WHOLE_LAYERS:
            whole = offload_split(plan, device, budget, WHOLE_LAYERS)
    return DevicePlan(device=device, budget_bytes=budget, fits=fits, ceiling_tps=ceiling, offload=offload,
                      whole_layers=whole)


def _link(device: DeviceInfo) -> tuple[float, str]:
    if device.pcie_h2d_gbps:
        return device.pcie_h2d_gbps, "measured"
    gen = device.pcie_gen or 4
    return PCIE_EFFECTIVE_GBPS[gen], f"PCIe {gen}.0 x16 typical" + ("" if device.pcie_gen else " (assumed)")


def offload_split(plan: Plan, device: DeviceInfo, budget_bytes: int, placement: str = WHOLE_LAYERS) -> OffloadEstimate:
    """The split a placement makes within ``budget_bytes``, as the torch engine makes it: embeddings, head
    and the engine's KV reserve resident first, then as many whole layers (`WHOLE_LAYERS`,
    umakit.plan.placement.plan_layers) or layers' routed experts (`ROUTED_EXPERTS`, umakit.plan.placement.plan_experts:
    every dense part resident) as fit next to the streaming buffers. ``engines``: those that run it,
    empty for a placement other than `engine_placement`."""
    pcie, source = _link(device)
    layers, n = plan.layers, len(plan.layers)
    weights_fixed = plan.offload_fixed_bytes - plan.reserve_bytes
    engines = offload_engines(plan.architecture) if placement == engine_placement(plan) else ()
    try:
        if placement == WHOLE_LAYERS:
            split = plan_layers([lb.total for lb in layers], weights_fixed, vram_budget=max(budget_bytes, 1),
                                reserved_bytes=plan.reserve_bytes)
        else:
            split = plan_experts(layers, weights_fixed, vram_budget=max(budget_bytes, 1),
                                 reserved_bytes=plan.reserve_bytes, active_experts=plan.active_experts)
    except InvalidArgumentError:  # not even the resident minimum fits
        return OffloadEstimate(0, n, plan.fixed_read_bytes, sum(lb.total for lb in layers), pcie, source, None,
                               placement, engines)
    resident_read = plan.fixed_read_bytes + _resident_read(plan, split)
    ceiling = plan.batch * offload_ceiling_tps(resident_read, split.streamed_bytes, device.peak_bandwidth_gbps, pcie)
    return OffloadEstimate(split.gpu_layers, n, int(resident_read), split.streamed_bytes, pcie, source, ceiling,
                           placement, engines)


def _resident_read(plan: Plan, split: OffloadPlan) -> int:
    """What a step reads from VRAM in the layers: all of a resident layer's used weights; for routed
    experts also every streamed layer's dense part."""
    total = 0
    for i, lb in enumerate(plan.layers):
        used = lb.dense + round(min(plan.active_experts, lb.experts) * lb.expert)
        if i in split.resident_layers:
            total += used
        elif split.placement == ROUTED_EXPERTS:
            total += lb.dense
    return total


def resolve_devices(names: Sequence[str] = (), override_gbps: float | None = None) -> list[DeviceInfo]:
    """Devices by name; "local" is this machine (``override_gbps`` applies to it). Default: local + references."""
    names = list(names) or [LOCAL_DEVICE, *REFERENCE_DEVICES]
    if override_gbps is not None and LOCAL_DEVICE not in (n.lower() for n in names):
        raise InvalidArgumentError("--peak-bandwidth sets the local device's bandwidth: add --device local")
    return [detect_local(override_gbps=override_gbps) if n.lower() == LOCAL_DEVICE else lookup_device(n)
            for n in names]


def plan_to_dict(plan: Plan) -> dict:
    """Plain JSON-ready dict of a plan (bytes as integers, bandwidths in GB/s)."""
    return dataclasses.asdict(plan)
