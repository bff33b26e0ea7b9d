"""An MLX-layout quantized checkpoint (an imported GGUF, GPTQ, AWQ or compressed-tensors checkpoint, `umakit
quantize`'s output) in a transformers model, loaded by transformers' own ``from_pretrained`` through a quantizer
registered for the layout: before the weights load, each quantized ``nn.Linear`` (and ``nn.Embedding``) of the
model's skeleton becomes a `_Packed` holder of its codes, scales and biases, which the loader fills by the model's
own names while its renames and merges (routed experts fused into one tensor, say) apply to the float tensors;
after, each holder becomes the torch engine's execution form of its layer (its affine kernel on a CPU, Triton on
CUDA). A quantized table a tied head reads is read as that head too. Routed experts stored as mlx-lm's stacks
(``switch_mlp``, float or quantized) are taken into transformers' experts modules by switch.py, so a float
checkpoint holding them loads here too, with the values mlx-lm's own layout stores otherwise put back
(mlx_layout.py).

A checkpoint whose quantized tensors do not carry the model's own names (mlx-lm's names for a multimodal family;
routed experts quantized one by one where transformers fuses them) is refused with the first name that does not
fit, never loaded with layers left random.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from umakit.backends import trim_heap
from umakit.backends.torch.load import exact
from umakit.backends.torch.load.loader import quant_spec
from umakit.backends.torch.load.packed import PackedCache
from umakit.backends.torch.load.packing_stream import first_packing
from umakit.backends.torch.cpu import affine_kernel as affine
from umakit.backends.torch.quant import forms
from umakit.backends.torch.quant.layout import QuantizedEmbedding, QuantizedLinear
from umakit.backends.transformers import mlx_layout, quantizer, switch
from umakit.errors import UnsupportedModelError


METHOD = "umakit-affine"  # the quantization method registered with transformers for MLX's layout


class _Packed(nn.Module):
    """A quantized layer as the checkpoint stores it, for transformers' loader to fill by name."""

    def __init__(self, rows: int, cols: int, bias: bool, bits: int, group: int, dtype: torch.dtype,
                 unread: bool = False):
        """``unread``: its codes, scales and biases are left in the checkpoint (its packing is kept: they are
        not parameters to fill, only their shapes)."""
        super().__init__()
        self.rows, self.cols, self.bits, self.group, self.unread = rows, cols, bits, group, unread
        meta = dict(device="meta")
        held = (lambda t: t) if unread else (lambda t: nn.Parameter(t, requires_grad=False))
        self.weight = held(torch.empty(rows, cols * bits // 32, dtype=torch.uint32, **meta))
        self.scales = held(torch.empty(rows, cols // group, dtype=dtype, **meta))
        self.biases = held(torch.empty(rows, cols // group, dtype=dtype, **meta))
        self.bias = nn.Parameter(torch.empty(rows, dtype=dtype, **meta), requires_grad=False) if bias else None

    def layout(self) -> QuantizedLinear:
        q = QuantizedLinear(self.cols, self.rows, self.bias is not None, self.bits, self.group, device="meta")
        q.weight, q.scales, q.biases = self.weight.data, self.scales.data, self.biases.data
        q.bias = None if self.bias is None else self.bias.data
        return q


def _swap_in_packed(model: nn.Module, c) -> None:
    c.stacks, c.convs = switch.swap_in(model, c.block, c.tensors), mlx_layout.before(model, c.tensors)
    modules = dict(model.named_modules())
    table, head = model.get_input_embeddings(), model.get_output_embeddings()
    for path, module in modules.items():
        spec = quant_spec(path, c.block, c.tensors) if isinstance(module, (nn.Linear, nn.Embedding)) else None
        if spec is None:
            continue
        if type(module) is nn.Linear:
            rows, cols, bias = module.out_features, module.in_features, module.bias is not None
        elif isinstance(module, nn.Embedding):  # Gemma's scaled tables too (their embed_scale, a buffer)
            rows, cols, bias = module.num_embeddings, module.embedding_dim, False
            c.scales[path] = _embed_scale(module)
        else:
            continue
        stored = switch.SCALE_DTYPES.get(c.tensors[f"{path}.scales"].dtype, torch.float32)  # as the checkpoint has them
        c.packed[path] = _Packed(rows, cols, bias, spec["bits"], spec["group_size"], stored)
        sixteen = c.exact.get(path) if path not in c.scales else None
        if sixteen:  # a GGUF's Q6_K: read from the import's groups of 16, not its 8-bit copy (load/exact.py)
            c.packed[path] = _Packed(rows, cols, bias, sixteen["bits"], sixteen["group_size"], torch.float32,
                                     unread=True)
        elif path not in c.scales and c.kept is not None and _kept_whole(c.packed[path], c.kept.get(path)):
            c.packed[path] = _Packed(rows, cols, bias, spec["bits"], spec["group_size"], stored, unread=True)
        if c.packed[path].unread:  # none of its checkpoint tensors read
            c.unread.update(f"{path}.{k}" for k in ("weight", "scales", "biases"))
        quantizer.put(model, path, c.packed[path])
        if module is table and head is not None and f"{path}.scales" in c.tensors:
            c.head = next((p for p, m in modules.items() if m is head), None)
    if c.head is not None and f"{c.head}.weight" not in c.tensors and c.head not in c.packed:
        quantizer.put(model, c.head, _Deferred())  # read from the table after loading
    else:
        c.head = None


def _kept_whole(packed: _Packed, kept: dict) -> bool:
    """Whether ``kept`` (a layer's packing from an earlier load) holds all that packing the layer would make, so
    that its codes, scales and biases need not be read from the checkpoint at all."""
    return bool(kept) and affine.available() and affine.AffineLinear.reuses([packed.layout()], kept)


def _swap_in_forms(model: nn.Module, c) -> None:
    device = torch.device(c.device)
    dtype = c.dtype
    kept = c.kept.get if c.kept is not None else lambda path: {}
    # a first packing written as it is made, each layer's checkpoint pages let go of (as the torch engine's load)
    stream, made = first_packing(c.kept, lambda: len(c.packed) + _experts(c.stacks))
    switch.finish(model, c.stacks, device, dtype, kept, made)
    mlx_layout.after(model, c.convs)
    form = torch.bfloat16 if device.type == "cpu" else dtype  # "bfloat16" names the packed CPU forms
    # a scaled table (Gemma's) reads its 8-bit copy, which transformers filled: only the others are read here
    unkept = [path for path in c.exact if path in c.packed and path not in c.scales
              and not _kept_whole(c.packed[path], kept(path))]
    if unkept:  # read once, each layer in its place
        with exact.opened(c.ckpt) as f:
            for path in unkept:
                c.packed[path].weight, c.packed[path].scales, c.packed[path].biases = exact.read(
                    f, path, c.exact[path]["bits"])
    for path, packed in c.packed.items():
        if packed.weight.is_meta and not packed.unread:
            raise UnsupportedModelError(f"the checkpoint has no packed codes for {path} (transformers' name for one of "
                                        "its quantized layers)")
        q = packed.layout()
        if path in c.scales:
            table = QuantizedEmbedding(q.out_features, q.in_features, q.bits, q.group_size, dtype=dtype, device="meta")
            table.weight, table.scales, table.biases = q.weight, q.scales, q.biases
            quantizer.put(model, path, _Table(table, c.scales[path]))
            if c.head is not None and isinstance(model.get_submodule(c.head), _Deferred):
                quantizer.put(model, c.head, forms.for_execution(table.as_linear(), device, form, kept(c.head)))
        else:
            quantizer.put(model, path, forms.for_execution(q, device, form, kept(path)))
            if hasattr(layer := model.get_submodule(path), "packing"):
                made(path, layer, q)
            packed.weight = packed.scales = packed.biases = None  # the checkpoint's copy goes as its form comes
            if packed.unread and not isinstance(model.get_submodule(path), affine.AffineLinear):
                raise UnsupportedModelError(f"{path}: the packing kept under $UMAKIT_HOME/packed does not fit this "
                                            "load; delete it to pack again")
        del q
    if c.kept is not None:
        c.kept.store({path: m for path, m in model.named_modules() if hasattr(m, "packing")}, stream)
    trim_heap()


def _experts(stacks: dict) -> int:
    """The expert layers ``stacks`` may pack (for the packing's header room)."""
    return sum(getattr(getattr(s, name), "n", 0) for s in stacks.values() if isinstance(s, switch.SwitchMLP)
               for name in switch.PROJECTIONS)


def load(transformers, ckpt, device: torch.device, dtype: torch.dtype) -> tuple[nn.Module, int]:
    """(the model, its parameter count) of the quantized checkpoint ``ckpt``, ``dtype`` for its float tensors."""
    config_cls = quantizer.register(METHOD, _swap_in_packed, _swap_in_forms, lambda c: {
        k: v for k, v in c.block.items() if not isinstance(v, dict)})
    # packed: the `_Packed` holders by path; scales: what a quantized table's rows are multiplied by; head: a tied
    # head reading a quantized table
    # stacks: mlx-lm's stacked routed experts by path (switch.py); convs: the kernels mlx_layout.py moves; kept:
    # the packing an earlier CPU load kept (load/packed.py), and where this one's goes
    # exact: a GGUF import's layers held exactly in groups of 16 (load/exact.py), which umakit's CPU kernel reads
    kept = PackedCache.for_checkpoint(ckpt.path, ckpt.files) if device.type == "cpu" else None
    packs = device.type == "cpu" and affine.available()
    c = config_cls(block=ckpt.config.get("quantization") or {}, tensors=ckpt.tensors or {}, device=str(device),
                   dtype=dtype, packed={}, scales={}, head=None, stacks={}, convs=None, kept=kept, unread=set(),
                   exact=exact.layers(ckpt) if packs else {}, ckpt=ckpt)
    hf_config = transformers.AutoConfig.from_pretrained(str(ckpt.path))
    for cfg in {id(x): x for x in (hf_config, hf_config.get_text_config())}.values():
        cfg.quantization_config = None  # MLX's block, which transformers cannot read: ours instead
    try:
        model, info = transformers.AutoModelForCausalLM.from_pretrained(
            str(ckpt.path), config=hf_config, quantization_config=c, dtype=dtype, device_map={"": device},
            output_loading_info=True)
    except RuntimeError as e:  # its shapes refused: routed experts quantized one by one where transformers fuses them
        raise UnsupportedModelError(
            f"{ckpt.path}: transformers' model does not take this checkpoint's tensors "
            f"({str(e).splitlines()[0][:200]}); quantized routed experts stored one by one run on --backend torch "
            "or mlx") from None
    check_loaded(ckpt, model, {**info, "unexpected_keys": set(info.get("unexpected_keys", ())) - c.unread})
    if device.type == "cpu":
        _off_the_map(model, ckpt.files)
    params = sum(p.rows * p.cols + (p.rows if p.bias is not None else 0) for p in c.packed.values())
    params += switch.params(c.stacks)
    c.packed, c.stacks = {}, {}  # the config outlives the load (the model's config holds it): not its holders
    return model.eval(), params + sum(p.numel() for p in model.parameters())


def _embed_scale(module: nn.Embedding) -> float | None:
    """What a scaled embedding (Gemma's) multiplies its rows by; its buffer is still on the meta device here."""
    scale = getattr(module, "scalar_embed_scale", None)
    if scale is None and getattr(module, "embed_scale", None) is not None:
        if module.embed_scale.is_meta:
            raise UnsupportedModelError(f"{type(module).__name__} scales its rows by a buffer umakit cannot read "
                                        "before the weights load; load its float original")
        scale = module.embed_scale
    return None if scale is None else float(scale)


class _Deferred(nn.Module):
    """A tied head's place while the weights load: transformers ties its ``weight`` to the table's codes, which
    it never reads; the table's execution form replaces it."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(0, device="meta"), requires_grad=False)


class _Table(nn.Module):
    """A quantized embedding table's looked-up rows, times the scale of a scaled embedding (Gemma's)."""

    def __init__(self, table: QuantizedEmbedding, scale: float | None):
        super().__init__()
        self.table, self.scale = table, scale

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        rows = self.table(ids)
        # as the float module does: the scale rounded to the rows' dtype first
        return rows if self.scale is None else rows * torch.tensor(self.scale, dtype=rows.dtype)


def check_loaded(ckpt, model: nn.Module, info: dict) -> None:
    """Refuse a checkpoint transformers loaded with tensors left over or parameters left unset (which it would
    otherwise initialize at random, and the model would run wrong)."""
    unexpected = [k for k in info.get("unexpected_keys", ()) if not k.endswith("inv_freq")]
    if unexpected:
        raise UnsupportedModelError(_unmapped(ckpt, sorted(unexpected)[0], "a parameter"))
    missing = sorted(info.get("missing_keys", ()))
    if missing:
        raise UnsupportedModelError(f"{ckpt.path}: the checkpoint has no tensor for {missing[0]} (of {len(missing)} "
                                    f"parameters transformers' {type(model).__name__} has and it lacks)")


def _unmapped(ckpt, name: str, what: str) -> str:
    return (f"{ckpt.path}: {name} is not {what} of transformers' model (the transformers engine reads a "
            "checkpoint by the model's own names); run it with --backend mlx, or load its float original")


def _off_the_map(model: nn.Module, files) -> None:
    """Copy out of the checkpoint's files every tensor of the model that transformers left reading them in place
    (the float tensors already in their dtype, a quantized table's codes): one such view keeps the whole mapped
    file, every page the load read, resident beside the packed forms that hold the rest already (a 1.4 GB
    Q4_K_M's 1.4 GB at rest). Where /proc/self/maps cannot be read, nothing is copied."""
    names = {str(Path(f).resolve()) for f in files}
    try:
        lines = Path("/proc/self/maps").read_text().splitlines()
    except OSError:
        return
    spans = [tuple(int(x, 16) for x in part[0].split("-")) for part in (line.split(maxsplit=5) for line in lines)
             if len(part) == 6 and part[5] in names]
    copies: dict[int, torch.Tensor] = {}  # a tensor two modules hold (a tied head) copied once
    for module in model.modules():
        for held in (module._parameters, module._buffers):
            for name, t in held.items():
                if t is None or not any(a <= t.data_ptr() < b for a, b in spans):
                    continue
                if id(t) not in copies:
                    out = t.detach().clone()
                    copies[id(t)] = nn.Parameter(out, requires_grad=False) if isinstance(t, nn.Parameter) else out
                held[name] = copies[id(t)]
