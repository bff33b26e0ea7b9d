"""The CLI as a client of a running `umakit serve`: `umakit generate` and `umakit run` use it when one answers.

A model already loaded by a server answers at once, where a new process would load it again from nothing.
`server_at` says whether a umakit server answers at the URL (``$UMAKIT_HOST``, default http://127.0.0.1:8080)
within a fraction of a second; `stream` sends one chat (or, raw, one completion) request there and yields its
text as it streams, then the line of figures the server measured. A server that goes away mid-reply is an
error naming it; one that does not serve the model (a one-model server asked for another) gives None, and
the caller loads the model itself.

HTTP here is a few lines over a socket (`_Reply`), not ``urllib``: an attached command's whole start is a
fraction of a second, and ``urllib.request`` with ``http.client`` and ``ssl`` takes 20-30 ms of it to import.
`umakit serve` speaks plain HTTP/1.1, which is all this client speaks.
"""

from __future__ import annotations

import json
import os
import socket
from typing import Iterator

from umakit.errors import UmakitError

PROBE_S = 0.3  # how long the health probe waits: a server on this machine answers in milliseconds
REPLY_S = 600.0  # how long a reply may go silent (a long prefill on a slow machine) before it is given up


def server_at(url: str) -> bool:
    """Whether a healthy umakit server answers at ``url``."""
    try:
        body = get_json(url, "/health", PROBE_S)
    except UmakitError:
        return False
    return isinstance(body, dict) and body.get("server") == "umakit" and body.get("status") == "ok"


def get_json(url: str, path: str, timeout_s: float) -> object:
    """GET ``path`` of the server at ``url`` and parse its JSON answer (any status); `UmakitError` when none
    comes."""
    try:
        with _send(url, "GET", path, None, {}, timeout_s) as reply:
            return json.loads(reply.read())
    except (OSError, ValueError) as e:
        raise UmakitError(f"no answer from {url} ({e})") from e


class _Reply:
    """An HTTP/1.1 response read off its socket: ``status``, ``headers``, and the body, whole (`read`) or line by
    line (iterating), chunked or not."""

    def __init__(self, sock: socket.socket):
        self.sock, self.file = sock, sock.makefile("rb")
        status = self.file.readline().split(None, 2)
        if len(status) < 2 or not status[0].startswith(b"HTTP/"):
            raise OSError("not an HTTP answer")
        self.status, self.reason = int(status[1]), status[2].strip().decode("latin-1") if len(status) > 2 else ""
        self.headers: dict[str, str] = {}
        while (line := self.file.readline()) not in (b"\r\n", b"\n", b""):
            key, _, value = line.decode("latin-1").partition(":")
            self.headers[key.strip().lower()] = value.strip()

    def _exactly(self, n: int) -> bytes:
        data = self.file.read(n)
        if len(data) < n:
            raise OSError("the connection closed mid-answer")
        return data

    def _pieces(self) -> Iterator[bytes]:
        if self.headers.get("transfer-encoding", "").lower() == "chunked":
            while (n := int(self.file.readline().split(b";")[0] or b"x", 16)) > 0:
                yield self._exactly(n)
                self._exactly(2)  # the CRLF after each chunk
            return
        if "content-length" in self.headers:
            yield self._exactly(int(self.headers["content-length"]))
            return
        yield from iter(lambda: self.file.read1(65536), b"")

    def read(self) -> bytes:
        return b"".join(self._pieces())

    def __iter__(self) -> Iterator[bytes]:
        held = b""
        for piece in self._pieces():
            *lines, held = (held + piece).split(b"\n")
            yield from (line + b"\n" for line in lines)
        if held:
            yield held

    def close(self) -> None:
        """Drop the connection, from any thread: shutting the socket down first ends a read waiting on it."""
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.file.close()
        self.sock.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _send(url: str, method: str, path: str, body: bytes | None, headers: dict, timeout_s: float) -> _Reply:
    scheme, _, rest = url.partition("://")
    if scheme != "http":
        raise OSError(f"umakit serve speaks plain HTTP: give an http:// URL, not {url!r}")
    where, _, base = rest.partition("/")
    host, port = where.rsplit(":", 1) if where.rfind(":") > where.rfind("]") else (where, "80")
    try:
        sock = socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s)
    except ValueError as e:
        raise OSError(f"not a server address: {url!r}") from e
    try:
        lines = [f"{method} /{base.strip('/') + '/' if base.strip('/') else ''}{path.lstrip('/')} HTTP/1.1",
                 f"Host: {where}", "Connection: close", *(f"{k}: {v}" for k, v in headers.items())]
        if body is not None:
            lines.append(f"Content-Length: {len(body)}")
        sock.sendall(("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + (body or b""))
        return _Reply(sock)
    except BaseException:
        sock.close()
        raise


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

    def __init__(self, url: str, response: _Reply):
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
        except (OSError, ValueError) as e:
            raise UmakitError(f"the server at {self.url} went away mid-reply ({e})") from e
        finally:
            self.close()
        if self.finish is None:
            raise UmakitError(f"the server at {self.url} went away mid-reply")

    def close(self) -> None:
        """Drop the connection (from any thread): a server stops a reply whose client has gone."""
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
            return json.loads(response.read())
        except (OSError, ValueError) as e:
            raise UmakitError(f"the server at {url} went away mid-answer ({e})") from e


def _open(url: str, route: str, body: dict, api_key: str | None) -> _Reply | None:
    headers = {"Content-Type": "application/json"}
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    try:
        reply = _send(url, "POST", f"/v1/{route}", json.dumps(body).encode(), headers, REPLY_S)
    except OSError as e:
        raise UmakitError(f"the server at {url} did not take the request ({e})") from e
    if reply.status < 400:
        return reply
    with reply:
        if reply.status == 404:
            return None
        try:
            body = reply.read()
        except OSError:
            body = b""
    raise ServerRefused(url, reply.status, reply.reason, body)


class ServerRefused(UmakitError):
    """The server answered the request with an error: ``code`` is the error's code (OpenAI's or Anthropic's)."""

    def __init__(self, url: str, status: int, reason: str, body: bytes):
        try:
            error = json.loads(body).get("error", {})
        except (ValueError, AttributeError):
            error = {}
        error = error if isinstance(error, dict) else {}
        self.status, self.code = status, error.get("code") or error.get("type")
        super().__init__(f"the server at {url}: {error.get('message') or reason or status}")


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
