"""Options shared by several commands; every default comes from the library."""

from __future__ import annotations

import functools
import os
import sys
from pathlib import Path

import click

from umakit.core.affine import DEFAULT_BITS, DEFAULT_GROUP_SIZE, HIGH_BITS, KV_BITS
from umakit.generate.sampling import (
    DEFAULT_MAX_TOKENS,
    DEFAULT_MIN_P,
    DEFAULT_REPETITION_PENALTY,
    DEFAULT_TEMPERATURE,
    DEFAULT_TOP_K,
    DEFAULT_TOP_P,
)

from umakit.cli.format import size


QUANTIZE_BITS = (DEFAULT_BITS, HIGH_BITS)  # the widths --quantize offers: on load, only the common two


def _int_or_none(ctx, param, value):
    return None if value is None else int(value)


quantize_option = click.option(
    "--quantize", type=click.Choice([str(b) for b in QUANTIZE_BITS]), default=None, callback=_int_or_none,
    help=f"Quantize a float checkpoint in memory on load (mlx backend; default recipe, group {DEFAULT_GROUP_SIZE}).")

kv_bits_option = click.option(
    "--kv-bits", type=click.Choice([str(b) for b in KV_BITS]), default=None, callback=_int_or_none,
    help="Quantize the KV cache.")


def kv_needs(kv_bits: int | None) -> frozenset[str]:
    """The engine features a quantized KV cache needs, so that --backend auto picks an engine that has them."""
    if kv_bits is None:
        return frozenset()  # and no engine module imported: an attached `generate` starts without them
    from umakit.backends.base import QUANTIZED_KV

    return frozenset({QUANTIZED_KV})


def batch_kv_needs(kv_bits: int | None) -> frozenset[str]:
    """The engine features batches of quantized KV caches need (`batch`, `serve`)."""
    from umakit.backends.base import BATCH_KV_BITS

    return frozenset({BATCH_KV_BITS}) if kv_bits is not None else frozenset()


def lookup_needs(prompt_lookup: bool) -> frozenset[str]:
    """The engine features a batch's prompt lookup needs (`batch`, `serve`)."""
    from umakit.backends.base import LOOKUP

    return frozenset({LOOKUP}) if prompt_lookup else frozenset()


def offload_options(f):
    """--gpu-layers, --vram-budget: stream the other layers from host memory (torch backend)."""
    f = click.option("--vram-budget", metavar="SIZE", default=None,
                     help="Keep as many layers in device memory as fit in SIZE (e.g. 24GB); stream the rest.")(f)
    f = click.option("--gpu-layers", type=click.IntRange(min=0), default=None, metavar="N",
                     help="Keep the first N layers in device memory; stream the rest from host memory each step.")(f)
    return f


def model_argument(f):
    """MODEL as the command's argument, or with -m/--model as `umakit generate` takes it: either names it."""
    @functools.wraps(f)
    def merged(*args, model=None, model_flag=None, **kwargs):
        if model is not None and model_flag is not None and model != model_flag:
            raise click.UsageError(f"two models given, {model!r} and -m {model_flag!r}: give one")
        return f(*args, model=model if model is not None else model_flag, **kwargs)

    merged = click.option("--model", "-m", "model_flag", default=None, metavar="MODEL",
                          help="MODEL, as an option (as `umakit generate` takes it).")(merged)
    return click.argument("model", required=False)(merged)


def model_options(f):
    """--backend, --device, --dtype, --peak-bandwidth."""
    f = click.option("--peak-bandwidth", type=float, metavar="GB/s", help="Override the device's peak memory bandwidth.")(f)
    f = click.option("--dtype", default="auto", show_default=True, help="Compute dtype: auto, float32, float16, bfloat16.")(f)
    f = click.option("--device", default=None, help="Where the engine runs: metal, cuda or cpu (default: best available).")(f)
    f = click.option("--backend", default="auto", show_default=True,
                     help="Engine: auto, mlx, torch (cuda = torch on CUDA), transformers (any architecture it has).")(f)
    return f


def _checked(ctx, param, value):
    """The library's check of a sampling flag (click's ranges let nan and inf through)."""
    from umakit.core import validate
    from umakit.errors import InvalidArgumentError

    try:
        return validate.sampling_field(param.name, value)
    except InvalidArgumentError as e:
        raise click.BadParameter(str(e)) from e


def _checked_seed(ctx, param, value):
    from umakit.core import validate
    from umakit.errors import InvalidArgumentError

    try:
        return validate.seed(value)
    except InvalidArgumentError as e:
        raise click.BadParameter(str(e)) from e


def sampling_options(f):
    """--max-tokens, --temp, --top-p, --top-k, --min-p, --repetition-penalty, --seed."""
    opts = [
        click.option("--max-tokens", type=click.IntRange(min=1), default=DEFAULT_MAX_TOKENS, show_default=True),
        click.option("--temp", "temperature", type=click.FloatRange(min=0), default=DEFAULT_TEMPERATURE, show_default=True,
                     callback=_checked, help="Sampling temperature; 0 is greedy."),
        click.option("--top-p", type=click.FloatRange(0, 1, min_open=True), default=DEFAULT_TOP_P, show_default=True,
                     callback=_checked),
        click.option("--top-k", type=click.IntRange(min=0), default=DEFAULT_TOP_K, show_default=True, help="0 disables."),
        click.option("--min-p", type=click.FloatRange(0, 1, max_open=True), default=DEFAULT_MIN_P, show_default=True,
                     callback=_checked),
        click.option("--repetition-penalty", type=click.FloatRange(min=0, min_open=True), default=DEFAULT_REPETITION_PENALTY,
                     show_default=True, callback=_checked, help="1 disables."),
        click.option("--seed", type=int, default=None, callback=_checked_seed,
                     help="Make sampling reproducible (a signed 64-bit integer)."),
    ]
    for opt in reversed(opts):
        f = opt(f)
    return f


SAMPLING_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


def echo_warnings(warnings) -> None:
    """Each library warning as one yellow 'Warning:' line on stderr."""
    for warning in warnings:
        click.echo(click.style(f"Warning: {warning}", fg="yellow"), err=True)


class ImportBar:
    """An import's progress (a GGUF's, and the 8-bit copies of its Q6_K layers the first load that needs them
    makes; or GPTQ, AWQ or compressed-tensors weights': ``bar(done, total)``) as a bar on stderr, drawn from its
    first report and gone at its last: a first run shows what it is doing; a later run, which imports nothing, and
    output that is no terminal show nothing."""

    def __init__(self, source, note: str = " (first run only)"):
        self.label = f"Importing {Path(os.fspath(source)).name}{note}"
        self.bar = None

    def __call__(self, done: int, total: int) -> None:
        if self.bar is None:
            if not sys.stderr.isatty():
                return
            self.bar = click.progressbar(length=total, label=self.label, file=sys.stderr, show_pos=False)
            self.bar.__enter__()
        self.bar.update(done - self.bar.pos)
        if done >= total:
            self.close()

    def close(self) -> None:
        if self.bar is not None:
            bar, self.bar = self.bar, None
            bar.__exit__(None, None, None)


def load_model(model, *, show_progress: bool = False, **load_kwargs):
    """`umakit.load` with the CLI's handling of its warnings: every command loads through here.

    A GGUF's first run draws its import's bar on a terminal's stderr (`ImportBar`); ``show_progress`` draws
    one of the bytes read as well. The warnings follow the bars, never interleave with them.
    """
    import umakit

    importing = ImportBar(model or "the built-in model")
    try:
        if not show_progress:
            m = umakit.load(model, import_progress=importing, **load_kwargs)
        else:
            path = umakit.resolve_model(model, progress=importing)
            importing.close()
            total = umakit.checkpoint_size(path)
            with click.progressbar(length=total, label=f"Loading {path.name} ({size(total)} on disk)",
                                   file=sys.stderr, show_pos=False) as bar:
                m = umakit.load(path, progress=lambda done, _: bar.update(done - bar.pos), **load_kwargs)
                bar.update(total - bar.pos)  # the file headers are not tensor bytes
    finally:
        importing.close()  # an import that failed: its bar ends before the error line
    echo_warnings(m.info.warnings)
    return m


def parallel_option(f):
    """--parallel tensor|pipeline: one model across the ranks of an mlx.launch run."""
    from umakit.core.sharding import MODES

    return click.option(
        "--parallel", type=click.Choice(MODES), default=None,
        help="Under mlx.launch or torchrun: shard the model across the ranks (rank 0 reads and prints; the others "
             "follow).")(f)


def follow_unless_leader(parallel, model, **load_kwargs) -> None:
    """With --parallel on a rank other than 0: load this rank's shard and follow rank 0 (never returns).

    Called before a command reads input or opens its outputs: only rank 0 does either.
    """
    if not parallel:
        return
    from umakit.backends.distributed import is_follower

    if is_follower():
        load_model(model, parallel=parallel, **load_kwargs)


def speculative_options(f):
    """--draft, --draft-tokens, --prompt-lookup, --ngram: speculative decoding (lossless)."""
    return _speculation(f, "per step",
                        draft="Speculate with this smaller model (same tokenizer); greedy text is unchanged.",
                        lookup="Speculate with candidates copied from the prompt and the text so far (no second model).")


def lookup_options(f):
    """--prompt-lookup, --draft, --ngram, --draft-tokens for a batch's rows (`batch`, `serve`)."""
    return _speculation(f, "per row and step",
                        draft="Greedy requests speculate with this smaller model (same tokenizer), each on a cache of "
                              "its own; their text is unchanged.",
                        lookup="Greedy requests speculate with candidates copied from their own text; their text is "
                               "unchanged (the torch engine; on MLX and off the torch engine's fused CPU step, up "
                               "to near-ties).")


def _speculation(f, per: str, draft: str, lookup: str):
    from umakit.generate.speculative import (
        DEFAULT_DRAFT_TOKENS,
        DEFAULT_LOOKUP_TOKENS,
        DEFAULT_NGRAM,
        MAX_DRAFT_TOKENS,
        MAX_NGRAM,
    )

    f = click.option("--ngram", type=click.IntRange(1, MAX_NGRAM), default=None,
                     help=f"With --prompt-lookup: the n-gram to match (default {DEFAULT_NGRAM}).")(f)
    f = click.option("--prompt-lookup", is_flag=True, help=lookup)(f)
    f = click.option("--draft-tokens", type=click.IntRange(1, MAX_DRAFT_TOKENS), default=None, metavar="K",
                     help=f"Most tokens proposed {per} (default {DEFAULT_DRAFT_TOKENS} with --draft, "
                          f"{DEFAULT_LOOKUP_TOKENS} with --prompt-lookup).")(f)
    return click.option("--draft", metavar="MODEL", default=None, help=draft)(f)


def load_draft(m, draft):
    """The --draft model, loaded on the target's engine and device, deterministic where it is (None without
    --draft)."""
    return None if draft is None else load_model(draft, backend=m.info.backend, device=m.info.device,
                                                 deterministic=m.info.deterministic)


def deterministic_option(f):
    """--deterministic: every token on its own decode step's arithmetic (`umakit.load(deterministic=True)`)."""
    return click.option(
        "--deterministic", is_flag=True,
        help="Give every token the bits of its own decode step: a greedy or seeded reply then does not depend "
             "on the prompt cache, on how its prompt was split, or on what ran beside it (torch engine on a "
             "CPU, quantized models; long prompts prefill 2-6x slower).")(f)


def constraint_options(for_items: bool = False):
    """--json-schema, --regex, --choice, --grammar: what the reply must match (at most one).

    ``for_items`` (`batch`): each is the default for items without their own schema, regex, choices or grammar.
    """
    tail = ", for items without a constraint of their own." if for_items else "."

    def decorate(f):
        f = click.option("--grammar", metavar="FILE", default=None,
                         help="The reply matches the Lark grammar in FILE (llguidance's dialect)" + tail)(f)
        f = click.option("--choice", "choices", metavar="TEXT", multiple=True,
                         help="The reply is exactly one of these (repeatable)" + tail)(f)
        f = click.option("--regex", metavar="PATTERN", default=None,
                         help="The reply matches this regular expression in full" + tail)(f)
        f = click.option("--json-schema", metavar="FILE", default=None,
                         help="The reply is JSON valid against the JSON schema in FILE" + tail)(f)
        return f

    return decorate


def read_constraint(json_schema, regex, choices, grammar) -> dict:
    """The constraint flags as the library's ``schema``, ``regex``, ``choices`` and ``grammar`` (files read whole),
    checked by the library before any model loads: a bad file, pattern or grammar, or two at once, is an error."""
    from umakit.core import validate
    from umakit.errors import InvalidArgumentError

    flags = [f for f, v in (("--json-schema", json_schema), ("--regex", regex), ("--choice", choices or None),
                            ("--grammar", grammar)) if v is not None]
    if not flags:  # nothing to check (and the grammar engine, numpy with it, stays unimported)
        return dict(schema=None, regex=None, choices=None, grammar=None)
    if len(flags) > 1:
        raise InvalidArgumentError(f"give at most one of --json-schema, --regex, --choice and --grammar "
                                   f"(got {' and '.join(flags)})")
    given = dict(schema=None if json_schema is None else validate.read_text(json_schema, "JSON schema file"),
                 regex=None if regex is None else validate.text(regex, "--regex"),
                 choices=tuple(validate.text(c, "--choice") for c in choices) or None,
                 grammar=None if grammar is None else validate.read_text(grammar, "grammar file"))
    from umakit.generate.constrain import from_options

    from_options(**given)
    return given


HOST_ENV = "UMAKIT_HOST"  # where the CLI looks for a running `umakit serve`


def server_option(help_text: str):
    """--server URL: the running umakit server a command talks to (default $UMAKIT_HOST, else the serve default)."""
    from umakit.serve import DEFAULT_HOST, DEFAULT_PORT

    return click.option("--server", "server_url", envvar=HOST_ENV, default=f"http://{DEFAULT_HOST}:{DEFAULT_PORT}",
                        show_default=True, metavar="URL", help=f"{help_text} (default: ${HOST_ENV}).")

