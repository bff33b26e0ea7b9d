"""The MLX engine with its model split across the ranks of an mx.distributed group.

Tensor parallel is mlx-lm's own ``Model.shard(group)`` (its sharded linears,
quantized ones with their scales and biases included), pipeline parallel
mlx_pipeline.py's stages; either is applied to the lazily loaded model before
any weight is read, so each rank reads and keeps only its part (the
embeddings, norms and head stay whole on every rank). Every sampled token is
broadcast from rank 0, so all ranks feed the same token even when they sample.
`start` is what a rank runs under mlx.launch.
"""

from __future__ import annotations

import contextlib
from typing import Sequence

import mlx.core as mx

from umakit.errors import InvalidArgumentError, UnsupportedModelError
from umakit.backends.base import BATCH, QUANTIZED_KV, EngineSpec
# The MLX engine, extended (this package wraps engines; nothing under backends/mlx imports it back).
from umakit.backends.mlx.engine import DTYPES, MLXEngine
from umakit.backends.distributed import DistributedError
from umakit.core.sharding import MODES, PIPELINE, TENSOR
from umakit.backends.distributed.channel import Channel
from umakit.backends.distributed.leader import LeaderEngine, check_same_everywhere, lead_or_follow, per_token_collectives, timed
from umakit.backends.distributed.mlx_pipeline import own_pipeline, pipeline

SPEC = EngineSpec(name="mlx", module=__name__, cls="MLXLeader", dependency="mlx", extra="umakit",
                  devices=("metal", "cpu"), features=frozenset({QUANTIZED_KV, BATCH}))


def modes_of(model, model_type: str) -> tuple[str, ...]:
    """The parallel modes this architecture offers: mlx-lm's, and umakit's own pipeline stages."""
    # mlx-lm declares these capabilities only by the methods its classes define.
    have = []
    if callable(getattr(model, "shard", None)):
        have.append(TENSOR)
    if callable(getattr(getattr(model, "model", None), "pipeline", None)) or own_pipeline(model_type, model):
        have.append(PIPELINE)
    return tuple(have)


def refuse_mode(model_type: str, parallel: str, have: Sequence[str]) -> None:
    if parallel in have:
        return
    offer = f"it offers {' and '.join(have)}" if have else f"it offers none of {', '.join(MODES)}"
    raise UnsupportedModelError(f"model_type {model_type!r} has no {parallel} parallel mode here; {offer}")


class ShardedMLXEngine(MLXEngine):
    """`MLXEngine` over this rank's shard; ``group`` is the mx.distributed group of the run."""

    def __init__(self, device: str, group, parallel: str):
        super().__init__(device)
        self.group, self.parallel = group, parallel
        self.timer = lambda what: contextlib.nullcontext()  # the channel's watchdog once the run starts

    @classmethod
    def load_shard(cls, ckpt, group, parallel: str, *, device: str, dtype: str = "auto", progress=None,
                   quantize=None) -> "ShardedMLXEngine":
        if quantize is not None:
            raise InvalidArgumentError("--quantize is not available with --parallel; quantize first "
                                       "(umakit quantize) and load the quantized model")
        self = cls(device, group, parallel)
        self.config = ckpt.config
        with mx.stream(self._mx_device):
            self._load(ckpt, dtype, progress)
        n, rank = group.size(), group.rank()
        self.load_notes = (f"{parallel} parallel over {n} ranks: rank {rank} holds "
                           f"{self.weight_info().total_bytes / 2**20:.1f} MiB of the weights",)
        return self

    def _split(self, model, ckpt) -> bool:
        # Slices of the still-unread arrays, or only some layers of them: each rank reads its part only.
        refuse_mode(ckpt.model_type, self.parallel, modes_of(model, ckpt.model_type))
        if self.parallel == TENSOR:
            self._check_divisible(ckpt.config)
            model.shard(self.group)
        else:
            pipeline(model, ckpt.model_type, self.group)
        return True

    def _check_divisible(self, config: dict) -> None:
        c = config.get("text_config", config)
        n = self.group.size()
        heads = c.get("num_attention_heads", 0)
        kv = c.get("num_key_value_heads") or heads
        for key, value in (("num_attention_heads", heads), ("num_key_value_heads", kv),
                           ("intermediate_size", c.get("intermediate_size", 0))):
            if value % n:
                raise UnsupportedModelError(f"{key} = {value} does not divide among {n} ranks for tensor parallel; "
                                            f"use a rank count that divides it")

    def kv_bytes_per_token(self, kv_bits: int | None = None) -> int:
        # Each rank caches its share of the KV heads (tensor) or of the layers (pipeline).
        return super().kv_bytes_per_token(kv_bits) // self.group.size()

    def _agree(self, token: mx.array) -> mx.array:
        """Rank 0's token on every rank (the others' draws are discarded)."""
        # Multiplied, not replaced by zeros: the others' token must still depend on their forward pass, or
        # that pass (and the collectives inside it) would never be evaluated there.
        token = token.astype(mx.uint32)
        return mx.distributed.all_sum(token * (1 if self.group.rank() == 0 else 0), group=self.group)

    def _take(self, token: mx.array) -> int:
        with self.timer("a decode step"):
            return token.item()


class MLXLeader(LeaderEngine):
    spec = SPEC


def start(ckpt, parallel: str, *, device: str, dtype: str = "auto", progress=None, quantize=None,
          gpu_layers=None, vram_budget=None):
    """Rank 0: the `MLXLeader` of the run. Other ranks: follow rank 0 until it shuts down, then exit."""
    if gpu_layers is not None or vram_budget is not None:
        raise InvalidArgumentError("--gpu-layers/--vram-budget do not combine with --parallel")
    group = mx.distributed.init()
    if group.size() < 2:
        raise DistributedError(f"--parallel {parallel} found one rank only: start it with mlx.launch -n 2 or more")
    channel = Channel(group, mx.gpu if device == "metal" else mx.cpu)
    check_same_everywhere(channel, ckpt)
    engine = ShardedMLXEngine.load_shard(ckpt, group, parallel, device=device, dtype=dtype,
                                         progress=progress if group.rank() == 0 else None, quantize=quantize)
    engine.timer = channel.guarded
    # Unbounded: a rank reading a large shard from a slow disk may take minutes longer than another.
    channel.collective(lambda: mx.distributed.all_sum(mx.array(1), group=group), "the end of loading", bounded=False)
    c = ckpt.config.get("text_config", ckpt.config)
    hidden = mx.zeros((1, c["hidden_size"]), dtype=DTYPES[engine.dtype])
    each = timed(lambda: channel.collective(lambda: mx.distributed.all_sum(hidden, group=group), "a link check"))
    steps = per_token_collectives(parallel, c["num_hidden_layers"], group.size())
    return lead_or_follow(engine, channel, MLXLeader, each * steps)
