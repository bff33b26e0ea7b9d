"""The CLI as a client of a running `umakit serve`: `umakit generate` sends its prompt there when one answers.

A model already loaded by a server answers at once, where a new process would load it again from nothing.
`server_at` says whether a umakit server answers at the URL (``$UMAKIT_HOST``, default http://127.0.0.1:8080)
within a fraction of a second; `stream` sends one chat (or, raw, one completion) request there and yields its
text as it streams, then the line of figures the server measured. A server that goes away mid-reply is an
error naming it; one that does not serve the model (a one-model server asked for another) gives None, and
the caller loads the model itself.
"""

from __future__ import annotations

import json
import os
import socket
import urllib.error
import urllib.request
from typing import Iterator

from umakit.errors import UmakitError

PROBE_S = 0.3  # how long the health probe waits: a server on this machine answers in milliseconds


def server_at(url: str) -> bool:
    """Whether a healthy umakit server answers at ``url``."""
    try:
        with urllib.request.urlopen(f"{url.rstrip('/')}/health", timeout=PROBE_S) as r:
            body = json.load(r)
    except (urllib.error.URLError, OSError, ValueError):
        return False
    return isinstance(body, dict) and body.get("server") == "umakit" and body.get("status") == "ok"


def served_name(model: str | None) -> str:
    """What a request names for the CLI's MODEL: the built-in model's name, a path made absolute (the server
    may run elsewhere in the file system), or the name as given (a Hub id, an import's short name)."""
    if model is None:
        from umakit.checkpoint.default import DEFAULT_MODEL_NAME

        return DEFAULT_MODEL_NAME
    return os.path.abspath(model) if os.path.exists(model) else model


def api_key() -> str | None:
    """The key a server started with --api-key wants (``$UMAKIT_API_KEY``)."""
    return os.environ.get("UMAKIT_API_KEY")


class Attached:
    """One request to a server: iterate for the text; then ``finish`` and ``usage`` hold its end."""

    def __init__(self, url: str, response):
        self.url, self._response = url, response
        self.finish: str | None = None
        self.usage: dict = {}

    def __iter__(self) -> Iterator[str]:
        """The reply's text (a reasoning model's thinking left out)."""
        return (text for reasoning, text in self.deltas() if not reasoning)

    def deltas(self) -> Iterator[tuple[bool, str]]:
        """The reply as it streams: (whether it is thinking, text) pairs."""
        try:
            for raw in self._response:
                line = raw.decode("utf-8").strip()
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    raise UmakitError(f"the server at {self.url}: {chunk['error'].get('message')}")
                self.usage = chunk.get("usage") or self.usage
                for choice in chunk.get("choices") or ():
                    delta = choice.get("delta")
                    if delta is None:
                        text, reasoning = choice.get("text"), None
                    else:
                        text, reasoning = delta.get("content"), delta.get("reasoning_content")
                    if reasoning:
                        yield True, reasoning
                    if text:
                        yield False, text
                    self.finish = choice.get("finish_reason") or self.finish
        except (OSError, ValueError, urllib.error.URLError) as e:
            raise UmakitError(f"the server at {self.url} went away mid-reply ({e})") from e
        finally:
            self.close()
        if self.finish is None:
            raise UmakitError(f"the server at {self.url} went away mid-reply")

    def close(self) -> None:
        """Drop the connection: a server stops a reply whose client has gone. Safe from another thread than the
        one reading: the socket is shut down first, which ends a read waiting on it."""
        sock = getattr(getattr(self._response.fp, "raw", None), "_sock", None)  # http.client's, when still open
        if sock is not None:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        self._response.close()


def stream(url: str, model: str, prompt: str, *, system: str | None, raw: bool, max_tokens: int, stop,
           seed: int | None, sampling: dict, constraint: dict, api_key: str | None) -> Attached | None:
    """Send the request; None when the server does not serve ``model`` (the caller loads it instead)."""
    body: dict = {"model": model, "max_tokens": max_tokens, "stream": True, "stream_options": {"include_usage": True},
                  **{k: v for k, v in sampling.items() if v is not None}}
    if stop:
        body["stop"] = list(stop)
    if seed is not None:
        body["seed"] = seed
    if raw:
        body["prompt"] = (system + "\n\n" if system else "") + prompt
    else:
        body["messages"] = ([{"role": "system", "content": system}] if system else []) + \
                           [{"role": "user", "content": prompt}]
    fmt = _response_format(constraint)
    if fmt is not None:
        body["response_format"] = fmt
    return post(url, "completions" if raw else "chat/completions", body, api_key)


def post(url: str, route: str, body: dict, api_key: str | None) -> Attached | None:
    """POST ``body`` to ``/v1/{route}``, to stream its reply; None when the server does not serve the model."""
    response = _open(url, route, body, api_key)
    return None if response is None else Attached(url, response)


def post_json(url: str, route: str, body: dict, api_key: str | None) -> dict | None:
    """POST ``body`` to ``/v1/{route}`` for a JSON answer; None when the server does not serve the model."""
    response = _open(url, route, body, api_key)
    if response is None:
        return None
    with response:
        try:
            return json.load(response)
        except (OSError, ValueError) as e:
            raise UmakitError(f"the server at {url} went away mid-answer ({e})") from e


def _open(url: str, route: str, body: dict, api_key: str | None):
    headers = {"Content-Type": "application/json"}
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    request = urllib.request.Request(f"{url.rstrip('/')}/v1/{route}", data=json.dumps(body).encode(), headers=headers)
    try:
        return urllib.request.urlopen(request, timeout=600)
    except urllib.error.HTTPError as e:
        if e.code == 404:
            return None
        raise ServerRefused(url, e) from e
    except (urllib.error.URLError, OSError) as e:
        raise UmakitError(f"the server at {url} did not take the request ({e})") from e


class ServerRefused(UmakitError):
    """The server answered the request with an error: ``code`` is the error's code (OpenAI's or Anthropic's)."""

    def __init__(self, url: str, e: urllib.error.HTTPError):
        try:
            error = json.load(e).get("error", {})
        except ValueError:
            error = {}
        self.status, self.code = e.code, error.get("code") or error.get("type")
        super().__init__(f"the server at {url}: {error.get('message') or e.reason}")


def _response_format(constraint: dict) -> dict | None:
    if constraint.get("schema") is not None:
        schema = constraint["schema"]
        return {"type": "json_schema", "json_schema": {"name": "schema",
                                                       "schema": json.loads(schema) if isinstance(schema, str)
                                                       else schema}}
    if constraint.get("regex") is not None:
        return {"type": "regex", "regex": constraint["regex"]}
    if constraint.get("choices") is not None:
        return {"type": "choice", "choices": list(constraint["choices"])}
    if constraint.get("grammar") is not None:
        return {"type": "grammar", "grammar": constraint["grammar"]}
    return None


def stats_line(attached: Attached) -> str:
    """The server's figures for the request, as the in-process stats line shows its own."""
    u = attached.usage
    parts = [f"prompt {u.get('prompt_tokens', 0)} tok"]
    cached = (u.get("prompt_tokens_details") or {}).get("cached_tokens")
    if cached:
        parts.append(f"cached {cached} tok")
    own = u.get("umakit") or {}
    parts += [f"TTFT {own.get('ttft_s', 0.0):.2f} s", f"{u.get('completion_tokens', 0)} tok generated",
              served_figures(attached)]
    return " · ".join(parts)


def served_figures(attached: Attached) -> str:
    """'decode 41.2 tok/s · 12.0 GB/s · 30% of 40 GB/s · served by URL', from the server's usage."""
    own = attached.usage.get("umakit") or {}
    line = f"decode {own.get('decode_tps', 0.0):.1f} tok/s"
    if own.get("peak_gbps"):
        line += (f" · {own.get('achieved_gbps', 0.0):.1f} GB/s · {100 * own.get('mbu', 0.0):.0f}% of "
                 f"{own['peak_gbps']:.0f} GB/s")
    return f"{line} · served by {attached.url}"
