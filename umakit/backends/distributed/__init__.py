"""Sharded engines: one model across the ranks of an ``mlx.launch`` (mx.distributed) run.

Importing this package imports no mlx. ``load`` is what `umakit.load` calls
for ``parallel="tensor"|"pipeline"``: on rank 0 it returns an engine that
implements the declared protocol (`umakit.backends.base.Engine`) and drives
the other ranks; on every other rank it follows rank 0's calls until rank 0
shuts down, then ends the process (a follower has no user of its own).
"""

from __future__ import annotations

import os

from umakit.core.sharding import MODES
from umakit.errors import InvalidArgumentError, UmakitError
# Seconds a rank waits inside one collective of a running step before it calls the run lost. A step of a large
# model over a slow link takes well under a second; a dead or unplugged peer never answers.
COLLECTIVE_TIMEOUT_S = 10.0


class DistributedError(UmakitError):
    """A distributed run cannot start (no launcher, mismatched ranks) or lost a rank."""


def launcher() -> str | None:
    """Which launcher started this process: "mlx" (mlx.launch), "torch" (torchrun), or None."""
    if "MLX_RANK" in os.environ:
        return "mlx"
    if "TORCHELASTIC_RUN_ID" in os.environ or ("LOCAL_RANK" in os.environ and "WORLD_SIZE" in os.environ):
        return "torch"
    return None


def is_follower() -> bool:
    """Whether the launcher started this process as a rank other than 0 (one that follows rank 0)."""
    rank = os.environ.get("MLX_RANK") if launcher() == "mlx" else os.environ.get("RANK", "0")
    return rank not in (None, "0")


def backend_for(backend: str, parallel: str | None) -> str:
    """The engine a parallel run takes when the user said "auto": the launcher's."""
    if parallel is None or backend not in (None, "auto"):
        return backend
    return "torch" if launcher() == "torch" else "mlx"


def check_mode(parallel: str) -> None:
    if parallel not in MODES:
        raise InvalidArgumentError(f"unknown --parallel {parallel!r}; choose {' or '.join(MODES)}")


def load(engine_name: str, parallel: str, ckpt, **options):
    """The sharded engine of ``ckpt`` on this rank (rank 0), or follow rank 0 and exit (other ranks)."""
    check_mode(parallel)
    ckpt = ckpt.complete()  # shards of MLX's layout: a GGUF's Q6_K layers as their 8-bit copies
    want = "torchrun" if engine_name == "torch" else "mlx.launch"
    if launcher() != ("torch" if engine_name == "torch" else "mlx"):
        example = ("torchrun --nproc_per_node 2 $(which umakit)" if engine_name == "torch"
                   else "mlx.launch -n 2 --backend ring -- $(which umakit)")
        raise DistributedError(f"--parallel {parallel} on the {engine_name} backend needs several ranks: start the "
                               f"command with {want}, e.g. `{example} generate ... --parallel {parallel}`")
    if engine_name == "torch":
        from umakit.backends.distributed.torch_engine import start
    else:
        from umakit.backends.distributed.mlx_engine import start
    return start(ckpt, parallel, **options)
