"""What a browser page or a hostile client must not make the server do: the Host header check against DNS
rebinding (`HostGuard`), JSON that is not text (`parse_json`), log lines forged through a client's text
(`OneLineFormatter`); and who may call it at all (`Keys`), each key's prompts kept from the others'.

A page on any site can point a name it controls at 127.0.0.1 (DNS rebinding) and then call the server as if it
were its own origin, with no CORS in the way. Such a request carries the attacker's name in its Host header, so
the server answers only requests whose Host is one of its own names: the localhost names, an IP address (a
page can only reach an address by its own origin: no rebinding there), the address it is bound to, and the
names given with ``umakit serve --allowed-hosts``. Everything else gets a 400 in OpenAI's shape before any
route runs. (The other half, JSON bodies only, is `umakit.serve.app`'s: a POST that is not
``application/json`` gets a 415, so a page's form or ``text/plain`` POST, which browsers send without asking
first, is never read.)
"""

from __future__ import annotations

import hashlib
import ipaddress
import json
import logging
import re
import secrets
from collections.abc import Sequence

from umakit.serve.api_errors import APIError

LOCAL_NAMES = frozenset({"localhost", "localhost.localdomain", "ip6-localhost", "ip6-loopback"})


def host_name(header: str) -> str:
    """The name in a Host header, without its port and brackets, lower case."""
    header = header.strip().lower()
    if header.startswith("["):  # an IPv6 literal: [::1]:8080
        return header[1:header.find("]")] if "]" in header else header
    return header.rsplit(":", 1)[0] if header.count(":") == 1 else header


def _is_address(name: str) -> bool:
    try:
        ipaddress.ip_address(name)
    except ValueError:
        return False
    return True


class HostGuard:
    """ASGI middleware: a request whose Host header names none of ``allowed`` (nor an IP address, nor a
    localhost name) is refused with 400."""

    def __init__(self, app, allowed: tuple[str, ...] = ()):
        self.app = app
        self.allowed = LOCAL_NAMES | {host_name(h) for h in allowed if h}
        self.any = "*" in allowed

    def allows(self, header: str | None) -> bool:
        if self.any:
            return True
        if not header:
            return False  # HTTP/1.1 requires one; every client sends it
        name = host_name(header)
        return name in self.allowed or _is_address(name) or name.endswith(".localhost")

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        header = next((v.decode("latin-1") for k, v in scope.get("headers", ()) if k == b"host"), None)
        if self.allows(header):
            return await self.app(scope, receive, send)
        shown = (header or "").encode("ascii", "backslashreplace").decode()[:100]
        body = json.dumps({"error": {
            "message": f"the Host header {shown!r} names none of this server's hosts; add it with umakit serve "
                       "--allowed-hosts (a guard against DNS rebinding)",
            "type": "invalid_request_error", "param": None, "code": "host_not_allowed"}}).encode()
        await send({"type": "http.response.start", "status": 400,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})


def parse_json(body: bytes):
    """A request body's JSON; 400 for what is not JSON, is nested too deeply, or holds a lone surrogate."""
    try:
        data = json.loads(body)
    except ValueError as e:  # UnicodeDecodeError too
        raise APIError(400, f"the request body is not valid JSON ({e})") from e
    except RecursionError:
        raise APIError(400, "the request body's JSON is nested too deeply") from None
    try:  # a lone surrogate (\ud800) parses, but is no text: refused here rather than deep in a tokenizer
        json.dumps(data, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        raise APIError(400, "the request body's JSON holds a lone surrogate (\\ud800-\\udfff), which is not "
                            "text") from None
    return data


_CONTROL = re.compile("[\x00-\x1f\x7f-\x9f\u2028\u2029]")


class OneLineFormatter(logging.Formatter):
    """Log lines whose message never spans lines nor carries terminal escapes: a client's text in a message (a
    model name it sent, say) has its control characters escaped, so it cannot forge log lines of its own.
    Tracebacks, which are the server's, print as they are."""

    def formatMessage(self, record: logging.LogRecord) -> str:
        record.message = _CONTROL.sub(lambda m: m.group().encode("unicode_escape").decode("ascii"), record.message)
        return super().formatMessage(record)


class Keys:
    """The API keys a server accepts (none: every caller is let in), each with a prompt-cache namespace of its own:
    a request reuses the KV cache of another request only when both came with the same key (and the same
    ``cache_salt``), so one key's holder cannot learn another's prompts from ``cached_tokens`` or timings."""

    def __init__(self, keys: str | Sequence[str] | None):
        listed = [keys] if isinstance(keys, str) else list(keys or ())
        self._keys = [k.encode() for k in listed]
        # a namespace names its key without holding it (the scheduler's caches and metrics never see a key)
        self._names = [hashlib.sha256(k).hexdigest()[:16] for k in self._keys]

    def __bool__(self) -> bool:
        return bool(self._keys)

    def check(self, headers) -> str:
        """The namespace of the request's key ("" where the server has none), or a 401: OpenAI's
        ``Authorization: Bearer KEY`` or Anthropic's ``x-api-key: KEY``. Every key is compared, in constant time."""
        if not self._keys:
            return ""
        header, anthropic_key = headers.get("authorization", ""), headers.get("x-api-key")
        if not header and anthropic_key is None:
            raise APIError(401, "you didn't provide an API key: send 'Authorization: Bearer YOUR_KEY'",
                           headers={"WWW-Authenticate": "Bearer"})
        scheme, _, key = header.partition(" ") if header else ("bearer", "", anthropic_key)
        given = key.strip().encode()
        matches = [secrets.compare_digest(given, k) for k in self._keys]
        if scheme.lower() != "bearer" or not any(matches):
            raise APIError(401, "incorrect API key provided", headers={"WWW-Authenticate": "Bearer"})
        return self._names[matches.index(True)]
