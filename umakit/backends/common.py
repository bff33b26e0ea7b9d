"""What every engine computes the same way about its weights: categories, checks, the per-token read.

Pure functions over tensor names and shapes (no framework), so the MLX and
torch engines report the same categories, the same message for the same broken
checkpoint, and the same bytes per decode step (of a mixture-of-experts model:
its dense weights and the share of the routed experts a token is sent to).
"""

from __future__ import annotations

import contextlib
import resource
import sys
from typing import Mapping, Sequence

from umakit.core import affine
from umakit.errors import CheckpointError
from umakit.backends.base import WeightInfo


def category(name: str) -> str:
    """Which part of the model a tensor belongs to: embedding, head, norms, attention, mlp or other."""
    if "embed" in name or "wte" in name:
        return "embedding"
    if name.startswith("lm_head") or ".lm_head" in name or name.startswith("output."):
        return "head"
    if "norm" in name or name.endswith("ln_f.weight"):
        return "norms"
    if "attn" in name or "attention" in name:
        return "attention"
    if "mlp" in name or "feed_forward" in name or "experts" in name:
        return "mlp"
    return "other"


ROUTED_EXPERTS = ".switch_mlp."  # in a tensor's name: mlx-lm's (and the torch engine's) stacked routed experts


def is_routed_expert(name: str) -> bool:
    """Whether a tensor belongs to the routed experts (a shared expert or a dense MLP does not)."""
    return ROUTED_EXPERTS in name


def routed_share(config: dict) -> float:
    """Share of the routed experts' bytes one token reads: experts per token / experts (1.0: no experts)."""
    cfg = {**config, **(config.get("text_config") or {})}
    experts = int(cfg.get("num_local_experts") or cfg.get("num_experts") or cfg.get("n_routed_experts") or 0)
    per_token = int(cfg.get("num_experts_per_tok") or 0)
    return min(per_token / experts, 1.0) if experts > 1 and per_token else 1.0


def check_weights(expected: Mapping[str, Sequence[int]], given: Mapping[str, Sequence[int]],
                  source: Mapping[str, str] | None = None) -> None:
    """Name the first missing, unexpected or mis-shaped tensor before any data is read.

    ``expected`` and ``given`` map the model's tensor names to shapes;
    ``source`` maps a model name to the checkpoint's own name, for messages.
    """
    source = source or {}
    missing = [k for k in expected if k not in given]
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise CheckpointError(f"checkpoint is missing tensor {missing[0]}{more}")
    unexpected = [k for k in given if k not in expected]
    if unexpected:
        more = f" (and {len(unexpected) - 1} more)" if len(unexpected) > 1 else ""
        raise CheckpointError(f"checkpoint has unexpected tensor {source.get(unexpected[0], unexpected[0])}{more} "
                              "for this model_type")
    for name, shape in given.items():
        if tuple(shape) != tuple(expected[name]):
            raise CheckpointError(f"tensor {source.get(name, name)} has shape {list(shape)} "
                                  f"but the config implies {list(expected[name])}")


def weight_info(by_category: dict[str, int], params: int, vocab_size: int, kv_bytes_per_token: float,
                quantization: dict | None, execution: str = "", streamed_bytes_per_token: int = 0,
                routed_bytes: int = 0, routed_read_share: float = 1.0) -> WeightInfo:
    """A `WeightInfo` from bytes by category; ``execution`` says how quantized layers run, if it matters.

    ``routed_bytes`` are the routed experts' (all of them, within ``by_category``); a decode token
    reads ``routed_read_share`` of them (`routed_share`), so ``bytes_per_token`` counts that much.
    """
    total = sum(by_category.values())
    embed = by_category.get("embedding", 0)
    tied = "head" not in by_category
    # A decode step reads one embedding row, but a tied head reads the whole table.
    per_token = total if tied else total - embed + embed // max(vocab_size, 1)
    per_token -= routed_bytes - round(routed_bytes * routed_read_share)
    described = affine.describe(quantization)
    if quantization and execution:
        described += f" ({execution})"
    return WeightInfo(
        total_bytes=total,
        by_category=by_category,
        params=params,
        bytes_per_token=per_token,
        kv_bytes_per_token=kv_bytes_per_token,
        quantization=described,
        streamed_bytes_per_token=streamed_bytes_per_token,
    )


def logical_params(shapes: Mapping[str, Sequence[int]], quantization: dict | None) -> int:
    """Weights a model has: a packed uint32 word holds 32/bits of them; scales and biases are not counted."""
    q = quantization or {}
    n = 0
    for name, shape in shapes.items():
        if name.endswith((".scales", ".biases")) or "rotary_emb" in name:
            continue
        count = 1
        for d in shape:
            count *= int(d)
        module = name.rsplit(".", 1)[0]
        if name.endswith(".weight") and f"{module}.scales" in shapes:
            count = count * 32 // bits_of(module, q)
        n += count
    return n


def bits_of(module: str, quantization: dict) -> int:
    """Bits of a quantized module: its own override in the config block, else the block's."""
    override = quantization.get(module)
    return override["bits"] if isinstance(override, dict) else quantization.get("bits", 32)


def reset_process_peak_memory() -> None:
    """Reset the process's peak resident memory (Linux's VmHWM), where the system lets it; else nothing."""
    if sys.platform == "linux":
        with contextlib.suppress(OSError):  # some sandboxes forbid it
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")


def process_peak_memory() -> int:
    """The process's peak resident memory, in bytes (a CPU engine's peak memory)."""
    with contextlib.suppress(OSError, ValueError, StopIteration):
        with open("/proc/self/status") as f:
            return int(next(line for line in f if line.startswith("VmHWM:")).split()[1]) * 1024
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024
