"""The light start's file (light.py), written by a full CPU load: the fused step's inputs besides the int4 packing.

Beside the packing's file (packed_cache.py), under the same key: the float32
norms, biases and RoPE frequencies as the engine holds them, the embedding
table's tensors (referred to in the checkpoint where they are its own bytes,
else stored), and a manifest in the header's metadata: the model's shape, where
each tensor of the C entry point is, and what the engine measured of itself
(its `WeightInfo`), so a light start reports what a full load does. Written
once per key, only for a model light.cpp runs exactly as the engine does
(every tensor checked against the engine's); a file that cannot be written is
skipped (the next start loads the full engine).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save
from torch import nn

from ...checkpoint import Checkpoint
from ...errors import WriteError
from ...fsutil import atomic_file
from .cache_key import light_path
from .light import LIGHT_FORMAT, METADATA_KEY, read_header
from .loader import _sanitize
from .model import RMSNorm
from .packed_cache import _aligned_file
from .quant import Int4PackLinear, QuantizedEmbedding


def write(engine, packed_file: Path, ckpt: Checkpoint, dtypes: list[str]) -> bool:
    """Write the light file of ``engine`` (a CPU TorchEngine whose fused step is on) unless it exists; whether
    one is there now. ``dtypes``: the ``--dtype`` values that load this form."""
    path = light_path(packed_file)
    if _current(path, dtypes):
        return True
    fused, model = engine._fusing(), engine.model
    if fused is None or not packed_file.exists():
        return False
    form = _form(engine, fused, model, packed_file, ckpt)
    if form is None:
        return False
    stored, manifest = form
    manifest.update(format=LIGHT_FORMAT, torch=torch.__version__, dtype=engine.dtype,
                    dtypes=dtypes,
                    cpu_capability=torch.backends.cpu.get_cpu_capability(),
                    weight_info=dataclasses.asdict(engine.weight_info()))
    try:
        with atomic_file(path, "wb") as f:
            f.write(_aligned_file(save(stored, metadata={METADATA_KEY: json.dumps(manifest)})))
    except WriteError:
        return False
    return True


def _current(path: Path, dtypes: list[str]) -> bool:
    """Whether ``path`` holds a light file this umakit, torch and CPU read, for these ``dtypes`` (else it is
    written again: an older format, a damaged file or another machine's would be passed over forever)."""
    try:
        header, _ = read_header(path)
        manifest = json.loads(header["__metadata__"][METADATA_KEY])
    except (OSError, ValueError, KeyError, TypeError):
        return False
    return (manifest.get("format") == LIGHT_FORMAT and manifest.get("torch") == torch.__version__
            and manifest.get("cpu_capability") == torch.backends.cpu.get_cpu_capability()
            and set(dtypes) <= set(manifest.get("dtypes", ())))


def _form(engine, fused, model, packed_file: Path, ckpt: Checkpoint):
    """(tensors to store, manifest) or None where light.cpp would not run this model as the engine does."""
    a = model.args
    head, norm, embed = model.lm_head, model.model.norm, model.model.embed_tokens
    if a.embed_scale is not None or a.final_logit_softcapping is not None:
        return None
    if not isinstance(head, Int4PackLinear) or head.bias is not None:
        return None
    if type(norm) is not RMSNorm or norm.weight.dtype != torch.float32:
        return None
    names = {m: n for n, m in model.named_modules()}
    stored: dict[str, torch.Tensor] = {"inv_freq": fused.inv_freq, "final_norm": norm.weight}
    refs: list[tuple[str, str]] = [("light", "inv_freq"), ("light", "final_norm")]
    packed_refs = {("packed", f"lm_head.{k}"): getattr(head, k) for k in ("packed", "scales_and_zeros")}
    refs += list(packed_refs)
    checkpoint_files: set[str] = set()
    if isinstance(embed, QuantizedEmbedding):
        if embed.bits not in (4, 8) or embed.out_dtype != torch.float32:
            return None
        embed_bits, embed_group, parts = embed.bits, embed.group_size, ("weight", "scales", "biases")
    elif isinstance(embed, nn.Embedding) and embed.weight.dtype == torch.float32:
        embed_bits, embed_group, parts = 0, 0, ("weight",)
    else:
        return None
    for part in parts:
        ref = _in_checkpoint(ckpt, f"model.embed_tokens.{part}", getattr(embed, part))
        if ref is None:
            stored[f"embed.{part}"] = getattr(embed, part)
            ref = ("light", f"embed.{part}")
        else:
            checkpoint_files.add(ref[0].removeprefix("checkpoint:"))
        refs.append(ref)
    norms, qk_norms, packed, sz, groups, splits, biases = fused.weights
    for i, block in enumerate(model.model.layers):
        stored[f"l{i}.norm_in"], stored[f"l{i}.norm_post"] = norms[2 * i], norms[2 * i + 1]
        refs += [("light", f"l{i}.norm_in"), ("light", f"l{i}.norm_post")]
        if qk_norms:
            stored[f"l{i}.q_norm"], stored[f"l{i}.k_norm"] = qk_norms[2 * i], qk_norms[2 * i + 1]
            refs += [("light", f"l{i}.q_norm"), ("light", f"l{i}.k_norm")]
        attn, mlp = block.self_attn, block._modules[block.ffn_name]
        linears = [names[m] for m in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)]
        layer = {("packed", f"{n}.packed"): packed[4 * i + j] for j, n in enumerate(linears)}
        layer.update({("packed", f"{n}.scales_and_zeros"): sz[4 * i + j] for j, n in enumerate(linears)})
        packed_refs.update(layer)
        refs += list(layer)
        if biases:
            stored[f"l{i}.qkv_bias"] = biases[i]
            refs.append(("light", f"l{i}.qkv_bias"))
    if not _same_as_file(packed_file, {key: t for (_, key), t in packed_refs.items()}):
        return None
    nh, nkv, hd, eps, scale, window = fused.shape
    shape = dict(layers=a.num_hidden_layers, heads=nh, kv_heads=nkv, head_dim=hd, hidden=a.hidden_size,
                 vocab=head.out_features, max_tokens=a.max_position_embeddings, embed_bits=embed_bits,
                 embed_group=embed_group, head_group=head.group_size, head_split=bool(head.split),
                 qk_norm=bool(qk_norms), bias=bool(biases), window=window, groups=list(groups), splits=list(splits),
                 eps=eps, scale=scale)
    stored = {k: v.detach().contiguous() for k, v in stored.items()}
    return stored, {"shape": shape, "tensors": refs, "checkpoint_files": sorted(checkpoint_files)}


def _in_checkpoint(ckpt: Checkpoint, name: str, tensor: torch.Tensor) -> tuple[str, str] | None:
    """Where the checkpoint holds ``tensor`` (named ``name`` as loaded) byte for byte, if it does."""
    for key, info in ckpt.tensors.items():
        if _sanitize(key) == name and info.file.parent == ckpt.path:
            try:
                with safe_open(info.file, framework="pt") as f:
                    if _equal(f.get_tensor(key), tensor):
                        return f"checkpoint:{info.file.name}", key
            except (OSError, SafetensorError):
                return None
    return None


def _same_as_file(path: Path, tensors: dict[str, torch.Tensor]) -> bool:
    """Whether the packing's file holds each of ``tensors`` (by key), byte for byte."""
    try:
        with safe_open(path, framework="pt") as f:
            held = set(f.keys())
            return all(key in held and _equal(f.get_tensor(key), t) for key, t in tensors.items())
    except (OSError, SafetensorError):
        return False


def _equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Byte for byte (uint32 has few ops in torch; a NaN equals itself here)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))
