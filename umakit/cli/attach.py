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


class Attached:
    """One request to a server: iterate for the text; then ``finish`` and ``usage`` hold its end."""

    def __init__(self, url: str, response):
        self.url, self._response = url, response
        self.finish: str | None = None
        self.usage: dict = {}

    def __iter__(self) -> Iterator[str]:
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
                    text = (choice.get("delta") or {}).get("content") if "delta" in choice else choice.get("text")
                    if text:
                        yield text
                    self.finish = choice.get("finish_reason") or self.finish
        except (OSError, ValueError, urllib.error.URLError) as e:
            raise UmakitError(f"the server at {self.url} went away mid-reply ({e})") from e
        finally:
            self._response.close()
        if self.finish is None:
            raise UmakitError(f"the server at {self.url} went away mid-reply")


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
    headers = {"Content-Type": "application/json"}
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    route = "completions" if raw else "chat/completions"
    request = urllib.request.Request(f"{url.rstrip('/')}/v1/{route}", data=json.dumps(body).encode(), headers=headers)
    try:
        response = urllib.request.urlopen(request, timeout=600)
    except urllib.error.HTTPError as e:
        if e.code == 404:
            return None
        try:
            message = json.load(e).get("error", {}).get("message", e.reason)
        except ValueError:
            message = e.reason
        raise UmakitError(f"the server at {url}: {message}") from e
    except (urllib.error.URLError, OSError) as e:
        raise UmakitError(f"the server at {url} did not take the request ({e})") from e
    return Attached(url, response)


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
    own = u.get("umakit") or {}
    parts = [f"prompt {u.get('prompt_tokens', 0)} tok"]
    cached = (u.get("prompt_tokens_details") or {}).get("cached_tokens")
    if cached:
        parts.append(f"cached {cached} tok")
    parts += [f"TTFT {own.get('ttft_s', 0.0):.2f} s", f"{u.get('completion_tokens', 0)} tok generated",
              f"decode {own.get('decode_tps', 0.0):.1f} tok/s"]
    if own.get("peak_gbps"):
        parts[-1] += (f" · {own.get('achieved_gbps', 0.0):.1f} GB/s · {100 * own.get('mbu', 0.0):.0f}% of "
                      f"{own['peak_gbps']:.0f} GB/s")
    parts.append(f"served by {attached.url}")
    return " · ".join(parts)
