"""Options shared by several commands; every default comes from the library."""

from __future__ import annotations

import click

from umakit.sampling import (
    DEFAULT_MAX_TOKENS,
    DEFAULT_MIN_P,
    DEFAULT_REPETITION_PENALTY,
    DEFAULT_TEMPERATURE,
    DEFAULT_TOP_K,
    DEFAULT_TOP_P,
)


quantize_option = click.option(
    "--quantize", type=click.Choice(["4", "8"]), default=None,
    help="Quantize a float checkpoint in memory on load (mlx backend; default recipe, group 64).")


def offload_options(f):
    """--gpu-layers, --vram-budget: stream the other layers from host memory (torch backend)."""
    f = click.option("--vram-budget", metavar="SIZE", default=None,
                     help="Keep as many layers in device memory as fit in SIZE (e.g. 24GB); stream the rest.")(f)
    f = click.option("--gpu-layers", type=click.IntRange(min=0), default=None, metavar="N",
                     help="Keep the first N layers in device memory; stream the rest from host memory each step.")(f)
    return f


def model_options(f):
    """--backend, --device, --dtype, --peak-bandwidth."""
    f = click.option("--peak-bandwidth", type=float, metavar="GB/s", help="Override the device's peak memory bandwidth.")(f)
    f = click.option("--dtype", default="auto", show_default=True, help="Compute dtype: auto, float32, float16, bfloat16.")(f)
    f = click.option("--device", default=None, help="Where the engine runs: metal, cuda or cpu (default: best available).")(f)
    f = click.option("--backend", default="auto", show_default=True, help="Engine: auto, mlx, torch (cuda = torch on CUDA).")(f)
    return f


def sampling_options(f):
    """--max-tokens, --temp, --top-p, --top-k, --min-p, --repetition-penalty, --seed."""
    opts = [
        click.option("--max-tokens", type=click.IntRange(min=1), default=DEFAULT_MAX_TOKENS, show_default=True),
        click.option("--temp", "temperature", type=click.FloatRange(min=0), default=DEFAULT_TEMPERATURE, show_default=True,
                     help="Sampling temperature; 0 is greedy."),
        click.option("--top-p", type=click.FloatRange(0, 1, min_open=True), default=DEFAULT_TOP_P, show_default=True),
        click.option("--top-k", type=click.IntRange(min=0), default=DEFAULT_TOP_K, show_default=True, help="0 disables."),
        click.option("--min-p", type=click.FloatRange(0, 1, max_open=True), default=DEFAULT_MIN_P, show_default=True),
        click.option("--repetition-penalty", type=click.FloatRange(min=0, min_open=True), default=DEFAULT_REPETITION_PENALTY,
                     show_default=True, help="1 disables."),
        click.option("--seed", type=int, default=None, help="Make sampling reproducible."),
    ]
    for opt in reversed(opts):
        f = opt(f)
    return f


SAMPLING_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
