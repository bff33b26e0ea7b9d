"""Hostile input against a real server on 127.0.0.1: what a web page must not make a keyless `umakit serve` do
(answer under a rebound DNS name, read a body a browser sends without asking first), malformed JSON that used to
be a 500, a forged log line, an upload cut off; and keys that could never work are refused at start-up."""

from __future__ import annotations

import socket
import subprocess
import sys
import time

import httpx
import pytest

from support.serve_helpers import read_metrics, start_server

pytestmark = pytest.mark.slow

CHAT = {"model": "any", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}


@pytest.fixture(scope="module")
def server(tiny_dir, tmp_path_factory):
    srv = start_server(tiny_dir("llama"), ["--backend", "torch", "--peak-bandwidth", "100", "--allowed-hosts",
                                           "my.box, Studio.local", "--body-timeout", "1"], tmp_path_factory, "guard")
    yield srv
    srv.stop()


def requests_total(srv) -> float:
    return read_metrics(httpx.get(f"{srv.url}/metrics").text)["umakit_requests_total"]


@pytest.mark.parametrize("host", ["evil.example", "evil.example:8080", "127.0.0.1.evil.example", ""])
def test_a_rebound_name_is_refused_before_any_route(server, host):
    for method, path in (("GET", "/v1/models"), ("GET", "/health"), ("POST", "/v1/chat/completions")):
        r = httpx.request(method, f"{server.url}{path}", json=CHAT, headers={"Host": host}, timeout=30)
        assert r.status_code == 400 and r.json()["error"]["code"] == "host_not_allowed", (method, path, r.text)


@pytest.mark.parametrize("host", ["localhost", "LOCALHOST:{port}", "127.0.0.1:{port}", "[::1]:{port}", "my.box",
                                  "studio.local:{port}", "app.localhost"])
def test_the_servers_own_names_and_addresses_pass(server, host):
    r = httpx.get(f"{server.url}/v1/models", headers={"Host": host.format(port=server.port)}, timeout=30)
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("kind", ["text/plain", "application/x-www-form-urlencoded", "multipart/form-data", None])
def test_a_body_a_browser_sends_without_a_preflight_is_never_read(server, kind):
    before = requests_total(server)
    headers = {"Content-Type": kind} if kind else {}
    for path in ("/v1/chat/completions", "/v1/messages/count_tokens"):
        r = httpx.post(f"{server.url}{path}", content=httpx.Request("POST", "/", json=CHAT).content,
                       headers=headers, timeout=30)
        assert r.status_code == 415 and "Content-Type: application/json" in r.text, r.text
    assert requests_total(server) == before  # nothing reached the scheduler


def test_json_with_a_charset_is_json(server):
    name = httpx.get(f"{server.url}/v1/models").json()["data"][0]["id"]
    body = httpx.Request("POST", "/", json={**CHAT, "model": name}).content
    r = httpx.post(f"{server.url}/v1/chat/completions", content=body,
                   headers={"Content-Type": "application/json; charset=utf-8"}, timeout=60)
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("key", ["", "   ", "clé-secrète", "tab\tkey"])
def test_a_key_that_could_never_match_is_refused_at_start(tiny_dir, key):
    run = subprocess.run([sys.executable, "-m", "umakit.cli.main", "serve", str(tiny_dir("llama")), "--port", "0",
                          "--api-key", key], capture_output=True, text=True, timeout=120)
    assert run.returncode == 2 and "--api-key" in run.stderr and "printable ASCII" in run.stderr, run.stderr
    assert "Traceback" not in run.stderr


def test_a_keys_file_with_a_key_that_could_never_match_is_refused_at_start(tiny_dir, tmp_path):
    keys = tmp_path / "keys"
    keys.write_text("good-key\nclé\n")
    run = subprocess.run([sys.executable, "-m", "umakit.cli.main", "serve", str(tiny_dir("llama")), "--port", "0",
                          "--api-keys", str(keys)], capture_output=True, text=True, timeout=120)
    assert run.returncode == 2 and "--api-keys" in run.stderr and "printable ASCII" in run.stderr, run.stderr


def test_each_key_reuses_only_its_own_prompts(tiny_dir, tmp_path_factory, tmp_path):
    """Keys from --api-key and --api-keys all open the server; a prompt one key's holder sent is cached for that
    key alone, so another holder learns nothing of it from ``cached_tokens``."""
    keys = tmp_path / "keys"
    keys.write_text("# the team\nbob-key\n\ncarol-key\n")
    srv = start_server(tiny_dir("llama"), ["--backend", "torch", "--peak-bandwidth", "100", "--api-key", "alice-key",
                                           "--api-keys", str(keys)], tmp_path_factory, "keys")
    try:
        name = httpx.get(f"{srv.url}/v1/models", headers={"Authorization": "Bearer bob-key"}).json()["data"][0]["id"]

        def cached(key: str, prompt: str = "The quick brown fox jumps over the lazy dog, again and again.") -> int:
            r = httpx.post(f"{srv.url}/v1/completions", json={"model": name, "prompt": prompt, "max_tokens": 2},
                           headers={"Authorization": f"Bearer {key}"}, timeout=60)
            assert r.status_code == 200, r.text
            return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]

        assert cached("alice-key") == 0
        assert cached("bob-key") == 0 and cached("carol-key") == 0  # alice's prompt is not theirs to reuse
        assert cached("alice-key") > 0 and cached("bob-key") > 0  # each reuses its own
        r = httpx.post(f"{srv.url}/v1/messages", json={"model": name, "max_tokens": 2,
                                                       "messages": [{"role": "user", "content": "Hi"}]},
                       headers={"x-api-key": "carol-key"}, timeout=60)
        assert r.status_code == 200, r.text
        r = httpx.get(f"{srv.url}/v1/models", headers={"Authorization": "Bearer mallory-key"})
        assert r.status_code == 401
    finally:
        srv.stop()


def post_raw(srv, body: bytes) -> httpx.Response:
    return httpx.post(f"{srv.url}/v1/chat/completions", content=body, headers={"Content-Type": "application/json"},
                      timeout=30)


def server_errors(srv) -> float:
    """5xx responses so far (a /health asked while the model warms up is a 503 that says "loading")."""
    metrics = read_metrics(httpx.get(f"{srv.url}/metrics").text)
    return sum(v for k, v in metrics.items() if k.startswith('umakit_http_responses_total{status="5'))


def test_malformed_json_that_was_a_500_is_a_400(server):
    before = server_errors(server)
    name = httpx.get(f"{server.url}/v1/models").json()["data"][0]["id"]
    nested = b'{"model": "' + name.encode() + b'", "messages": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    lone = b'{"model": "' + name.encode() + b'", "messages": [{"role": "user", "content": "hi \\ud800"}]}'
    lone_model = b'{"model": "\\udfff", "messages": [{"role": "user", "content": "hi"}]}'
    for body, says in ((nested, "nested too deeply"), (lone, "lone surrogate"), (lone_model, "lone surrogate")):
        r = post_raw(server, body)
        assert r.status_code == 400 and says in r.json()["error"]["message"], r.text
    long_stop = {"model": name, "messages": [{"role": "user", "content": "hi"}], "stop": ["x" * 1001]}
    r = httpx.post(f"{server.url}/v1/chat/completions", json=long_stop, timeout=30)
    assert r.status_code == 400 and "at most 1000 characters" in r.text
    assert server_errors(server) == before


def test_a_client_cannot_forge_a_log_line(server):
    forged = "nope\n12:00:00 chatcmpl-forged 200 stop prompt=1 cached=0 completion=1"
    r = httpx.post(f"{server.url}/v1/chat/completions", json={**CHAT, "model": forged}, timeout=30)
    assert r.status_code == 404
    time.sleep(0.2)
    log = server.log.read_text()
    assert "chatcmpl-forged" in log  # the attempt is logged, on the line of the request that made it
    assert not any(line.startswith("12:00:00 chatcmpl-forged") for line in log.splitlines())


def test_an_upload_cut_off_is_a_client_that_left_not_a_failure(server):
    before = server_errors(server)
    with socket.create_connection(("127.0.0.1", server.port)) as s:
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
                  b"Content-Length: 100000\r\n\r\n" + b'{"model": "x", "messages": [')
        time.sleep(0.3)
    time.sleep(0.5)
    assert httpx.get(f"{server.url}/health").status_code == 200
    assert "Traceback" not in server.log.read_text()
    assert server_errors(server) == before


def test_a_cache_salt_keeps_callers_from_reusing_each_others_prompts(server):
    """vLLM's ``cache_salt``: the same prompt under another salt prefills from nothing (so its time and
    ``cached_tokens`` tell nothing about what others sent); under its own salt it is reused."""
    name = httpx.get(f"{server.url}/v1/models").json()["data"][0]["id"]
    prompt = "The quick brown fox jumps over the lazy dog, again and again and again."

    def cached(**extra):
        r = httpx.post(f"{server.url}/v1/completions", json={"model": name, "prompt": prompt, "max_tokens": 2,
                                                              **extra}, timeout=60)
        assert r.status_code == 200, r.text
        return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]

    cached(cache_salt="alice")
    assert cached(cache_salt="mallory") == 0 and cached() == 0
    assert cached(cache_salt="alice") > 0
    r = httpx.post(f"{server.url}/v1/completions", json={"model": name, "prompt": "x", "cache_salt": ""}, timeout=30)
    assert r.status_code == 400 and "cache_salt" in r.text


def test_a_conversation_that_cannot_fit_is_refused_before_its_template_is_rendered(server):
    """More messages than the context has tokens (the tiny model's is 512): a 400 without rendering 600 turns."""
    name = httpx.get(f"{server.url}/v1/models").json()["data"][0]["id"]
    turns = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "ok"}] * 300
    r = httpx.post(f"{server.url}/v1/chat/completions", json={"model": name, "messages": turns + turns[:1]},
                   timeout=60)
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
    assert "601 messages" in r.json()["error"]["message"]


def test_a_body_that_stops_arriving_gets_a_408_and_frees_its_connection(server):
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as s:
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
                  b"Content-Length: 1000\r\n\r\n" + b'{"model": "x", ')
        answer = ""
        while "--body-timeout" not in answer:  # after --body-timeout 1, without sending the rest
            piece = s.recv(65536).decode("latin-1")  # the head and the body may come apart
            if not piece:
                break
            answer += piece
    assert answer.startswith("HTTP/1.1 408") and "--body-timeout" in answer, answer[:300]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads the server's memory from Linux's /proc")
def test_a_soak_of_good_malformed_slow_and_vanishing_clients(server):
    """200 requests from 16 clients, a quarter each good, malformed, slow to read their stream, and gone after the
    first chunk: every one answered once, none with a 5xx, the server healthy after, a greedy reply unchanged and
    its resident memory back within 10% of where it started."""
    import random
    from concurrent.futures import ThreadPoolExecutor

    name = httpx.get(f"{server.url}/v1/models").json()["data"][0]["id"]
    greedy = {"model": name, "messages": [{"role": "user", "content": "The quick brown fox"}], "max_tokens": 8,
              "temperature": 0}

    def reference() -> str:
        return httpx.post(f"{server.url}/v1/chat/completions", json=greedy, timeout=60).json()["choices"][0]

    want = reference()
    for _ in range(8):  # warm the allocators before the memory is read
        reference()
    rss = _rss_of(server)

    def one(k: int) -> tuple[int, str]:
        kind = k % 4
        body = {"model": name, "messages": [{"role": "user", "content": f"Tell me about {k}"}], "max_tokens": 12}
        if kind == 0:
            return httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=120).status_code, "good"
        if kind == 1:
            bad = random.Random(k).choice([b"{", b'{"model": 1}', b'{"model": "x", "messages": 3}', b"[]",
                                            b'{"model": "' + name.encode() + b'", "nonsense": true, "messages": []}'])
            return post_raw(server, bad).status_code, "malformed"
        with httpx.stream("POST", f"{server.url}/v1/chat/completions", json={**body, "stream": True},
                          timeout=120) as r:
            for i, _ in enumerate(r.iter_lines()):
                if kind == 3:
                    break  # gone after the first line
                time.sleep(0.02)  # reads slowly
            return r.status_code, "stream"

    with ThreadPoolExecutor(16) as pool:
        answers = list(pool.map(one, range(200)))
    assert len(answers) == 200
    assert all(status < 500 for status, _ in answers), [a for a in answers if a[0] >= 500]
    assert all(status == 200 for status, kind in answers if kind in ("good", "stream"))
    assert all(400 <= status < 500 for status, kind in answers if kind == "malformed")
    assert httpx.get(f"{server.url}/health").status_code == 200
    assert reference() == want
    time.sleep(1)
    assert _rss_of(server) <= rss * 1.10, (_rss_of(server), rss)


def _rss_of(srv) -> int:
    with open(f"/proc/{srv.proc.pid}/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))
