"""Tensor parallel on the torch engine under torchrun (gloo on CPU, NCCL on CUDA), as gpt-fast splits a model.

Each rank builds umakit's own torch model over its slice of the checkpoint:
q/k/v and gate/up split by output rows (whole heads, whole MLP channels),
o_proj and down_proj by input columns, quantized layers' packed words, scales
and biases alike, and each attention and MLP output all-reduced. Slices are
read from the safetensors files directly, so a rank reads only its part.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from umakit.errors import InvalidArgumentError, UnsupportedModelError
from umakit.backends.base import BATCH, EngineSpec
from umakit.backends.torch.engine import TorchEngine
from umakit.backends.torch.load.loader import SAFETENSORS_FLOATS, compute_dtype
from umakit.backends.distributed import DistributedError
from umakit.core.sharding import PIPELINE, TENSOR
from umakit.backends.distributed.leader import LeaderEngine, check_same_everywhere, lead_or_follow, per_token_collectives, timed
from umakit.backends.distributed.torch_channel import TorchChannel

SPEC = EngineSpec(name="torch", module=__name__, cls="TorchLeader", dependency="torch", extra="umakit[cuda]",
                  devices=("cuda", "cpu"), features=frozenset({BATCH}))
COLUMN = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")  # split by output rows
ROW = ("o_proj", "down_proj")  # split by input columns; their outputs are summed over the ranks


class TorchLeader(LeaderEngine):
    spec = SPEC


def split_of(name: str) -> str | None:
    """"column", "row" or None (kept whole) for a checkpoint tensor."""
    module = name.rsplit(".", 2)[-2] if name.count(".") >= 2 else ""
    return "column" if module in COLUMN else "row" if module in ROW else None


def shard_config(config: dict, n: int) -> dict:
    """config.json as one rank's model sees it: 1/n of the heads and MLP channels."""
    c = config.get("text_config", config)
    if c.get("num_experts") or c.get("num_local_experts"):
        raise UnsupportedModelError("tensor parallel on the torch backend splits dense MLPs only, not experts")
    if c.get("model_type") == "gemma4_text":  # heads of two sizes and counts, per-layer inputs: not split here
        raise UnsupportedModelError("tensor parallel on the torch backend does not split gemma4's layers (heads "
                                    "of two sizes, shared keys and values); run it in one process")
    heads = c["num_attention_heads"]
    kv = c.get("num_key_value_heads") or heads
    for key, value in (("num_attention_heads", heads), ("num_key_value_heads", kv),
                       ("intermediate_size", c["intermediate_size"])):
        if value % n:
            raise UnsupportedModelError(f"{key} = {value} does not divide among {n} ranks for tensor parallel; "
                                        "use a rank count that divides it")
    shard = {**c, "num_attention_heads": heads // n, "num_key_value_heads": kv // n,
             "intermediate_size": c["intermediate_size"] // n,
             "head_dim": c.get("head_dim") or c["hidden_size"] // heads}
    return shard if c is config else {**config, "text_config": shard}


def shard_shape(name: str, shape, n: int) -> tuple:
    kind = split_of(name)
    if kind is None or (kind == "row" and name.endswith(".bias")):
        return tuple(shape)
    dim = 0 if kind == "column" else 1
    if shape[dim] % n:
        raise UnsupportedModelError(f"{name} has {shape[dim]} {'rows' if dim == 0 else 'columns'}, which do not "
                                    f"divide among {n} ranks")
    return tuple(s // n if i == dim else s for i, s in enumerate(shape))


def read_shard(ckpt, rank: int, n: int, device: str, progress=None):
    """(name, tensor) of this rank's part of every checkpoint tensor, read slice by slice."""
    from safetensors import safe_open

    done, total = 0, ckpt.nbytes
    for file in ckpt.files:
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for key in f.keys():
                kind, part = split_of(key), f.get_slice(key)
                rows = part.get_shape()
                if kind is None:
                    t = f.get_tensor(key)
                elif kind == "row" and key.endswith(".bias"):
                    t = f.get_tensor(key)
                    t = t if rank == 0 else torch.zeros_like(t)  # added once, by rank 0, after the sum
                elif kind == "column":
                    step = rows[0] // n
                    t = part[rank * step:(rank + 1) * step]
                else:
                    step = rows[1] // n
                    t = part[:, rank * step:(rank + 1) * step]
                yield key, t.to(device)
                done += ckpt.tensors[key].nbytes // (1 if kind is None else n)
                if progress:
                    progress(min(done, total), total)


def _all_reduce(module, inputs, output):
    dist.all_reduce(output)
    return output


def start(ckpt, parallel: str, *, device: str, dtype: str = "auto", progress=None, quantize=None,
          gpu_layers=None, vram_budget=None):
    """Rank 0: the `TorchLeader` of the torchrun job. Other ranks: follow rank 0 until it shuts down, then exit."""
    if parallel == PIPELINE:
        raise UnsupportedModelError(f"the torch backend offers {TENSOR} parallel only; use --parallel {TENSOR}")
    if quantize is not None or gpu_layers is not None or vram_budget is not None:
        raise InvalidArgumentError("--quantize/--gpu-layers/--vram-budget do not combine with --parallel")
    if not dist.is_initialized():
        dist.init_process_group("nccl" if device == "cuda" else "gloo")
    rank, n = dist.get_rank(), dist.get_world_size()
    if n < 2:
        raise DistributedError(f"--parallel {parallel} found one rank only: start it with torchrun --nproc_per_node 2")
    where = torch.device(f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}" if device == "cuda" else "cpu")
    if device == "cuda":
        torch.cuda.set_device(where)
    channel = TorchChannel(where)
    check_same_everywhere(channel, ckpt)
    config = shard_config(ckpt.config, n)
    shapes = {k: shard_shape(k, t.shape, n) for k, t in ckpt.tensors.items()}
    floats = [SAFETENSORS_FLOATS[t.dtype] for t in ckpt.tensors.values() if t.dtype in SAFETENSORS_FLOATS]
    target = str(compute_dtype(dtype, floats, device, ckpt.config.get("quantization"))).removeprefix("torch.")
    engine = TorchEngine.from_tensors(config, shapes, lambda: read_shard(ckpt, rank, n, str(where),
                                                                         progress if rank == 0 else None),
                                      device=device, dtype=target)
    engine.config = {**ckpt.config}  # what users see: the model's own config, not one rank's shapes
    for block in engine.model.model.layers:
        block.self_attn.register_forward_hook(_all_reduce)
        block._modules[block.ffn_name].register_forward_hook(_all_reduce)
    engine.load_notes = (f"{parallel} parallel over {n} ranks: rank {rank} holds "
                         f"{engine.weight_info().total_bytes / 2**20:.1f} MiB of the weights",)
    channel.barrier("the end of loading")
    hidden = torch.zeros(1, engine.args.hidden_size, dtype=engine.cache_dtype, device=where)
    each = timed(lambda: channel.run(lambda: dist.all_reduce(hidden), "a link check", True))
    steps = per_token_collectives(parallel, engine.args.num_hidden_layers, n)
    return lead_or_follow(engine, channel, TorchLeader, each * steps)
