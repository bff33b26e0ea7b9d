"""gpt-oss checkpoints in the layout of the torch model's experts (model/openai_moe.py).

Users download two layouts: OpenAI's own (openai/gpt-oss-*, and what umakit's import of a gpt-oss GGUF writes),
each layer's routed experts in MXFP4, ``mlp.experts.gate_up_proj_blocks`` (experts, out, in / 32, 16) and
``..._scales`` (experts, out, in / 32) beside a float ``..._bias``; and transformers' float save (the bfloat16
conversions), ``mlp.experts.gate_up_proj`` (experts, in, out) and its ``_bias``. Both become the model's
``mlp.switch_mlp.gate_up_proj.{weight,bias}`` (experts, out, in): MXFP4 exactly, as MLX's affine layout at 5 bits
in groups of 32 (quant/mxfp4.py) with bfloat16 steps (a power of two each, exact for every exponent byte), 6 bits
a weight where the checkpoint takes 4.25; the float ones transposed. Names, shapes and the quantization block
change before any tensor is read, so the loader's checks see the model's.
"""

from __future__ import annotations

import re

import torch

from umakit.checkpoint.config import text_config
from umakit.errors import CheckpointError
from umakit.backends.torch.quant.mxfp4 import BITS, GROUP, OFFSET, packed_codes, steps

EXPERTS = re.compile(r"^(model\.layers\.\d+\.mlp)\.experts\.(gate_up_proj|down_proj)(_blocks|_scales|_bias)?$")


def _target(name: str) -> tuple[str, str | None] | None:
    """(the model's module path, the checkpoint's suffix) of an experts tensor; None for any other."""
    m = EXPERTS.match(name)
    return None if m is None else (f"{m[1]}.switch_mlp.{m[2]}", m[3])


def layout(config: dict, shapes: dict) -> tuple[dict, dict]:
    """``config`` and ``shapes`` with a gpt-oss checkpoint's experts as the model holds them (their names, shapes
    and quantization block); unchanged for any other model."""
    if text_config(config).get("model_type") != "gpt_oss":
        return config, shapes
    quantization = dict(config.get("quantization") or {})
    out: dict[str, tuple] = {}
    for name, shape in shapes.items():
        found = _target(name)
        if found is None:
            out[name] = tuple(shape)
            continue
        target, part = found
        if part == "_bias":
            out[f"{target}.bias"] = tuple(shape)
        elif part is None:  # transformers' float (experts, in, out)
            e, cols, rows = shape
            out[f"{target}.weight"] = (e, rows, cols)
        elif part == "_blocks":
            if name.replace("_blocks", "_scales") not in shapes:
                raise CheckpointError(f"the checkpoint has {name} but no {name.replace('_blocks', '_scales')}")
            e, rows, groups, _ = shape
            out[f"{target}.weight"] = (e, rows, groups * GROUP * BITS // 32)
            out[f"{target}.scales"] = out[f"{target}.biases"] = (e, rows, groups)
            if quantization.get("bits") not in (None, BITS) or quantization.get("group_size") not in (None, GROUP):
                quantization[target] = {"bits": BITS, "group_size": GROUP}
            else:  # mlx-lm's rule: only the modules whose scales the checkpoint holds are quantized
                quantization.update(bits=BITS, group_size=GROUP)
    return ({**config, "quantization": quantization} if quantization else config), out


def tensors(config: dict, shapes: dict, source, kept=frozenset()):
    """``source`` (``source(skip)`` yields the checkpoint's (name, tensor) pairs; ``shapes``: the checkpoint's)
    as the model's tensors (`layout`). MXFP4 codes are unpacked and packed again as MLX's 5-bit layout, unless
    ``kept`` (the names of a packing an earlier CPU load kept, load/packed.py) holds every expert's packed layer
    of that projection: then its blocks are not read, and the model is handed a placeholder of the codes' shape
    (one word, repeated) that `quant.forms.pack_experts` never reads."""
    if text_config(config).get("model_type") != "gpt_oss":
        return source
    done = set()
    for name, shape in shapes.items():
        found = _target(name)
        if found and found[1] == "_blocks" and all(f"{found[0]}.forms.{e}.codes0" in kept for e in range(shape[0])):
            done.add(found[0])

    def stream(skip=frozenset()):
        pending: dict[str, dict] = {}
        blocks = {n for n in shapes if (found := _target(n)) and found[1] == "_blocks" and found[0] in done}
        for name, t in source(skip | blocks):
            found = _target(name)
            if found is None:
                yield name, t
                continue
            target, part = found
            if part == "_bias":
                yield f"{target}.bias", t
            elif part is None:
                yield f"{target}.weight", t.transpose(1, 2).contiguous()
            else:  # MXFP4: blocks and scales, in either order
                held = pending.setdefault(target, {})
                held[part] = t
                if len(held) == 2 or target in done:
                    del pending[target]
                    step = steps(held["_scales"], torch.bfloat16)
                    if target in done:
                        e, rows, groups = step.shape
                        codes = torch.zeros(1, dtype=torch.uint32).expand(e, rows, groups * GROUP * BITS // 32)
                    else:
                        codes = packed_codes(held["_blocks"])
                    yield f"{target}.weight", codes
                    yield f"{target}.scales", step
                    yield f"{target}.biases", step * -OFFSET

    return stream
