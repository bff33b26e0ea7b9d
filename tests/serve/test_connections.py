"""Connections that would hold a real server's place for ever (serve/connections.py): headers that trickle in,
a connection that never speaks, a client that stops reading its stream; and what must not be cut by them."""

from __future__ import annotations

import socket
import time

import httpx
import pytest

from support.serve_helpers import start_server

pytestmark = pytest.mark.slow

HEADERS = b"POST /v1/chat/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"


@pytest.fixture(scope="module")
def server(tiny_dir, tmp_path_factory):
    srv = start_server(tiny_dir("llama"), ["--backend", "torch", "--peak-bandwidth", "100", "--header-timeout", "1",
                                           "--send-timeout", "1"], tmp_path_factory, "connections")
    yield srv
    srv.stop()


def read_all(s: socket.socket, within_s: float) -> tuple[bytes, bool]:
    """What the server sends until it closes the connection (True) or ``within_s`` passes (False)."""
    s.settimeout(0.2)
    got, deadline = b"", time.monotonic() + within_s
    while time.monotonic() < deadline:
        try:
            piece = s.recv(65536)
        except socket.timeout:
            continue
        except ConnectionResetError:
            return got, True
        if not piece:
            return got, True
        got += piece
    return got, False


def test_headers_that_trickle_in_get_a_408_and_lose_their_connection(server):
    with socket.create_connection(("127.0.0.1", server.port)) as s:
        s.sendall(HEADERS)
        t0 = time.monotonic()
        s.settimeout(0.25)
        answer = b""
        for _ in range(40):  # a byte of a header every 0.25 s: uvicorn alone would wait for ever
            try:
                s.sendall(b"X")
            except (BrokenPipeError, ConnectionResetError):
                break
            try:
                answer += s.recv(65536)
                break
            except socket.timeout:
                pass
        rest, closed = read_all(s, 3)
    assert (answer + rest).startswith(b"HTTP/1.1 408"), answer + rest
    assert closed and time.monotonic() - t0 < 4
    assert "headers did not arrive within 1 s" in server.log.read_text()


def test_a_connection_that_never_speaks_is_closed(server):
    with socket.create_connection(("127.0.0.1", server.port)) as s:
        got, closed = read_all(s, 4)
    assert closed and got == b""


def test_a_client_that_stops_reading_is_dropped_after_the_send_timeout():
    """On uvicorn with umakit's protocol, an app streaming 128 MiB to a client that reads nothing: its sends stop
    waiting after send_timeout_s and the connection is aborted (the umakit app then sees the client leave, and
    cancels its request: the soak test in test_guard.py drops clients mid-stream)."""
    import threading

    import uvicorn

    from support.serve_helpers import free_port
    from umakit.serve.connections import protocol

    ended = threading.Event()

    async def app(scope, receive, send):
        if scope["type"] != "http":
            return
        await send({"type": "http.response.start", "status": 200, "headers": []})
        try:
            for _ in range(2048):  # 128 MiB in all: far beyond the socket buffers
                await send({"type": "http.response.body", "body": b"x" * 65536, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        finally:
            ended.set()

    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, http=protocol(10, 1),
                                           log_level="warning", lifespan="off"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        while not server.started:
            time.sleep(0.05)
        with socket.socket() as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            s.connect(("127.0.0.1", port))
            s.sendall(b"GET / HTTP/1.1\r\nHost: localhost\r\n\r\n")
            t0 = time.monotonic()
            assert ended.wait(10), "the app's sends still wait on a client that reads nothing"
            assert time.monotonic() - t0 >= 1
            got, closed = read_all(s, 5)
        assert closed and len(got) < 64 << 20
    finally:
        server.should_exit = True
        thread.join(10)


def test_a_slow_reader_and_a_kept_alive_connection_are_not_cut(server):
    name = httpx.get(f"{server.url}/v1/models").json()["data"][0]["id"]
    chat = {"model": name, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 40, "stream": True,
            "temperature": 0}  # greedy: 40 tokens, the same every run
    with httpx.Client(base_url=server.url, timeout=30) as client:
        lines = []
        with client.stream("POST", "/v1/chat/completions", json=chat) as r:
            t0 = time.monotonic()
            for line in r.iter_lines():  # a read every 50 ms
                lines.append(line)
                time.sleep(0.05)
        assert "data: [DONE]" in lines and time.monotonic() - t0 > 1.2  # longer than either deadline
        time.sleep(0.5)  # idle on the kept-alive connection, within uvicorn's 5 s
        assert client.post("/v1/chat/completions", json={**chat, "stream": False}).status_code == 200
