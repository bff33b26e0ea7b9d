"""Loading the torch engine's model: the checkpoint streamed tensor by tensor into a meta-built model.

The model is built on the meta device, quantized layers are swapped in where
the checkpoint stores scales (mlx-lm's rule), names and shapes are checked
before any data is read, tensors are filled in one at a time on the device,
and quantized layers then take their execution form (quant/forms.py). The
offload split (which layers stream from host memory) is decided here from the
checkpoint's tensor sizes, with umakit/plan/placement.py's arithmetic.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import torch
from torch import nn

from umakit.core.affine import BITS, GROUP_SIZES
from umakit.checkpoint.files import Checkpoint
from umakit.errors import CheckpointError, DoesNotFitError, InvalidArgumentError
from umakit.plan.placement import RING_SLOTS, OffloadPlan, parse_size, plan_layers, reserved_bytes
from umakit.plan.shapes import KV_RESERVE_TOKENS
from umakit import backends
from umakit.backends.common import check_weights
from umakit.backends.torch import quant
from umakit.backends.torch.quant.forms import convert_model, cpu_auto_dtype, joiner
from umakit.backends.torch.model.llama import ModelArgs, Transformer, fuse_projections
from umakit.backends.torch.model.gemma4 import transformer_for
from umakit.backends.torch.model.rope import rope_inv_freq
from umakit.backends.torch.model.moe import Experts, expert_slot, stacked_shapes
from umakit.backends.torch.cpu.affine_kernel import AffineEmbedding, AffineLinear, Unpacked
from umakit.backends.torch.load.packed import PackedCache
from umakit.backends.torch.load.packing_stream import count_quantized, first_packing

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
SAFETENSORS_FLOATS = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}
EXACT_GROUP = 16  # a GGUF's Q6_K groups, which only the CPU kernel is given (load/exact.py)
CUDA_CACHE_TOKENS = KV_RESERVE_TOKENS  # initial KV capacity on CUDA: what the offload budget reserves for


def compute_dtype(dtype: str, floats: list, device: str, quantization: dict | None = None) -> torch.dtype:
    """The requested dtype. "auto" on a CPU is what `convert.cpu_auto_dtype` picks for the checkpoint's
    ``quantization`` (torch's int4 kernels where they are fastest), else float16 weights with float32
    math; on CUDA, the checkpoint's half precision."""
    if dtype != "auto":
        if dtype not in DTYPES:
            raise InvalidArgumentError(f"unknown dtype {dtype!r}; choose auto, {', '.join(DTYPES)}")
        return DTYPES[dtype]
    if device == "cpu":
        if cpu_auto_dtype(quantization) == "bfloat16":
            return torch.bfloat16
        # Half the bytes of float32 and the same float32 arithmetic (see the table above).
        return torch.float16 if quant.Fp16Linear.available() else torch.float32
    halves = [f for f in floats if f != torch.float32]
    return max(set(halves), key=halves.count) if halves else torch.bfloat16


def quant_spec(path: str, q: dict, tensors) -> dict | None:
    """mlx-lm's rule: a per-module dict overrides; otherwise quantized iff ``{path}.scales`` exists."""
    if isinstance(q.get(path), dict):
        return {k: q[path].get(k, q.get(k)) for k in ("bits", "group_size")}
    if q.get(path) is False or f"{path}.scales" not in tensors:
        return None
    return {"bits": q.get("bits"), "group_size": q.get("group_size")}


def _swap_quantized(model: Transformer, q: dict, tensors, dtype: torch.dtype) -> None:
    for path, module in list(model.named_modules()):
        if not isinstance(module, (nn.Linear, nn.Embedding, Experts)):
            continue
        spec = quant_spec(path, q, tensors)
        if spec is None:
            continue
        if spec["bits"] not in BITS or spec["group_size"] not in (*GROUP_SIZES, EXACT_GROUP):
            raise CheckpointError(f"{path}: {spec['bits']}-bit groups of {spec['group_size']} are not supported")
        try:
            if isinstance(module, Experts):
                new = module.quantized(spec["bits"], spec["group_size"], dtype)
            elif isinstance(module, nn.Embedding):
                new = quant.QuantizedEmbedding(module.num_embeddings, module.embedding_dim, **spec, dtype=dtype,
                                               device="meta")
            else:
                new = quant.QuantizedLinear(module.in_features, module.out_features, module.bias is not None,
                                            **spec, device="meta")
        except ValueError as e:
            raise CheckpointError(f"{path}: {e}") from e
        parent, _, attr = path.rpartition(".")
        setattr(model.get_submodule(parent), attr, new)


TOWERS = ("model.vision_tower.", "model.audio_tower.", "model.embed_vision.", "model.embed_audio.",
          "model.multi_modal_projector.")  # a multimodal checkpoint's other inputs, beside its language model


def _sanitize(name: str) -> str | None:
    """The model's name for a checkpoint tensor (None: not a weight of this model): a multimodal checkpoint's
    language model (``model.language_model.``) is the model; its vision and audio towers are left unread."""
    if "rotary_emb.inv_freq" in name or name.startswith(TOWERS):
        return None
    return _renamed(name)


def _renamed(name: str) -> str:
    """A checkpoint's tensor or module name as the model's: its language model's, and mlx-lm's gemma4 experts
    (``switch_glu``) as the stacked experts every family's are named (``switch_mlp``; load/gemma4_experts.py)."""
    if name.startswith("model.language_model."):
        name = "model." + name.removeprefix("model.language_model.")
    return name.replace(".experts.switch_glu.", ".experts.switch_mlp.")


def _expected(model: Transformer) -> dict[str, torch.Tensor]:
    out = dict(model.named_parameters())
    out.update({k: v for k, v in model.named_buffers() if k != "inv_freq" and v is not None})
    return out


def stream_checkpoint(ckpt: Checkpoint, device: str, progress=None, skip=frozenset()):
    """Each tensor of the checkpoint in turn, read straight to ``device``; those named in ``skip`` are not read.

    ``progress(bytes_done, bytes_total)`` hears about every tensor read or skipped.
    """
    from safetensors import safe_open

    done, total = 0, ckpt.nbytes
    for file in ckpt.files:
        with safe_open(str(file), framework="pt", device=device) as f:
            for key in f.keys():
                if key not in skip:
                    yield key, f.get_tensor(key)
                done += ckpt.tensors[key].nbytes
                if progress:
                    progress(done, total)


def build_model(args: ModelArgs, config: dict, shapes: dict, source, device: torch.device,
                dtype: torch.dtype, weights: torch.dtype | None = None, offloaded: Sequence[int] = (),
                host_experts: Sequence[int] = (), packed: PackedCache | None = None,
                packing: Callable[[int], None] | None = None, unread: dict | None = None) -> Transformer:
    """Build the model on the meta device, then fill it from ``source`` one tensor at a time.

    ``dtype`` is that of activations and float tensors, ``weights`` that of the
    linear layers' execution form (default: ``dtype``). The ``offloaded`` layers
    are read into host memory and converted one at a time on the device (so
    it never holds two of them), in a form made of plain tensors that can be
    streamed; the engine then hands them to a `LayerStreamer`. The routed experts of the ``host_experts``
    layers are read into host memory, for an `ExpertStreamer`. ``packed``: the CPU int4 packing of
    an earlier load, read instead of repacking, and written when this load made it; ``packing(bytes)`` hears the
    source bytes of the layers packed so far as it is written; ``unread``: the quantized layers ``source`` leaves
    unread, by module path, with what makes their tensors, and their tiles, when the packing asks
    (`QuantizedLinear.source` and ``tiled``).
    """
    weights = weights or dtype
    with torch.device("meta"):
        model = transformer_for(args)
    # transformers' one tensor per expert, checked and held as mlx-lm's stacked (E, ...) ones
    shapes, sources = stacked_shapes(shapes)
    keys = {n: k for k in shapes if (n := _sanitize(k)) is not None}  # the model's name -> the checkpoint's
    q = {(_renamed(k) if isinstance(v, dict) else k): v for k, v in (config.get("quantization") or {}).items()}
    _swap_quantized(model, q, {n: shapes[k] for n, k in keys.items()}, dtype)
    names = {n: sources.get(k, k) for n, k in keys.items()}
    expected = _expected(model)
    tied = args.tie_word_embeddings or not any(n.startswith("lm_head.") for n in names)
    if tied:
        expected = {k: v for k, v in expected.items() if not k.startswith("lm_head.")}
    check_weights({k: tuple(v.shape) for k, v in expected.items()}, {n: shapes[k] for n, k in keys.items()}, names)

    streamed = frozenset(offloaded)
    host = torch.device("cpu")
    for key, t in source:
        name = _sanitize(key)
        if name is None:
            continue
        slot = expert_slot(name)
        on_host = layer_of(name) in streamed or (layer_of(name) in host_experts and (slot or ".switch_mlp." in name))
        target = host if on_host else device
        if t.is_floating_point() and not name.endswith((".scales", ".biases")):
            t = t.to(device=target, dtype=dtype)
        if t.device.type == "cpu" and t.numel() * t.element_size() < SMALL and 0 not in t.stride():
            # a norm or a bias held in place would keep the whole checkpoint's map resident (a placeholder of one
            # repeated word, load/openai_experts.py's, is no map and must stay recognisable as one)
            t = t.clone()
        if slot is not None:
            _assign_expert(model, *slot, t.to(target))
        else:
            _assign(model, name, t.to(target))

    for path, (source, tiled) in (unread or {}).items():
        layer = model.get_submodule(_renamed(path))
        layer.source, layer.tiled = source, tiled
    embed = model.model.embed_tokens
    if tied:
        if isinstance(embed, quant.QuantizedEmbedding):
            model.lm_head = embed.as_linear()
        else:
            model.lm_head = nn.Linear(args.hidden_size, args.vocab_size, bias=False, device="meta")
            model.lm_head.weight = embed.weight
    fuse_projections(model, joiner(device, weights))
    for i in sorted(streamed):
        block = model.model.layers[i].to(device)
        convert_model(block, device, weights, tensors_only=lambda path: True)
        block.to(host)
    hosted = frozenset(host_experts)  # their experts stay stacked tensors, for the ExpertStreamer
    # a first CPU packing is written as it is made, each packed layer's source pages let go of
    stream, made = first_packing(packed, lambda: count_quantized(model), packing)
    convert_model(model, device, weights,
                  tensors_only=lambda path: layer_of(path) in streamed or (layer_of(path) in hosted and
                                                                           ".switch_mlp." in path),
                  prepacked=packed.get if packed is not None else lambda path: {}, made=made)
    if packed is not None:
        packed.store({path: m for path, m in model.named_modules() if hasattr(m, "packing")}, stream)
    if tied and isinstance(embed, quant.QuantizedEmbedding) and isinstance(model.lm_head, nn.Linear):
        # The tied head was dequantized: look rows up in it and drop the packed table.
        model.model.embed_tokens = nn.Embedding.from_pretrained(model.lm_head.weight, freeze=True)
    elif tied and isinstance(embed, quant.QuantizedEmbedding) and isinstance(model.lm_head, AffineLinear):
        # the head's planes serve the lookups too: the table is held once
        model.model.embed_tokens = AffineEmbedding(model.lm_head, embed.out_dtype)
    model.inv_freq = rope_inv_freq(args).to(device)
    check_built(model)
    backends.trim_heap()
    return model.eval()


SMALL = 1 << 20  # bytes: tensors under this are copied out of the checkpoint's map, not held in it


def check_built(model: nn.Module) -> None:
    """Refuse a model with a tensor nothing filled (`Unpacked`): a layer the load left unread (in a GGUF,
    load/gguf_layers.py) that the packing kept for it does not hold."""
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        if t.is_meta:
            raise Unpacked(f"{name} has no values: the load left it unread and no kept packing holds it")


def layer_of(name: str) -> int | None:
    """The block index of a tensor or module path ("model.layers.3.mlp..." -> 3), None outside the blocks."""
    if not name.startswith("model.layers."):
        return None
    return int(name.split(".", 3)[2])


def check_fits(args: ModelArgs, config: dict, shapes: dict, weights: torch.dtype, free_bytes: int) -> None:
    """Refuse, before reading any weight, a model that cannot fit the free VRAM whole, naming the flag that streams it."""
    whole = plan_offload(args, config, shapes, weights, args.num_hidden_layers, None)
    need = whole.resident_bytes + whole.reserved_bytes
    if need <= free_bytes:
        return
    try:
        split = plan_offload(args, config, shapes, weights, None, free_bytes)
        fix = (f"keep {split.gpu_layers} of {args.num_hidden_layers} layers on the GPU and stream the rest: "
               f"--gpu-layers {split.gpu_layers} (or --vram-budget {free_bytes / 1e9:.0f}GB)")
    except DoesNotFitError:  # not even with every layer streamed
        fix = "use a more quantized model (umakit quantize --bits 4)"
    raise DoesNotFitError(f"the model needs about {need / 1e9:.1f} GB of GPU memory but {free_bytes / 1e9:.1f} GB "
                          f"is free; {fix}")


def plan_offload(args: ModelArgs, config: dict, shapes: dict, weights: torch.dtype, gpu_layers: int | None,
                  vram_budget) -> OffloadPlan:
    """Which layers stream, from the checkpoint's tensor sizes in the execution dtype (what CUDA runs).

    The budget also holds what `umakit plan` counts besides weights (`umakit.plan.placement.reserved_bytes`:
    the KV cache for `KV_RESERVE_TOKENS` tokens, or the model's context if shorter, and a prefill
    chunk's working memory, 16-bit as on a GPU).
    """
    per_layer = [0] * args.num_hidden_layers
    fixed = 0
    for name, shape in shapes.items():
        if (name := _sanitize(name)) is None:
            continue
        count = int(np.prod(shape))
        packed = name.endswith(".weight") and f"{name.removesuffix('.weight')}.scales" in shapes
        nbytes = count * (4 if packed else 2 if name.endswith((".scales", ".biases")) else weights.itemsize)
        layer = layer_of(name)
        if layer is None:
            fixed += nbytes
        else:
            per_layer[layer] += nbytes
    budget = None if vram_budget is None else parse_size(vram_budget)
    reserve = reserved_bytes(config)
    return plan_layers(per_layer, fixed, gpu_layers=gpu_layers, vram_budget=budget, reserved_bytes=reserve,
                       ring_slots=RING_SLOTS)


def _assign(model: nn.Module, name: str, t: torch.Tensor) -> None:
    path, _, attr = name.rpartition(".")
    module = model.get_submodule(path)
    if attr in module._parameters:
        module._parameters[attr] = nn.Parameter(t, requires_grad=False)
    else:
        module._buffers[attr] = t


def _assign_expert(model: nn.Module, name: str, expert: int, t: torch.Tensor) -> None:
    """Copy one expert's tensor into its row of the stacked (E, ...) tensor ``name``, made at the first."""
    path, _, attr = name.rpartition(".")
    module = model.get_submodule(path)
    store = module._parameters if attr in module._parameters else module._buffers
    if store[attr].is_meta:
        _assign(model, name, torch.empty(store[attr].shape, dtype=t.dtype, device=t.device))
    store[attr][expert].copy_(t)


def named_tensors(model: nn.Module):
    yield from model.named_parameters(remove_duplicate=False)
    yield from ((k, v) for k, v in model.named_buffers(remove_duplicate=False) if k != "inv_freq")
