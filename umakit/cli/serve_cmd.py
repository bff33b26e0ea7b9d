"""`umakit serve`: the model behind an OpenAI-compatible HTTP API, on uvicorn."""

from __future__ import annotations

import ipaddress
import json
import logging
import math
import signal
import socket
import sys
import threading
from dataclasses import replace

import click

from umakit.backends.base import BATCH, MIXED
from umakit.serve import (DEFAULT_BODY_TIMEOUT_S, DEFAULT_HEADER_TIMEOUT_S, DEFAULT_HOST, DEFAULT_MAX_BODY_BYTES,
                          DEFAULT_PORT, DEFAULT_SEND_TIMEOUT_S)
from umakit.serve.types import SchedulerSettings

from umakit.cli.format import size
from umakit.cli.flags import (batch_kv_needs, deterministic_option, follow_unless_leader,
                              kv_bits_option, load_draft, load_model, lookup_needs, lookup_options, model_options,
                              offload_options, parallel_option)

API_KEY_ENV = "UMAKIT_API_KEY"
CONNECTIONS_SPARE = 64  # connections beyond the rows and the queue: /health, /metrics, requests refused with 429


def _size(ctx, param, value):
    from umakit.plan.placement import parse_size

    try:
        return parse_size(value)
    except ValueError as e:
        raise click.BadParameter(str(e)) from e


def _size_or_zero(ctx, param, value):
    return 0 if value.strip() == "0" else _size(ctx, param, value)


@click.command("serve")
@click.argument("models", nargs=-1)
@click.option("--host", default=DEFAULT_HOST, show_default=True, help="Address to bind (any other than loopback: set a key).")
@click.option("--port", type=click.IntRange(0, 65535), default=DEFAULT_PORT, show_default=True, help="0 picks a free one.")
@click.option("--api-key", envvar=API_KEY_ENV, default=None, metavar="KEY",
              help=f"Require 'Authorization: Bearer KEY' on every route but /health (default: ${API_KEY_ENV}).")
@click.option("--api-keys", "api_keys_file", metavar="FILE", default=None,
              help="More keys, one a line (# comments): each key's requests reuse only their own prompt cache.")
@click.option("--max-concurrency", type=click.IntRange(min=1), default=SchedulerSettings.max_concurrency,
              show_default=True, help="Requests decoded together at most.")
@click.option("--max-queue", type=click.IntRange(min=1), default=SchedulerSettings.max_queue, show_default=True,
              help="Requests waiting beyond those; more get 429 with Retry-After.")
@click.option("--prompt-cache-bytes", metavar="SIZE", callback=_size_or_zero,
              default=str(SchedulerSettings.prompt_cache_bytes),
              help=f"KV caches kept across requests, so a conversation prefills only its new tokens "
                   f"(default {size(SchedulerSettings.prompt_cache_bytes)}; 0 keeps none).")
@click.option("--step-tokens", type=click.IntRange(min=1), default=None,
              help="Prompt tokens prefilled between two decode steps while requests are decoding: lower keeps "
                   "their tokens coming more evenly, higher prefills new prompts faster (default: measured on the "
                   "model at start, so that a prefill pass takes about twice its fixed cost).")
@click.option("--mixed-steps/--separate-steps", "mixed_steps", default=None,
              help="Prefill a waiting prompt's slice in the decoding rows' own forward pass, each layer's weights "
                   "read once for both (the rows then take that pass's arithmetic, so a greedy reply may differ "
                   "from a lone run's in a near tie), or in a pass of its own (default: mixed on CUDA, separate on "
                   "a CPU; the torch engine only).")
@click.option("--max-body-bytes", metavar="SIZE", callback=_size, default=str(DEFAULT_MAX_BODY_BYTES),
              help=f"Largest request body; larger ones get 413 (default {size(DEFAULT_MAX_BODY_BYTES)}).")
@click.option("--request-timeout", type=click.FloatRange(min=0, min_open=True), metavar="S",
              default=SchedulerSettings.request_timeout_s, show_default=True,
              help="A request still running after S seconds, queueing included, fails with 504.")
@click.option("--body-timeout", type=click.FloatRange(min=0, min_open=True), metavar="S",
              default=DEFAULT_BODY_TIMEOUT_S, show_default=True,
              help="A request body that stops arriving for S seconds gets 408.")
@click.option("--header-timeout", type=click.FloatRange(min=0, min_open=True), metavar="S",
              default=DEFAULT_HEADER_TIMEOUT_S, show_default=True,
              help="A request's headers not all in S seconds after its first byte (or a connection's opening) get 408.")
@click.option("--send-timeout", type=click.FloatRange(min=0, min_open=True), metavar="S",
              default=DEFAULT_SEND_TIMEOUT_S, show_default=True,
              help="A client that reads nothing of its reply for S seconds is disconnected and its request cancelled.")
@click.option("--models", "models_file", metavar="FILE", default=None,
              help="Serve models by name, loading those listed in FILE (one a line) at start.")
@click.option("--keep-alive", metavar="DURATION", default="5m", show_default=True,
              help="Serving models by name: unload a model idle this long (0: after each request; -1: never).")
@click.option("--memory-budget", metavar="SIZE", default=None,
              help="Serving models by name: bytes the loaded models may take (default: the device's memory).")
@click.option("--allowed-origins", metavar="ORIGINS", default="",
              help="Comma-separated origins (e.g. http://localhost:3000, or *) whose browser pages may call the "
                   "server: CORS preflights are answered for them (default: none).")
@click.option("--allowed-hosts", metavar="HOSTS", default="",
              help="Comma-separated host names clients may call this server by, beyond localhost names, IP addresses "
                   "and --host (a guard against DNS rebinding; * allows any).")
@kv_bits_option
@lookup_options
@model_options
@deterministic_option
@offload_options
@parallel_option
def serve_cmd(models, models_file, keep_alive, memory_budget, host, port, api_key, api_keys_file, max_concurrency,
              max_queue, prompt_cache_bytes, step_tokens, mixed_steps, max_body_bytes, request_timeout, body_timeout,
              header_timeout, send_timeout, allowed_origins, allowed_hosts, kv_bits, prompt_lookup, draft, draft_tokens,
              ngram, backend, device, dtype, peak_bandwidth, deterministic, gpu_layers, vram_budget, parallel):
    """Serve models over OpenAI's and Anthropic's HTTP APIs: chat completions, completions, responses and
    messages, streamed or not, with tool calls and structured outputs.

    With one MODEL it is loaded before the port opens and served alone. With none, several or --models, a
    request's "model" may name any model umakit loads (a directory, a .gguf, a Hub id, the built-in model's
    name): it loads on first use and unloads when idle, within --memory-budget."""
    import uvicorn

    from umakit.generate.speculative import batch_lookup
    from umakit.serve.app import make_app
    from umakit.serve.scheduler import Scheduler

    lookup = batch_lookup(prompt_lookup, draft_tokens, ngram, draft)  # with --draft: checked, made once loaded
    if deterministic and mixed_steps:
        raise click.UsageError("--deterministic does not take --mixed-steps: a prompt slice in the rows' pass would "
                               "give them that pass's bits")
    load = dict(backend=backend, device=device, dtype=dtype, peak_bandwidth=peak_bandwidth,
                needs={BATCH} | batch_kv_needs(kv_bits) | lookup_needs(prompt_lookup or draft is not None)
                | ({MIXED} if mixed_steps else set()),
                gpu_layers=gpu_layers, vram_budget=vram_budget, deterministic=deterministic)
    origins = tuple(o.strip().rstrip("/") for o in allowed_origins.split(",") if o.strip())
    settings = SchedulerSettings(max_concurrency=max_concurrency, max_queue=max_queue,
                                 prompt_cache_bytes=prompt_cache_bytes, request_timeout_s=request_timeout,
                                 kv_bits=kv_bits, step_tokens=step_tokens, lookup=lookup, mixed_steps=mixed_steps)
    keys = _keys(api_key, api_keys_file)
    hosts = (host, *(h.strip() for h in allowed_hosts.split(",") if h.strip()))
    deadlines = (header_timeout, send_timeout)
    web = dict(api_key=keys, max_body_bytes=max_body_bytes, request_timeout_s=request_timeout,
               allowed_origins=origins, allowed_hosts=hosts, body_timeout_s=body_timeout)
    if models_file is not None or len(models) != 1:
        if parallel is not None or draft is not None:
            raise click.UsageError(f"{'--parallel' if parallel is not None else '--draft'} serves one model: give it "
                                   f"as MODEL")
        listed = list(models) + (_read_models(models_file) if models_file else [])
        return _serve_by_name(listed, keep_alive, memory_budget, host, port, settings, web, load, deadlines)
    model = models[0]
    follow_unless_leader(parallel, model, **load)  # only rank 0 binds the port and answers HTTP
    sock = _bind(host, port)  # before the model loads: a port in use fails in a second, not after the load
    m = load_model(model, show_progress=sys.stderr.isatty(), parallel=parallel, **load)
    if draft is not None:
        settings = replace(settings, lookup=batch_lookup(False, draft_tokens, None, load_draft(m, draft), m))
    scheduler = Scheduler(m, settings)
    app = make_app(m, scheduler, **web)
    _log_to_stderr()
    server = uvicorn.Server(_config(app, settings, deadlines))
    try:
        with m.engine.wired():
            _run(server, sock, scheduler, lambda: _banner(m, sock.getsockname()[1], host, keys))
    finally:
        scheduler.stop()
        sock.close()


def _keys(api_key: str | None, path: str | None) -> list[str]:
    """The keys of --api-key and of the --api-keys file, each printable ASCII without spaces."""
    keys = [api_key] if api_key is not None else []
    keys += _read_models(path, "--api-keys file") if path else []
    for key in keys:
        if not key.strip() or not key.isascii() or not key.isprintable() or " " in key.strip():
            raise click.BadParameter("an API key must be printable ASCII, without spaces, and not empty",
                                     param_hint="--api-keys" if key is not api_key else "--api-key")
    return [k.strip() for k in keys]


def _read_models(path: str, what: str = "--models file") -> list[str]:
    from umakit.core import validate

    text = validate.read_text(path, what)
    return [line.strip() for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#")]


def _serve_by_name(listed, keep_alive, memory_budget, host, port, settings, web, load, deadlines) -> None:
    """Models by name (`umakit.serve.host.ModelHost`): each on its own worker thread; HTTP on this one."""
    import uvicorn

    import umakit
    from umakit import backends
    from umakit.checkpoint import inventory
    from umakit.checkpoint.default import DEFAULT_MODEL_NAME
    from umakit.errors import UmakitError
    from umakit.hardware import memory_budget as device_budget
    from umakit.plan.placement import parse_size
    from umakit.serve.app import make_app
    from umakit.serve.host import ModelHost, parse_keep_alive

    try:
        keep = parse_keep_alive(keep_alive)
    except UmakitError as e:
        raise click.BadParameter(str(e), param_hint="--keep-alive") from e
    try:
        budget = parse_size(memory_budget) if memory_budget is not None else None
    except ValueError as e:
        raise click.BadParameter(str(e), param_hint="--memory-budget") from e
    if budget is None:
        budget = device_budget(backends.resolve(load["backend"], load["device"], frozenset(load["needs"]))[1])

    def source(name: str):
        return None if name == DEFAULT_MODEL_NAME else name

    models = ModelHost(lambda name: load_model(source(name), **load),
                       lambda name: umakit.checkpoint_size(umakit.resolve_model(source(name))),
                       settings, budget_bytes=budget, keep_alive_s=keep, release_memory=backends.release_memory,
                       available=inventory.names)
    sock = _bind(host, port)
    app = make_app(models, **web)
    _log_to_stderr()
    for name in listed:
        models.preload(name)
    server = uvicorn.Server(_config(app, settings, deadlines))
    click.echo(_host_banner(sock.getsockname()[1], host, web["api_key"], budget, keep, listed), err=True)
    try:
        server.run(sockets=[sock])
    finally:
        models.close()
        sock.close()


def _idle(keep_alive_s: float) -> str:
    """What the host does with an idle model, in words."""
    if keep_alive_s == math.inf:
        return "kept loaded while idle"
    if keep_alive_s == 0:
        return "unloaded after each request"
    return f"unloaded after {keep_alive_s:g} s idle"


def _host_banner(port: int, host: str, api_key: list[str], budget: int, keep_alive_s: float, listed) -> str:
    from umakit.checkpoint.default import DEFAULT_MODEL_NAME

    shown = f"[{host}]" if ":" in host else host
    lines = [f"Serving models by name at http://{shown}:{port}/v1 · Ctrl-C stops",
             f"  a request's \"model\" loads on first use: a directory, a .gguf, a Hub id, or {DEFAULT_MODEL_NAME} "
             "(built in)",
             f"  {_idle(keep_alive_s)}; loaded models stay within {size(budget)}"]
    if listed:
        lines.append(f"  loading now: {', '.join(listed)}")
    if not api_key and not _is_loopback(host):
        lines.insert(0, click.style(f"Warning: listening on {host} without an API key: anyone who can reach this "
                                    f"machine can use it (set --api-key or ${API_KEY_ENV})", fg="yellow"))
    return "\n".join(lines)


def _run(server, sock: socket.socket, scheduler, banner) -> None:
    """HTTP on a thread, the engine's worker in this, the main, thread (`umakit.serve.scheduler` says why).

    The first SIGINT or SIGTERM stops taking connections and lets the requests in flight finish, as
    uvicorn does in its own main thread; a second SIGINT cuts them off. Then the first signal is raised
    again with its own handler, so the process ends as that signal says.
    """
    http = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, name="umakit-http", daemon=True)
    caught: list[int] = []

    def on_signal(sig, frame):
        caught.append(sig)
        if server.should_exit and sig == signal.SIGINT:
            server.force_exit = True
        server.should_exit = True

    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        http.start()
        try:
            scheduler.run(ready=banner, until=lambda: not http.is_alive())
        except Exception as e:
            raise click.ClickException(f"the generation worker did not start ({type(e).__name__}: {e})") from e
        finally:
            server.should_exit = True
            http.join(timeout=30)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if not caught:  # nothing asked it to stop
        raise click.ClickException("the HTTP server stopped; see the log above")
    signal.raise_signal(caught[0])


def _bind(host: str, port: int) -> socket.socket:
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        sock = socket.socket(family, kind, proto)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
    except OSError as e:
        raise click.ClickException(f"cannot listen on {host}:{port} ({e.strerror or e}); pick another --host or --port")
    return sock


def _config(app, settings, deadlines):
    """uvicorn's settings: connections beyond what the queue can take get a 503 at once (each open connection
    holds memory and a file descriptor), idle keep-alive connections close after 5 s, and ``deadlines``, (header,
    send) seconds, bound the two waits uvicorn has no bound for (serve/connections.py)."""
    import uvicorn

    from umakit.serve.connections import protocol

    cap = settings.max_concurrency + settings.max_queue + CONNECTIONS_SPARE
    return uvicorn.Config(app, log_level="warning", access_log=False, lifespan="off", limit_concurrency=cap,
                          timeout_keep_alive=5, http=protocol(*deadlines))


def _log_to_stderr() -> None:
    """umakit's line per request on stderr (uvicorn's own access log stays off)."""
    from umakit.serve.guard import OneLineFormatter

    logger = logging.getLogger("umakit.serve")
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(OneLineFormatter("%(asctime)s %(message)s", datefmt="%H:%M:%S"))
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _banner(m, port: int, host: str, api_key: list[str]) -> None:
    """Where it listens, and a curl and a Python example to paste (stderr)."""
    shown = f"[{host}]" if ":" in host else host
    base = f"http://{shown}:{port}/v1"
    body = json.dumps({"model": m.info.name, "messages": [{"role": "user", "content": "Hello!"}]})
    auth = f' \\\n      -H "Authorization: Bearer ${API_KEY_ENV}"' if api_key else ""
    key = f'os.environ["{API_KEY_ENV}"]' if api_key else '"none"'
    lines = [
        f"Serving {m.info.name} ({m.info.backend}/{m.info.device}, {m.info.dtype}"
        f"{', deterministic' if m.info.deterministic else ''}) at {base} · Ctrl-C stops",
        "",
        f"    curl {base}/chat/completions -H 'Content-Type: application/json'{auth} \\",
        f"      -d '{body}'",
        "",
        ("    import os; " if api_key else "    ") + "from openai import OpenAI",
        f'    client = OpenAI(base_url="{base}", api_key={key})',
        f'    reply = client.chat.completions.create(model="{m.info.name}", '
        'messages=[{"role": "user", "content": "Hello!"}])',
        "    print(reply.choices[0].message.content)",
        "",
    ]
    if api_key:
        lines.insert(1, f"(the examples read the key from ${API_KEY_ENV})")
    if not api_key and not _is_loopback(host):
        lines.insert(0, click.style(f"Warning: listening on {host} without an API key: anyone who can reach this "
                                    f"machine can use the model (set --api-key or ${API_KEY_ENV})", fg="yellow"))
    click.echo("\n".join(lines), err=True)
