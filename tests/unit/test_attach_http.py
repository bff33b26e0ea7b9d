"""The CLI's own HTTP client (`umakit.cli.attach`), against canned answers from a socket on 127.0.0.1: chunked,
sized and close-delimited bodies, errors in OpenAI's and Anthropic's shapes, and what is not an HTTP server."""

from __future__ import annotations

import json
import socket
import threading

import pytest

from umakit.cli import attach
from umakit.errors import UmakitError


def serve_once(answer: bytes) -> tuple[str, list[bytes]]:
    """A server that reads one request, sends ``answer`` and closes; its URL, and the requests it got."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(1)
    got: list[bytes] = []

    def run():
        conn, _ = sock.accept()
        with conn:
            data = b""
            while b"\r\n\r\n" not in data:
                data += conn.recv(65536)
            head, _, rest = data.partition(b"\r\n\r\n")
            length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n")
                           if line.lower().startswith(b"content-length:")), 0)
            while len(rest) < length:
                rest += conn.recv(65536)
            got.append(head + b"\r\n\r\n" + rest)
            conn.sendall(answer)
        sock.close()

    threading.Thread(target=run, daemon=True).start()
    return f"http://127.0.0.1:{sock.getsockname()[1]}", got


def chunked(*pieces: bytes) -> bytes:
    return b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in pieces) + b"0\r\n\r\n"


SSE = [b'data: {"choices": [{"delta": {"reasoning_content": "hm"}}]}\n\n',
       b'data: {"choices": [{"delta": {"content": "Par"}}]}\n\ndata: {"choices": [{"delta": {"con',
       b'tent": "is"}, "finish_reason": "stop"}]}\n\n',
       b'data: {"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 2}}\n\ndata: [DONE]\n\n']


def test_a_chunked_stream_split_anywhere_gives_the_reply_and_the_request_is_well_formed():
    url, got = serve_once(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n"
                          b"Content-Type: text/event-stream\r\n\r\n" + chunked(*SSE))
    reply = attach.post(url, "chat/completions", {"model": "m", "messages": []}, "secret")
    assert list(reply.deltas()) == [(True, "hm"), (False, "Par"), (False, "is")]
    assert reply.finish == "stop" and reply.usage["completion_tokens"] == 2
    head, _, body = got[0].partition(b"\r\n\r\n")
    assert head.startswith(b"POST /v1/chat/completions HTTP/1.1\r\n") and b"Authorization: Bearer secret" in head
    assert json.loads(body) == {"model": "m", "messages": []}


def test_sized_and_close_delimited_json():
    body = b'{"status": "ok", "server": "umakit"}'
    url, _ = serve_once(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
    assert attach.server_at(url)
    url, _ = serve_once(b"HTTP/1.1 200 OK\r\n\r\n" + b'{"data": [{"id": "a", "loaded": true}]}')
    assert attach.get_json(url, "/v1/models", 2) == {"data": [{"id": "a", "loaded": True}]}


@pytest.mark.parametrize("error", [{"message": "too long", "code": "context_length_exceeded"},  # OpenAI's
                                   {"type": "invalid_request_error", "message": "too long"}])  # Anthropic's
def test_an_error_answer_is_refused_with_its_message_and_code(error):
    body = json.dumps({"error": error}).encode()
    url, _ = serve_once(b"HTTP/1.1 400 Bad Request\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
    with pytest.raises(attach.ServerRefused, match="too long") as e:
        attach.post_json(url, "messages/count_tokens", {}, None)
    assert e.value.status == 400 and e.value.code == error.get("code", error.get("type"))


def test_not_found_means_the_server_does_not_serve_the_model():
    url, _ = serve_once(b"HTTP/1.1 404 Not Found\r\nContent-Length: 2\r\n\r\n{}")
    assert attach.post(url, "chat/completions", {}, None) is None


def test_a_reply_cut_mid_chunk_is_an_error_naming_the_server():
    url, _ = serve_once(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n" + b"40\r\n" + SSE[1][:20])
    reply = attach.post(url, "chat/completions", {}, None)
    with pytest.raises(UmakitError, match="went away mid-reply"):
        list(reply)


def test_what_is_not_a_umakit_server():
    url, _ = serve_once(b"SSH-2.0-OpenSSH_9.6\r\n")
    assert not attach.server_at(url)
    assert not attach.server_at("http://127.0.0.1:9")  # nothing listens
    assert not attach.server_at("https://127.0.0.1:8080")  # umakit serve speaks plain HTTP
    with pytest.raises(UmakitError, match="plain HTTP"):
        attach.post("https://127.0.0.1:8080", "chat/completions", {}, None)
