"""`umakit serve`: OpenAI's and Anthropic's HTTP APIs over one loaded model, or many by name.

- types.py: what the HTTP layer and the scheduler exchange (requests in, events out);
- scheduler.py: the one owner of an engine, continuous batching across requests, supervised;
- host.py: the models a server answers for: one fixed (`OneModel`), or many loaded by name (`ModelHost`);
- prompt_cache.py: KV caches kept across requests, bounded in bytes;
- protocol.py, openai_shapes.py: OpenAI's requests and replies; anthropic.py, openai_responses.py: the other APIs;
  generation.py: a request read by any of them, as the scheduler's;
- conversation.py, replies.py, toolcalls/: a chat's template, tools and constraint; its reply split into
  reasoning, content and tool calls;
- outputs.py: what a request's events become for its API; api_errors.py: every error body; metrics.py: /metrics;
- app.py: the Starlette routes (`make_app`), streaming, auth, CORS and /health; guard.py: host checks, JSON
  bounds, the log's escaping; connections.py: deadlines on headers and on a client that stops reading.

    from umakit.serve import Scheduler, SchedulerSettings, make_app
    scheduler = Scheduler(model, SchedulerSettings(max_concurrency=8)); scheduler.start()
    app = make_app(model, scheduler)   # any ASGI server runs it; `umakit serve` uses uvicorn

The names are imported on first use, so importing the package costs nothing.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from umakit.serve.app import make_app
    from umakit.serve.jobs import QueueFull
    from umakit.serve.scheduler import Scheduler
    from umakit.serve.types import SchedulerSettings

DEFAULT_HOST = "127.0.0.1"  # loopback: binding anything else without an API key draws a warning
DEFAULT_PORT = 8080
DEFAULT_MAX_BODY_BYTES = 8 << 20  # a long conversation is well under 1 MiB of JSON
DEFAULT_BODY_TIMEOUT_S = 30.0  # a request body may pause this long between two of its pieces
DEFAULT_HEADER_TIMEOUT_S = 10.0  # from a request's first byte (or a connection's opening) to its last header
DEFAULT_SEND_TIMEOUT_S = 30.0  # how long a reply may wait for its client to read (connections.py)

_LAZY = {"make_app": ".app", "Scheduler": ".scheduler", "QueueFull": ".jobs", "SchedulerSettings": ".types"}
__all__ = sorted(_LAZY)


def __getattr__(name: str):
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(_LAZY[name], __name__), name)
