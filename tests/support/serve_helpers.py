"""A real `umakit serve` in a subprocess for the tests, and readers of what it answers."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """``python -m umakit.cli.main serve MODEL ARGS`` on 127.0.0.1 and a free port; its stderr goes to ``log``.
    Without a model (None), the server serves models by name."""

    def __init__(self, model: Path | None, args: list[str], log: Path, env: dict[str, str] | None = None):
        self.port, self.model_path = free_port(), model
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = log
        cmd = [sys.executable, "-m", "umakit.cli.main", "serve", *([str(model)] if model is not None else []),
               "--host", "127.0.0.1", "--port", str(self.port), *args]
        self._stderr = open(log, "w")
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=self._stderr,
                                     env={**os.environ, **(env or {})})

    def wait_healthy(self, timeout_s: float = 90) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"umakit serve exited with {self.proc.returncode}:\n{self.log.read_text()}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        raise RuntimeError(f"umakit serve was not healthy after {timeout_s} s:\n{self.log.read_text()}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._stderr.close()


def start_server(model, args: list[str], tmp_path_factory, name: str = "server") -> ServerProcess:
    """A server for a test module (its $UMAKIT_HOME the session's), healthy; the caller stops it."""
    home = tmp_path_factory.getbasetemp() / "umakit_home"
    srv = ServerProcess(model, args, tmp_path_factory.mktemp("serve") / f"{name}.log", env={"UMAKIT_HOME": str(home)})
    try:
        srv.wait_healthy()
    except BaseException:
        srv.stop()
        raise
    return srv


def read_metrics(text: str) -> dict[str, float]:
    """Prometheus text -> {name (labels included): value}; checks that every sample has HELP and TYPE lines."""
    values, described = {}, set()
    for line in text.splitlines():
        if line.startswith("# HELP ") or line.startswith("# TYPE "):
            _, kind, name = line.split(maxsplit=3)[:3]
            described.add((name, kind))
            continue
        name, value = line.rsplit(" ", 1)
        base = name.split("{")[0]
        assert (base, "HELP") in described and (base, "TYPE") in described, f"{base} lacks HELP or TYPE"
        values[name] = float(value)
    return values


def assert_error(r, status, param=None, code=None) -> dict:
    """``r`` is an error of ``status`` in OpenAI's shape (with ``param`` and, when given, ``code``); its body."""
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    assert err["param"] == param and (code is None or err["code"] == code), err
    return err


def served(local, settings=None, **app_options):
    """``(scheduler, app)`` in process over the loaded model ``local``; the caller stops the scheduler."""
    from umakit.serve import Scheduler, SchedulerSettings, make_app

    scheduler = Scheduler(local, settings or SchedulerSettings(max_concurrency=4))
    scheduler.start()
    return scheduler, make_app(local, scheduler, **app_options)


def asgi_calls(app, calls):
    """Run ``calls`` (``(method, path, json)``) one after another against ``app`` in process; their responses."""
    import asyncio

    async def go():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://localhost", timeout=30) as c:
            return [await c.request(method, path, json=payload) for method, path, payload in calls]

    return asyncio.run(go())


def concurrent_chats(path, backend: str, tmp_path_factory, name: str, rounds: int = 1):
    """``umakit serve --backend BACKEND`` on ``path`` asked four greedy chats at once, ``rounds`` times over: (the
    replies of each round, the replies the model gives each question alone in process)."""
    from concurrent.futures import ThreadPoolExecutor

    import httpx

    import umakit

    questions = ["The quick brown fox", "Paris is the capital of", "Unified memory", "fox fox fox"]
    local = umakit.load(path, backend=backend, dtype="float32")
    want = [local.generate(messages=[{"role": "user", "content": q}], max_tokens=8, temperature=0).text
            for q in questions]
    srv = start_server(path, ["--backend", backend, "--dtype", "float32"], tmp_path_factory, name)
    try:
        model = httpx.get(f"{srv.url}/v1/models").json()["data"][0]["id"]

        def ask(q: str) -> str:
            r = httpx.post(f"{srv.url}/v1/chat/completions", timeout=120, json={
                "model": model, "messages": [{"role": "user", "content": q}], "max_tokens": 8, "temperature": 0})
            assert r.status_code == 200, r.text
            return r.json()["choices"][0]["message"]["content"]

        with ThreadPoolExecutor(4) as pool:
            got = [list(pool.map(ask, questions)) for _ in range(rounds)]
    finally:
        srv.stop()
    return got, want


def answers(scheduler, loop, requests, timeout_s: float = 120) -> list[tuple[list[int], object]]:
    """Submit ``requests`` to a started `Scheduler` on ``loop``; each one's tokens and final event, in order (an
    error event fails the test)."""
    import asyncio

    from umakit.serve.types import FinalEvent, TokenEvent

    async def collect(handle):
        tokens = []
        while True:
            event = await asyncio.wait_for(handle.queue.get(), timeout_s)
            if isinstance(event, TokenEvent):
                tokens.append(event.token)
            elif isinstance(event, FinalEvent):
                return tokens, event
            else:
                raise AssertionError(f"the request failed: {event}")

    async def all_of(handles):
        return await asyncio.gather(*(collect(h) for h in handles))

    return loop.run_until_complete(all_of([scheduler.submit(r, loop) for r in requests]))
