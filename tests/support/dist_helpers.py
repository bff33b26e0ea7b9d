"""Launching test ranks through the real launchers (mlx.launch, torchrun), and the tiny models they load."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

VENV_BIN = Path(sys.executable).parent
LAUNCH = VENV_BIN / "mlx.launch"
TORCHRUN = VENV_BIN / "torchrun"
SCRIPT = Path(__file__).parent / "dist_scripts" / "mlx_run.py"
RUN_LIMIT_S = 90  # no launch may outlive this: a hang fails the test instead of stalling the suite
ENV = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[2])}


def launch(n: int, *command: str, timeout: float = RUN_LIMIT_S) -> subprocess.CompletedProcess:
    """``mlx.launch -n N --backend ring`` on localhost; ``command`` starts with a script or executable."""
    args = [str(LAUNCH), "-n", str(n), "--backend", "ring", "--python", sys.executable]
    return subprocess.run([*args, "--", *command], capture_output=True, text=True, timeout=timeout, env=ENV)


def torchrun(n: int, *command: str, timeout: float = RUN_LIMIT_S) -> subprocess.CompletedProcess:
    """``torchrun --nproc_per_node N`` (gloo on this CPU); ``command`` starts with a Python script."""
    return subprocess.run([str(TORCHRUN), "--nproc_per_node", str(n), *command], capture_output=True, text=True,
                          timeout=timeout, env=ENV)


def run_script(tmp_path: Path, model: Path, parallel: str, *extra: str, n: int = 2, name: str = "out",
               launcher=launch) -> dict:
    """tests/support/dist_scripts/mlx_run.py alone (``parallel="none"``) or under ``launcher``: its result and rank peaks."""
    out = tmp_path / f"{name}-{parallel}-{n}"
    out.mkdir()
    if parallel == "none":
        proc = subprocess.run([sys.executable, str(SCRIPT), str(out), str(model), "none", *extra],
                              capture_output=True, text=True, timeout=RUN_LIMIT_S, env=ENV)
    else:
        proc = launcher(n, str(SCRIPT), str(out), str(model), parallel, *extra)
    assert (out / "result.json").exists(), proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads((out / "result.json").read_text())
    result["peaks"] = [json.loads(p.read_text())["peak"] for p in sorted(out.glob("rank*.json"))]
    return result


def tiny_models(root: Path) -> dict[str, Path]:
    """Tiny llama and qwen3 checkpoints, float and quantized (4-bit llama, 8-bit qwen3)."""
    from support.tiny import make_tiny_model
    from umakit.quantize import quantize

    llama = make_tiny_model("llama", root / "llama")
    qwen3 = make_tiny_model("qwen3", root / "qwen3")
    quantize(llama, root / "llama-q4", bits=4, group_size=32)
    quantize(qwen3, root / "qwen3-q8", bits=8, group_size=32)
    return {"llama": llama, "qwen3": qwen3, "llama-q4": root / "llama-q4", "qwen3-q8": root / "qwen3-q8"}


def default_model_dir() -> Path:
    """The built-in model's import: the user's own if made (saves one), else this run's; skips without it."""
    import pytest

    from umakit import checkpoint
    from umakit.checkpoint.default import DEFAULT_MODEL_NAME
    from umakit.errors import UmakitError
    from umakit.core.home import DEFAULT_HOME

    default = DEFAULT_HOME.expanduser() / "models" / DEFAULT_MODEL_NAME
    if (default / "config.json").exists():
        return default
    try:
        return checkpoint.resolve(None)
    except UmakitError as e:
        pytest.skip(f"the default model is not available here: {e}")
