"""Tensor parallel against one process: `umakit bench` alone, under mlx.launch and under torchrun.

    python benchmarks/distributed.py path/to/model            # 2 ranks, both engines
    python benchmarks/distributed.py path/to/model --ranks 3 --engines mlx --gen-tokens 128

Each row is one `umakit bench --json` run: decode tok/s, the link time a
decode step waits on (measured at load: the median of one all-reduce of the
hidden state, times the collectives of a step) and its share of the step.
On one machine the ranks share its cores and memory bandwidth, so this
measures the overhead of sharding, not a speed-up: that needs one rank per
machine (or per GPU).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

BIN = Path(sys.executable).parent


def bench(model: str, engine: str, ranks: int, args: list[str], out: Path) -> dict:
    umakit = str(BIN / "umakit")
    common = ["bench", model, "--backend", engine, "--device", "cpu", *args, "--json", str(out)]
    if ranks == 1:
        cmd = [umakit, *common]
    elif engine == "mlx":
        cmd = [str(BIN / "mlx.launch"), "-n", str(ranks), "--backend", "ring", "--python", sys.executable, "--",
               umakit, *common, "--parallel", "tensor"]
    else:
        cmd = [str(BIN / "torchrun"), "--nproc_per_node", str(ranks), umakit, *common, "--parallel", "tensor"]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0 or not out.exists():
        raise SystemExit(f"{' '.join(cmd)} failed:\n{proc.stderr[-2000:]}")
    record = json.loads(out.read_text())
    return {"engine": engine, "ranks": ranks, "decode_tps": record["summary"]["decode_tps"]["median"],
            "weight_bytes": record["model"]["weight_bytes"], "comm_ms": record["model"]["comm_s_per_token"] * 1e3,
            "comm_share": record["summary"]["comm_share"]["median"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model")
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--engines", default="mlx,torch")
    ap.add_argument("--prompt-tokens", default="128")
    ap.add_argument("--gen-tokens", default="64")
    ap.add_argument("--repeat", default="3")
    a = ap.parse_args()
    args = ["--prompt-tokens", a.prompt_tokens, "--gen-tokens", a.gen_tokens, "--repeat", a.repeat]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for engine in a.engines.split(","):
            for ranks in (1, a.ranks):
                rows.append(bench(a.model, engine, ranks, args, Path(tmp) / f"{engine}-{ranks}.json"))
    print("| engine | ranks | decode tok/s | rank 0 weights (MiB) | link ms/token | link share of a step |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['engine']} | {r['ranks']} | {r['decode_tps']:.2f} | {r['weight_bytes'] / 2**20:.1f} | "
              f"{r['comm_ms']:.2f} | {r['comm_share']:.0%} |")


if __name__ == "__main__":
    main()
