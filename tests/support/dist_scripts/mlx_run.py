"""One rank of a test run under mlx.launch or torchrun (or alone, for the single-process reference).

usage: mlx_run.py OUT_DIR MODEL PARALLEL|none [--batch] [--tokens N] [--temp T] [--kill-rank R --kill-after N]
Rank 0 writes OUT_DIR/result.json (tokens, bytes); every rank writes OUT_DIR/rank<R>.json at exit (peak memory).
"""

import argparse
import atexit
import json
import os
import resource
import signal
from pathlib import Path

import mlx.core as mx

import umakit

p = argparse.ArgumentParser()
p.add_argument("out")
p.add_argument("model")
p.add_argument("parallel")
p.add_argument("--batch", action="store_true")
p.add_argument("--backend", default="mlx", help="mlx (under mlx.launch) or torch (under torchrun)")
p.add_argument("--tokens", type=int, default=12)
p.add_argument("--dtype", default="auto")
p.add_argument("--temp", type=float, default=0.0)
p.add_argument("--kill-rank", type=int, default=None)
p.add_argument("--kill-after", type=int, default=3)
p.add_argument("--model-rank1", default=None, help="another checkpoint on rank 1 (the start-up check's test)")
a = p.parse_args()
out = Path(a.out)
rank = int(os.environ.get("MLX_RANK") or os.environ.get("RANK") or 0)


@atexit.register
def _peak():
    peak = mx.get_peak_memory() if a.backend == "mlx" else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    (out / f"rank{rank}.json").write_text(json.dumps({"peak": peak}))


PROMPTS = ["The quick brown fox", "Paris is the capital", "Unified memory lets"]
parallel = None if a.parallel == "none" else a.parallel
if a.kill_rank is not None and rank == a.kill_rank and rank != 0:
    # A follower never returns from load: count its decode steps by the messages it is sent.
    from umakit.backends.distributed.messages import MessageChannel

    seen = {"n": 0}
    receive = MessageChannel.receive

    def counting(self, bounded=True):
        message = receive(self, bounded)
        seen["n"] += message.get("op") == "next"
        if seen["n"] >= a.kill_after:
            os.kill(os.getpid(), signal.SIGKILL)
        return message

    MessageChannel.receive = counting

model = a.model_rank1 if a.model_rank1 and rank == 1 else a.model
m = umakit.load(model, backend=a.backend, device="cpu", dtype=a.dtype, parallel=parallel)
result = {"weight_bytes": m.info.weights.total_bytes, "warnings": m.info.warnings}
if a.batch:
    run = m.generate_batch(PROMPTS, max_tokens=a.tokens, temperature=a.temp, seed=7, raw=True)
    result["batch"] = [r.tokens for r in run.results]
if a.kill_rank is not None:
    for i, chunk in enumerate(m.stream(PROMPTS[0], max_tokens=10_000, temperature=a.temp, seed=7, raw=True)):
        if a.kill_rank == 0 and i >= a.kill_after:
            os.kill(os.getpid(), signal.SIGKILL)
result["tokens"] = m.generate(PROMPTS[0], max_tokens=a.tokens, temperature=a.temp, seed=7, raw=True).tokens
(out / "result.json").write_text(json.dumps(result))
