"""`umakit serve` with models by name: a real server holding several tiny models, driven by the `openai` client.

Each model answers as it does alone (greedy tokens equal to a local `generate`), requests for different models run
at the same time, a model is loaded on first use and unloaded by keep_alive or to make room within the memory
budget, and the ways a name can be wrong each get their own clear answer.
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from support.markers import requires_default_model
from support.serve_helpers import read_metrics, start_server
from support.tiny import make_tiny_model

openai = pytest.importorskip("openai")

pytestmark = pytest.mark.slow

PEAK = "100"
FAMILIES = ("llama", "qwen3")


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    return {f: str(make_tiny_model(f, tmp_path_factory.mktemp(f))) for f in FAMILIES}


@pytest.fixture(scope="module")
def local(paths):
    import umakit

    return {f: umakit.load(p, backend="torch", peak_bandwidth=float(PEAK)) for f, p in paths.items()}


def start(tmp_path_factory, *args):
    return start_server(None, ["--backend", "torch", "--peak-bandwidth", PEAK, *args], tmp_path_factory, "host")


@pytest.fixture(scope="module")
def host(tmp_path_factory):
    srv = start(tmp_path_factory, "--keep-alive", "60s")
    yield srv
    srv.stop()


def client(srv):
    return openai.OpenAI(base_url=f"{srv.url}/v1", api_key="none", max_retries=0, timeout=120)


def models(srv) -> dict[str, dict]:
    return {m["id"]: m for m in httpx.get(f"{srv.url}/v1/models").json()["data"]}


def per_model(srv) -> dict[str, float]:
    return read_metrics(httpx.get(f"{srv.url}/metrics").text)


def ask(srv, model, prompt, **extra):
    r = client(srv).completions.create(model=model, prompt=prompt, max_tokens=12, temperature=0, **extra)
    return r.choices[0].text, r.model


def test_each_model_answers_as_it_does_alone_interleaved_and_concurrent(host, paths, local):
    want = {(f, p): local[f].generate(p, max_tokens=12, temperature=0, raw=True).text
            for f in FAMILIES for p in ("The quick", "Paris is")}
    jobs = [(f, p) for p in ("The quick", "Paris is") for f in FAMILIES] * 2
    for f, p in jobs[:4]:  # one after another, alternating models
        text, named = ask(host, paths[f], p)
        assert text == want[f, p] and named == paths[f]
    with ThreadPoolExecutor(8) as pool:  # at the same time
        got = list(pool.map(lambda job: ask(host, paths[job[0]], job[1])[0], jobs))
    assert got == [want[job] for job in jobs]
    listed = models(host)
    assert all(listed[paths[f]]["loaded"] for f in FAMILIES)
    m = per_model(host)
    assert all(m[f'umakit_model_loaded{{model="{paths[f]}"}}'] == 1 for f in FAMILIES)
    assert all(m[f'umakit_model_loads_total{{model="{paths[f]}"}}'] == 1 for f in FAMILIES)  # loaded once


def test_keep_alive_zero_unloads_after_the_request(host, paths):
    path = paths["llama"]
    ask(host, path, "The quick")
    assert models(host)[path]["loaded"]
    r = httpx.post(f"{host.url}/v1/completions", json={"model": path, "prompt": "The", "max_tokens": 2,
                                                       "keep_alive": 0})
    assert r.status_code == 200, r.text
    assert not models(host)[path]["loaded"]
    assert per_model(host)[f'umakit_model_bytes{{model="{path}"}}'] == 0
    ask(host, path, "The quick")  # loads again on the next request
    assert models(host)[path]["loaded"]


def test_names_that_are_wrong(host, paths):
    c = client(host)
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        c.completions.create(model=paths["llama"] + "-nope", prompt="x", max_tokens=2)
    r = httpx.post(f"{host.url}/v1/completions", json={"model": paths["llama"], "prompt": "x", "keep_alive": "soon"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "keep_alive"


def test_the_tokenizer_routes_take_the_model_by_name(host, paths, local):
    """/tokenize and /tokenizer_info answer for the model named (a GET's in its query); with several models known
    and none named, a 400 says to name one."""
    for f in FAMILIES:
        r = httpx.post(f"{host.url}/tokenize", json={"model": paths[f], "prompt": "Paris is",
                                                     "add_special_tokens": False})
        assert r.json()["tokens"] == local[f].tokenizer.encode("Paris is", add_special_tokens=False)
        info = httpx.get(f"{host.url}/tokenizer_info", params={"model": paths[f]}).json()
        assert info["chat_template"] == local[f].tokenizer.chat_template
    r = httpx.post(f"{host.url}/tokenize", json={"prompt": "Paris is"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "model"


def test_a_model_that_fails_to_load_leaves_the_others_served(host, paths, tmp_path):
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text(json.dumps({"model_type": "llama"}))
    (broken / "model.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(openai.APIStatusError) as e:
        client(host).completions.create(model=str(broken), prompt="x", max_tokens=2)
    assert e.value.status_code == 500 and "failed to load" in str(e.value)
    assert ask(host, paths["qwen3"], "The quick")[0]  # still serving


def test_a_budget_for_one_model_evicts_the_idle_one_and_refuses_one_too_big(tmp_path_factory, paths, local):
    import umakit

    # room for the llama model as loaded and the qwen3 one's files (what a load counts before it starts), less a byte
    budget = local["llama"].info.weights.total_bytes + umakit.checkpoint_size(local["qwen3"].info.path) - 1
    srv = start(tmp_path_factory, "--memory-budget", str(budget))
    try:
        ask(srv, paths["llama"], "The quick")
        ask(srv, paths["qwen3"], "The quick")
        listed = models(srv)
        assert listed[paths["qwen3"]]["loaded"] and not listed[paths["llama"]]["loaded"]  # made room
        assert ask(srv, paths["llama"], "Paris is")[0] == local["llama"].generate(
            "Paris is", max_tokens=12, temperature=0, raw=True).text
    finally:
        srv.stop()
    small = start(tmp_path_factory, "--memory-budget", "1000")
    try:
        r = httpx.post(f"{small.url}/v1/completions", json={"model": paths["llama"], "prompt": "x"})
        err = r.json()["error"]
        assert r.status_code == 400 and err["code"] == "model_too_large" and "budget" in err["message"]
    finally:
        small.stop()


@requires_default_model
def test_the_built_in_model_by_its_name(host):
    """`umakit serve` with no model, then the README's request: the built-in model loads on first use."""
    import umakit

    want = umakit.load(backend="torch").generate("Hello!", max_tokens=8, temperature=0).text
    assert "SmolLM2-135M-Instruct" in models(host)  # listed before any request loads it, for a client to pick
    r = client(host).chat.completions.create(model="SmolLM2-135M-Instruct", max_tokens=8, temperature=0,
                                             messages=[{"role": "user", "content": "Hello!"}])
    assert r.choices[0].message.content == want and r.model == "SmolLM2-135M-Instruct"


def _rss(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))


@requires_default_model
@pytest.mark.skipif(not __import__("os").path.exists("/proc/self/status"), reason="reads Linux's /proc")
def test_an_unloaded_models_memory_falls_back(tmp_path_factory):
    """The built-in model on float16 weights (287 MB, any CPU), loaded and unloaded five times with
    ``keep_alive: 0``: each time the server's resident memory falls back to less than one copy of the weights over
    what a process holds that has imported the same runtime (torch, the engine, the server's modules) and loaded
    nothing. Measured: 104-209 MB over it; before the host handed memory back once the model was gone (its
    request's handle held it past the unload), 340 MB stayed, more than the weights."""
    import subprocess
    import sys
    import time

    runtime = subprocess.run([sys.executable, "-c", (
        "import torch, tokenizers, llguidance, uvicorn, umakit.serve.app, umakit.serve.host, umakit.serve.scheduler\n"
        "import umakit.backends.torch.engine\n"
        "from umakit.backends.torch.cpu import build; build.ensure()\n"
        "print(next(int(l.split()[1]) * 1024 for l in open('/proc/self/status') if l.startswith('VmRSS:')))")],
        capture_output=True, text=True, check=True)
    runtime_rss = int(runtime.stdout.split()[-1])
    srv = start(tmp_path_factory, "--dtype", "float16", "--keep-alive", "-1")
    try:
        body = {"model": "SmolLM2-135M-Instruct", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 8}
        assert httpx.post(f"{srv.url}/v1/chat/completions", json=body, timeout=120).status_code == 200
        weights = models(srv)["SmolLM2-135M-Instruct"]["bytes"]
        loaded = _rss(srv.proc.pid)
        assert weights > 200 * 2**20 and loaded > runtime_rss + weights
        for turn in range(5):
            stream = turn % 2 == 1  # a streamed reply holds the model until its last chunk is sent
            r = httpx.post(f"{srv.url}/v1/chat/completions", json={**body, "keep_alive": 0, "stream": stream},
                           timeout=120)
            assert r.status_code == 200 and not models(srv)["SmolLM2-135M-Instruct"]["loaded"]
            deadline = time.monotonic() + 10
            while _rss(srv.proc.pid) > runtime_rss + weights and time.monotonic() < deadline:
                time.sleep(0.2)
            assert _rss(srv.proc.pid) <= runtime_rss + weights, (turn, _rss(srv.proc.pid), runtime_rss)
    finally:
        srv.stop()


def test_the_list_holds_this_machines_models_beside_the_loaded_ones():
    """`ModelHost.cards`: the models it has held, then those ``available()`` names (once each, unloaded); a name
    that fails gets close matches among both; a disk that cannot be read lists nothing more."""
    from umakit.errors import ModelNotFoundError
    from umakit.serve.api_errors import APIError
    from umakit.serve.host import ModelHost
    from umakit.serve.types import SchedulerSettings

    def size(name):
        raise ModelNotFoundError(f"model not found: {name}")

    disks = [["qwen2.5-0.5b.Q4_K_M-0123", "tiny", "tiny"]]

    def available():
        if isinstance(disks[0], Exception):
            raise disks[0]
        return disks[0]

    host = ModelHost(lambda name: None, size, SchedulerSettings(), budget_bytes=1 << 30, available=available)
    try:
        cards = host.cards()
        assert [c["id"] for c in cards] == ["qwen2.5-0.5b.Q4_K_M-0123", "tiny"]
        assert all(not c["loaded"] and c["bytes"] == 0 and c["unloads_in_s"] is None for c in cards)
        with pytest.raises(APIError, match="did you mean 'qwen2.5-0.5b.Q4_K_M-0123'") as e:
            host._bytes_of("qwen2.5-0.5b.Q4_K_M")
        assert e.value.status == 404
        disks[0] = PermissionError("unreadable")
        assert host.cards() == []
    finally:
        host.close()
