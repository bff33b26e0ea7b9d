"""`umakit serve` as users meet it: a real server in a subprocess, driven by the official `openai` client
(and raw httpx for what a client library would refuse to send).

The oracle for every greedy reply is the same tiny model loaded in this process with the same engine
and dtype: a request decoded in a batch of 16 must give exactly what a lone `model.generate` gives.
"""

from __future__ import annotations

import json
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from support.markers import requires_default_model
from support.serve_helpers import ServerProcess, asgi_calls, assert_error, read_metrics, served

openai = pytest.importorskip("openai")

pytestmark = pytest.mark.slow

KEY = "test-key-123"
PEAK = "100"  # GB/s: skips measuring the CPU's bandwidth (seconds) in the server and here
BODY_LIMIT = 1 << 20


@pytest.fixture(scope="module")
def server(tiny_dir, tmp_path_factory):
    home = tmp_path_factory.getbasetemp() / "umakit_home"
    srv = ServerProcess(tiny_dir("llama"), ["--backend", "torch", "--api-key", KEY, "--peak-bandwidth", PEAK,
                                            "--max-body-bytes", str(BODY_LIMIT)],
                        tmp_path_factory.mktemp("serve") / "server.log", env={"UMAKIT_HOME": str(home)})
    try:
        srv.wait_healthy()
        yield srv
    finally:
        srv.stop()


@pytest.fixture(scope="module")
def tight_server(tiny_dir, tmp_path_factory):
    """One row and one queue slot: to reach the 429."""
    home = tmp_path_factory.getbasetemp() / "umakit_home"
    srv = ServerProcess(tiny_dir("llama"), ["--backend", "torch", "--peak-bandwidth", PEAK, "--max-concurrency", "1",
                                            "--max-queue", "1"],
                        tmp_path_factory.mktemp("serve") / "tight.log", env={"UMAKIT_HOME": str(home)})
    try:
        srv.wait_healthy()
        yield srv
    finally:
        srv.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def local(tiny_dir):
    """The served model, loaded here the same way: the oracle."""
    import umakit

    return umakit.load(tiny_dir("llama"), backend="torch", peak_bandwidth=float(PEAK))


@pytest.fixture(scope="module")
def name(local):
    return local.info.name


def raw(server, path, payload=None, *, key=KEY, content=None, method="POST"):
    headers = {"Authorization": f"Bearer {key}"} if key is not None else {}
    if content is not None:
        headers["Content-Type"] = "application/json"
    return httpx.request(method, f"{server.url}{path}", json=payload, content=content, headers=headers, timeout=60)


def metrics(server) -> dict[str, float]:
    r = raw(server, "/metrics", method="GET")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    return read_metrics(r.text)


def user(text):
    return [{"role": "user", "content": text}]


# -- the openai client ---------------------------------------------------------------------------------
def test_models_and_health(server, client, name):
    assert [m.id for m in client.models.list()] == [name]
    assert client.models.retrieve(name).id == name
    r = httpx.get(f"{server.url}/health")  # no key needed
    assert (r.status_code, r.json()) == (200, {"status": "ok", "server": "umakit"})


def test_chat_matches_local_generate_with_usage(client, local, name):
    messages = user("What is the capital of France?")
    want = local.generate(messages=messages, max_tokens=12, temperature=0)
    r = client.chat.completions.create(model=name, messages=messages, max_tokens=12, temperature=0)
    choice = r.choices[0]
    assert (choice.message.role, choice.message.content) == ("assistant", want.text)
    assert choice.finish_reason == ("length" if want.finish_reason == "length" else "stop")
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-") and r.model == name
    u = r.usage
    assert u.prompt_tokens == len(local.encode(messages=messages))
    assert u.completion_tokens == len(want.tokens) and u.total_tokens == u.prompt_tokens + u.completion_tokens
    assert 0 <= u.prompt_tokens_details.cached_tokens < u.prompt_tokens
    ext = u.to_dict()["umakit"]
    assert set(ext) >= {"decode_tps", "achieved_gbps", "peak_gbps", "mbu", "batch_rows"}
    assert ext["decode_tps"] > 0 and ext["achieved_gbps"] > 0 and ext["peak_gbps"] == float(PEAK)
    assert ext["batch_rows"] >= 1 and ext["mbu"] == pytest.approx(ext["achieved_gbps"] / ext["peak_gbps"])


def test_logit_bias_is_the_local_generates(client, local, name):
    """OpenAI's ``logit_bias`` (token ids as JSON's text keys) reaches the sampler as `generate`'s does."""
    messages = user("What is the capital of France?")
    top = local.generate(messages=messages, max_tokens=1, temperature=0).tokens[0]
    for bias in ({top: -100}, {top: -100, local.encode("Rome", raw=True)[0]: 30}):
        want = local.generate(messages=messages, max_tokens=6, temperature=0, logit_bias=bias)
        r = client.chat.completions.create(model=name, messages=messages, max_tokens=6, temperature=0,
                                           logit_bias={str(k): v for k, v in bias.items()})
        assert r.choices[0].message.content == want.text and want.tokens[0] != top
        c = client.completions.create(model=name, prompt="The capital of France is", max_tokens=4, temperature=0,
                                      logit_bias={str(k): v for k, v in bias.items()})
        assert c.choices[0].text == local.generate("The capital of France is", raw=True, max_tokens=4,
                                                   temperature=0, logit_bias=bias).text


def test_chat_stream_with_usage_chunk(client, local, name):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": [{"type": "text", "text": "Hi"}]}]
    want = local.generate(messages=[messages[0], user("Hi")[0]], max_tokens=10, temperature=0)
    chunks = list(client.chat.completions.create(model=name, messages=messages, max_tokens=10, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want.text
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finishes) == 1 and chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(want.tokens)
    assert all(c.usage is None for c in chunks[:-1])


def test_completions_stream_and_not(client, local, name):
    want = local.generate("The quick brown", raw=True, max_tokens=8, temperature=0)
    r = client.completions.create(model=name, prompt="The quick brown", max_tokens=8, temperature=0)
    assert r.choices[0].text == want.text and r.object == "text_completion"
    assert r.usage.prompt_tokens == len(local.encode("The quick brown", raw=True))
    stream = client.completions.create(model=name, prompt=["The quick brown"], max_tokens=8, temperature=0,
                                       stream=True)
    assert "".join(c.choices[0].text for c in stream) == want.text
    ids = local.encode("The quick brown", raw=True)  # token ids, as OpenAI's completions take them too
    for prompt in (ids, [ids]):
        r = client.completions.create(model=name, prompt=prompt, max_tokens=8, temperature=0)
        assert r.choices[0].text == want.text and r.usage.prompt_tokens == len(ids)


def test_max_tokens_and_stop_strings(client, local, name):
    messages = user("Tell me about unified memory")
    r = client.chat.completions.create(model=name, messages=messages, max_completion_tokens=5, temperature=0)
    assert r.usage.completion_tokens <= 5
    full = local.generate(messages=messages, max_tokens=24, temperature=0).text
    stop = full[len(full) // 2:len(full) // 2 + 2]
    want = local.generate(messages=messages, max_tokens=24, temperature=0, stop=[stop])
    assert want.finish_reason == "stop_string"
    for stream in (False, True):
        r = client.chat.completions.create(model=name, messages=messages, max_tokens=24, temperature=0,
                                           stop=[stop, "never appears"], stream=stream)
        if stream:
            chunks = list(r)
            text = "".join(c.choices[0].delta.content or "" for c in chunks)
            finish = chunks[-1].choices[0].finish_reason
        else:
            text, finish = r.choices[0].message.content, r.choices[0].finish_reason
        assert (text, finish) == (want.text, "stop")


def test_seeds(client, name):
    def sample(seed):
        return client.chat.completions.create(model=name, messages=user("Say something"), max_tokens=16,
                                              temperature=1.0, top_p=1.0, seed=seed).choices[0].message.content

    first = sample(7)
    assert sample(7) == first
    assert sample(8) != first
    assert sample(-7) == sample(-7)  # OpenAI's seeds are any int64


def test_logprobs(client, name):
    r = client.chat.completions.create(model=name, messages=user("Hi"), max_tokens=4, temperature=0, logprobs=True,
                                       top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    for entry in content:
        assert len(entry.top_logprobs) == 3 and entry.logprob <= 0
        assert entry.logprob == pytest.approx(entry.top_logprobs[0].logprob)  # greedy: the most likely one


def test_several_prompts_and_n_are_choices_of_one_body(client, name):
    """A completion's list of prompts, and ``n``, are one choice each, at its index, as lone requests give them
    (the k-th sample of a prompt seeded seed + k), whole or streamed; the usage counts each prompt once and every
    choice's tokens."""
    prompts = ["The quick brown", "Once upon a"]
    alone = [client.completions.create(model=name, prompt=p, max_tokens=6, temperature=0) for p in prompts]
    r = client.completions.create(model=name, prompt=prompts, max_tokens=6, temperature=0)
    assert [(c.index, c.text) for c in r.choices] == [(i, a.choices[0].text) for i, a in enumerate(alone)]
    assert r.usage.prompt_tokens == sum(a.usage.prompt_tokens for a in alone)
    assert r.usage.completion_tokens == sum(a.usage.completion_tokens for a in alone)

    def chat(**kw):
        return client.chat.completions.create(model=name, messages=user("Say something"), max_tokens=8,
                                              temperature=1.0, **kw)

    many = chat(n=3, seed=7)
    assert [c.index for c in many.choices] == [0, 1, 2]
    assert [c.message.content for c in many.choices] == [chat(seed=7 + k).choices[0].message.content
                                                         for k in range(3)]
    assert many.usage.prompt_tokens == chat(seed=1).usage.prompt_tokens  # the prompt once
    stream = chat(n=3, seed=7, stream=True, stream_options={"include_usage": True})
    texts, finishes, usage = ["", "", ""], [None] * 3, None
    for chunk in stream:  # the choices' chunks as they come, each naming its index; then one usage
        for c in chunk.choices:
            texts[c.index] += c.delta.content or ""
            finishes[c.index] = c.finish_reason or finishes[c.index]
        usage = chunk.usage or usage
    assert texts == [c.message.content for c in many.choices] and None not in finishes
    assert usage.completion_tokens == many.usage.completion_tokens
    streamed = client.completions.create(model=name, prompt=prompts, max_tokens=6, temperature=0, stream=True)
    pieces = ["", ""]
    for chunk in streamed:
        for c in chunk.choices:
            pieces[c.index] += c.text
    assert pieces == [a.choices[0].text for a in alone]
    ids = [[1, 2, 3], [4, 5]]  # token-id prompts too, each with n samples
    r = client.completions.create(model=name, prompt=ids, max_tokens=3, temperature=0, n=2)
    assert len(r.choices) == 4 and r.choices[0].text == r.choices[1].text and r.usage.prompt_tokens == 5


def test_echo_scores_the_prompt_as_the_engine_does(server, client, local, name):
    """``echo`` with ``logprobs``, as evaluation harnesses send it (lm-eval's local-completions: token ids,
    max_tokens 1, logprobs 1): the prompt's text and tokens first, each token after the first scored as the
    model predicts it (the engine's own logits, softmaxed here), then the reply's."""
    import numpy as np

    text = "The quick brown fox jumps"
    ids = local.encode(text, raw=True)
    logits = local.engine.logits(ids).astype(np.float64)
    peak = logits.max(1, keepdims=True)
    lp = logits - peak - np.log(np.exp(logits - peak).sum(1, keepdims=True))
    want = [lp[j, ids[j + 1]] for j in range(len(ids) - 1)]
    plain = client.completions.create(model=name, prompt=text, max_tokens=2, temperature=0, logprobs=2)
    r = client.completions.create(model=name, prompt=text, max_tokens=2, temperature=0, logprobs=2, echo=True)
    c = r.choices[0]
    assert c.text == text + plain.choices[0].text
    assert c.logprobs.tokens[:len(ids)] == [local.tokenizer.decode([t]) for t in ids]
    assert c.logprobs.token_logprobs[0] is None and c.logprobs.top_logprobs[0] is None
    assert c.logprobs.token_logprobs[1:len(ids)] == pytest.approx(want, abs=1e-4)
    for j, top in enumerate(c.logprobs.top_logprobs[1:len(ids)]):  # (two tokens of one text are one key)
        assert 1 <= len(top) <= 2 and max(top.values()) == pytest.approx(lp[j].max(), abs=1e-4)
    assert c.logprobs.token_logprobs[len(ids):] == plain.choices[0].logprobs.token_logprobs
    assert c.logprobs.text_offset[:2] == [0, len(c.logprobs.tokens[0])]
    # the harness's own request and reading of it (lm_eval/models/openai_completions.py)
    ctx = 3
    body = raw(server, "/v1/completions", {"model": name, "prompt": [ids, ids[:4]], "temperature": 0,
                                           "max_tokens": 1, "logprobs": 1, "seed": 1234, "echo": True}).json()
    choices = sorted(body["choices"], key=lambda ch: ch["index"])
    scored = choices[0]["logprobs"]["token_logprobs"][ctx:-1]
    assert sum(scored) == pytest.approx(sum(want[ctx - 1:]), abs=1e-3)
    greedy = all(t == max(top.values()) for t, top in zip(scored, choices[0]["logprobs"]["top_logprobs"][ctx:-1]))
    assert greedy == all(ids[j + 1] == int(lp[j].argmax()) for j in range(ctx - 1, len(ids) - 1))
    assert choices[1]["logprobs"]["token_logprobs"][1:4] == pytest.approx(want[:3], abs=1e-4)
    stream = client.completions.create(model=name, prompt=text, max_tokens=2, temperature=0, echo=True, stream=True)
    assert "".join(ch.choices[0].text for ch in stream) == c.text  # echo streams its text first
    # max_tokens 0: the prompt scored alone (OpenAI's legacy scoring request, older harnesses')
    alone = client.completions.create(model=name, prompt=[ids, ids], max_tokens=0, echo=True, logprobs=1)
    for choice in alone.choices:
        assert choice.text == local.tokenizer.decode(ids) and choice.finish_reason == "length"
        assert choice.logprobs.token_logprobs[1:] == pytest.approx(want, abs=1e-4)
    assert alone.usage.completion_tokens == 0 and alone.usage.prompt_tokens == 2 * len(ids)
    assert_error(raw(server, "/v1/completions", {"model": name, "prompt": text, "max_tokens": 0}), 400,
                 param="max_tokens")


def test_tokenizer_routes_count_and_split_as_the_model_does(server, client, local, name):
    """vLLM's /tokenize, /detokenize and /tokenizer_info (llama-server's field names too), which lm-eval's remote
    tokenizer looks for: the model's own ids, a chat's prompt as a chat completion is given it, and refusals."""
    text = "The quick brown fox"
    ids = local.tokenizer.encode(text, add_special_tokens=False)
    r = raw(server, "/tokenize", {"prompt": text, "add_special_tokens": False}).json()
    assert r["tokens"] == ids and r["count"] == len(ids) and r["max_model_len"] == local.info.context_length
    assert raw(server, "/tokenize", {"content": text, "add_special": False}).json()["tokens"] == ids
    assert raw(server, "/tokenize", {"model": name, "prompt": text}).json()["tokens"] == local.tokenizer.encode(text)
    chat = client.chat.completions.create(model=name, messages=user("Hi there"), max_tokens=1)
    assert raw(server, "/tokenize", {"messages": user("Hi there")}).json()["count"] == chat.usage.prompt_tokens
    r = raw(server, "/detokenize", {"tokens": ids}).json()
    assert r["prompt"] == r["content"] == local.tokenizer.decode(ids)
    info = raw(server, "/tokenizer_info", method="GET").json()
    assert info["eos_token"] == local.tokenizer.eos_token and info["chat_template"] == local.tokenizer.chat_template
    assert raw(server, f"/tokenizer_info?model={name}", method="GET").status_code == 200
    assert_error(raw(server, "/tokenize", {"prompt": text, "messages": user("x")}), 400, param="prompt")
    assert_error(raw(server, "/tokenize", {"prompt": text, "with_pieces": True}), 400, param="with_pieces")
    assert_error(raw(server, "/tokenize", {"prompt": 5}), 400, param="prompt")
    assert_error(raw(server, "/detokenize", {"tokens": [1, 10**9]}), 400, param="tokens")
    assert_error(raw(server, "/detokenize", {"tokens": "abc"}), 400, param="tokens")
    assert_error(raw(server, "/tokenize", {"model": "other", "prompt": text}), 404, param="model")
    assert raw(server, "/tokenize", {"prompt": text}, key=None).status_code == 401


@pytest.mark.parametrize("markers, suffix_first", [(("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>"), False),
                                                   (("[PREFIX]", "[SUFFIX]"), True)])
def test_suffix_fills_in_the_middle_with_the_models_own_markers(tmp_path, markers, suffix_first):
    """OpenAI's ``suffix``: the prompt around the model's fill-in-the-middle markers, in its layout (Qwen-Coder's
    prefix-suffix-middle; Codestral's suffix first), the reply exactly a completion of that prompt given as ids."""
    import umakit
    from support.tiny import make_tiny_model, write_tokenizer

    path = make_tiny_model("llama", tmp_path / "coder")
    write_tokenizer(path, extra_specials=markers)
    local = umakit.load(path, backend="torch")
    name, tok = local.info.name, local.tokenizer
    prefix, suffix = "def add(a, b):\n    c = ", "\n    return c\n"
    m = [tok.token_to_id(t) for t in markers]
    pre, suf = local.encode(prefix, raw=True), local.encode(suffix, raw=True)
    ids = [m[1], *suf, m[0], *pre] if suffix_first else [m[0], *pre, m[1], *suf, m[2]]
    scheduler, app = served(local)
    try:
        filled, by_ids = asgi_calls(app, [
            ("POST", "/v1/completions", {"model": name, "prompt": prefix, "suffix": suffix, "max_tokens": 6,
                                         "temperature": 0}),
            ("POST", "/v1/completions", {"model": name, "prompt": ids, "max_tokens": 6, "temperature": 0})])
    finally:
        scheduler.stop()
    assert filled.status_code == 200, filled.text
    assert filled.json()["choices"][0]["text"] == by_ids.json()["choices"][0]["text"]
    assert filled.json()["usage"]["prompt_tokens"] == len(ids)


def test_suffix_on_a_model_without_markers_is_refused(server, name):
    err = assert_error(raw(server, "/v1/completions", {"model": name, "prompt": "a", "suffix": "b"}), 400,
                       param="suffix")
    assert "fill-in-the-middle" in err["message"]
    assert_error(raw(server, "/v1/completions", {"model": name, "prompt": "a", "suffix": "b", "echo": True}), 400,
                 param="echo")


# -- raw HTTP: every error in OpenAI's shape -----------------------------------------------------------
@pytest.mark.parametrize("field, value", [
    ("temperature", -1), ("top_p", 0), ("n", 0), ("n", 65), ("seed", 2**70), ("top_k", -3), ("min_p", 1.5),
    ("repetition_penalty", 0), ("max_tokens", 0), ("stop", ["a", "b", "c", "d", "e"]), ("top_logprobs", 21),
    ("logit_bias", {"5": 101}), ("logit_bias", {"x": 1}), ("logit_bias", {"99999999": 1}),
])
def test_bad_values_get_400_naming_the_field(server, name, field, value):
    payload = {"model": name, "messages": user("hi"), field: value}
    if field == "top_logprobs":
        payload["logprobs"] = True
    err = assert_error(raw(server, "/v1/chat/completions", payload), 400, param=field)
    assert err["type"] == "invalid_request_error"
    if field == "n":
        assert "n must be at least 1" in err["message"] or "at most 64 choices" in err["message"]


def test_malformed_and_incomplete_requests(server, name):
    assert_error(raw(server, "/v1/chat/completions", content=b'{"model": "x", "messages": ['), 400)
    assert_error(raw(server, "/v1/chat/completions", content=b'[1, 2]'), 400)
    assert_error(raw(server, "/v1/chat/completions", {"model": name}), 400, param="messages")
    assert_error(raw(server, "/v1/chat/completions", {"messages": user("hi")}), 400, param="model")
    assert_error(raw(server, "/v1/chat/completions", content=b'{"model": "%s", "messages": [{"role": "user", '
                                                             b'"content": "hi"}], "temperature": NaN}' % name.encode()),
                 400, param="temperature")
    err = assert_error(raw(server, "/v1/completions", {"model": name, "prompt": "a", "stream": True, "echo": True,
                                                       "logprobs": 1}), 400, param="echo")
    assert_error(raw(server, "/v1/chat/completions", {"model": name, "messages": user("hi"), "echo": True}), 400,
                 param="echo")
    for ids in ([[1], [10**9]], [1, 10**9], [], [1.5]):
        assert_error(raw(server, "/v1/completions", {"model": name, "prompt": ids}), 400, param="prompt")
    image = [{"type": "image_url", "image_url": {"url": "http://x"}}]
    assert_error(raw(server, "/v1/chat/completions", {"model": name, "messages": [{"role": "user", "content": image}]}),
                 400, param="messages[0].content")
    # a field umakit does not implement is refused by name, as OpenAI refuses one it does not know; fields that
    # cannot change the answer pass, and the penalties are implemented
    r = raw(server, "/v1/chat/completions", {"model": name, "messages": user("hi"), "max_tokens": 2,
                                              "frequency_penalty": 0.5, "presence_penalty": 0.5, "user": "me",
                                              "metadata": {"a": "b"}, "logit_bias": None, "functions": None})
    assert r.status_code == 200, r.text  # a null asks for nothing (clients that write every field they know)
    for field, value in [("whatever", {"a": 1}), ("best_of", 2), ("functions", [])]:
        err = assert_error(raw(server, "/v1/chat/completions", {"model": name, "messages": user("hi"), field: value}),
                           400, param=field)
        assert field in err["message"]


def test_oversize_body_413(server, name):
    big = {"model": name, "messages": user("x" * (BODY_LIMIT + 10))}
    assert_error(raw(server, "/v1/chat/completions", big), 413)


def test_api_key(server, name):
    payload = {"model": name, "messages": user("hi"), "max_tokens": 2}
    assert_error(raw(server, "/v1/chat/completions", payload, key=None), 401, code="invalid_api_key")
    assert_error(raw(server, "/v1/chat/completions", payload, key="wrong"), 401, code="invalid_api_key")
    assert_error(raw(server, "/v1/models", method="GET", key="wrong"), 401)
    assert_error(raw(server, "/metrics", method="GET", key=None), 401)
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{server.url}/v1", api_key="wrong", max_retries=0).models.list()


def test_unknown_model_404_and_route_404(server, client):
    assert_error(raw(server, "/v1/chat/completions", {"model": "gpt-4", "messages": user("hi")}), 404, param="model",
                 code="model_not_found")
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-4", prompt="hi")
    assert_error(raw(server, "/v1/nothing", {}), 404)


def test_context_overflow(server, local, name):
    limit = local.info.context_length
    err = assert_error(raw(server, "/v1/chat/completions", {"model": name, "messages": user("hi"),
                                                           "max_tokens": limit}),
                       400, param="messages", code="context_length_exceeded")
    assert str(limit) in err["message"]
    long_prompt = "The quick brown fox " * limit
    assert_error(raw(server, "/v1/completions", {"model": name, "prompt": long_prompt}), 400, param="prompt",
                 code="context_length_exceeded")


# -- batching, disconnects, the prompt cache, load ---------------------------------------------------
def test_16_concurrent_greedy_streams_match_lone_generate(server, client, local, name):
    jobs = [(user("Paris is the capital of France. " * (1 + i % 5) + f"Item {i}"), 6 + 2 * i) for i in range(16)]
    want = [local.generate(messages=m, max_tokens=n, temperature=0) for m, n in jobs]
    start = threading.Barrier(len(jobs))

    def run(job):
        messages, n = job
        start.wait()
        chunks = list(client.chat.completions.create(model=name, messages=messages, max_tokens=n, temperature=0,
                                                     stream=True, stream_options={"include_usage": True}))
        return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices), chunks[-1].usage

    with ThreadPoolExecutor(len(jobs)) as pool:
        got = list(pool.map(run, jobs))
    for (text, usage), w in zip(got, want):
        assert text == w.text
        assert usage.completion_tokens == len(w.tokens)
    assert metrics(server)["umakit_max_active_rows"] > 1
    assert max(u.to_dict()["umakit"]["batch_rows"] for _, u in got) > 1


def test_disconnect_frees_the_row_and_spares_the_others(server, client, local, name):
    before = metrics(server)
    other_messages = user("Unified memory lets the GPU read every weight")
    want = local.generate(messages=other_messages, max_tokens=40, temperature=0)
    result = {}

    def other():
        r = client.chat.completions.create(model=name, messages=other_messages, max_tokens=40, temperature=0,
                                           stream=True)
        result["text"] = "".join(c.choices[0].delta.content or "" for c in r)

    # a reply that runs to its cap (checked): the disconnect lands while it is being made (its 400 tokens
    # take this tiny model about 0.15 s; "Talk for a long time" ended after 19, before the client left)
    long = user("Tell me everything you know")
    assert local.generate(messages=long, max_tokens=400, temperature=0).finish_reason == "length"
    payload = {"model": name, "messages": long, "max_tokens": 400, "temperature": 0, "stream": True}
    with httpx.stream("POST", f"{server.url}/v1/chat/completions", json=payload,
                      headers={"Authorization": f"Bearer {KEY}"}, timeout=60) as r:
        lines = r.iter_lines()
        assert next(lines).startswith("data: ")
        thread = threading.Thread(target=other)
        thread.start()
        for _ in range(3):
            next(lines)
    # the long stream is closed here, after a few tokens of its 400
    deadline = time.monotonic() + 10
    while metrics(server)["umakit_requests_cancelled_total"] == before["umakit_requests_cancelled_total"]:
        assert time.monotonic() < deadline, "the disconnected request was never dropped"
        time.sleep(0.05)
    thread.join(timeout=60)
    assert result["text"] == want.text
    deadline = time.monotonic() + 10
    while metrics(server)["umakit_active_rows"] != 0:
        assert time.monotonic() < deadline, "rows are still active after every client finished"
        time.sleep(0.05)


def test_a_client_that_leaves_a_stream_of_several_choices_cancels_them_all(server, name):
    before = metrics(server)["umakit_requests_cancelled_total"]
    payload = {"model": name, "messages": user("Tell me everything you know"), "max_tokens": 400, "temperature": 1,
               "seed": 5, "n": 3, "stream": True}
    with httpx.stream("POST", f"{server.url}/v1/chat/completions", json=payload,
                      headers={"Authorization": f"Bearer {KEY}"}, timeout=60) as r:
        lines = r.iter_lines()
        assert next(lines).startswith("data: ")
        for _ in range(3):  # a few events, then the stream is closed mid-reply
            next(lines)
    deadline = time.monotonic() + 10
    while metrics(server)["umakit_requests_cancelled_total"] < before + 3:
        assert time.monotonic() < deadline, "the choices of the stream left were not all dropped"
        time.sleep(0.05)
    while metrics(server)["umakit_active_rows"] != 0:
        assert time.monotonic() < deadline, "rows are still active after the client left"
        time.sleep(0.05)


def test_second_turn_reuses_the_first_from_the_prompt_cache(client, local, name):
    first = user("Remember the number 4817 and the quick brown fox.")
    r1 = client.chat.completions.create(model=name, messages=first, max_tokens=10, temperature=0)
    reply = r1.choices[0].message.content
    second = first + [{"role": "assistant", "content": reply}, {"role": "user", "content": "And the dog?"}]
    r2 = client.chat.completions.create(model=name, messages=second, max_tokens=4, temperature=0, stream=True,
                                        stream_options={"include_usage": True})
    usage = list(r2)[-1].usage
    first_len = len(local.encode(messages=first))
    assert usage.prompt_tokens == len(local.encode(messages=second))
    # the whole first prompt, and as much of the reply as retokenizes the same way
    assert first_len <= usage.prompt_tokens_details.cached_tokens <= first_len + r1.usage.completion_tokens + 1


def test_bounded_load_loses_nothing(server, client, name):
    before = metrics(server)

    def worker(w):
        done = []
        for i in range(10):
            prompt = f"Client {w} request {i}: the quick brown fox"
            if i % 2:
                stream = client.completions.create(model=name, prompt=prompt, max_tokens=6, stream=True)
                done.append(sum(1 for c in stream if c.choices and c.choices[0].finish_reason))
            else:
                r = client.chat.completions.create(model=name, messages=user(prompt), max_tokens=6)
                done.append(int(r.choices[0].finish_reason in ("stop", "length")))
        return done

    with ThreadPoolExecutor(4) as pool:
        results = [x for done in pool.map(worker, range(4)) for x in done]
    assert results == [1] * 40
    after = metrics(server)
    assert after["umakit_requests_total"] - before["umakit_requests_total"] == 40
    assert after["umakit_requests_failed_total"] == before["umakit_requests_failed_total"]
    assert after["umakit_healthy"] == 1 and after["umakit_queue_depth"] == 0
    assert httpx.get(f"{server.url}/health").status_code == 200


def test_queue_full_gets_429_with_retry_after(tight_server, name):
    """One row and one queue slot: of 8 requests sent at once, the ones beyond those two are refused (each
    runs to its 400 tokens, so none is done before the last arrives)."""
    start = threading.Barrier(8)

    def post(_):
        start.wait()
        return raw(tight_server, "/v1/chat/completions", {"model": name,
                                                          "messages": user("Tell me everything you know"),
                                                          "max_tokens": 400, "temperature": 0}, key=None)

    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(post, range(8)))
    refused = [r for r in answers if r.status_code == 429]
    assert refused and all(r.status_code == 200 for r in answers if r.status_code != 429)
    for r in refused:
        assert_error(r, 429, code="rate_limit_exceeded")
        assert int(r.headers["retry-after"]) >= 1
    assert httpx.get(f"{tight_server.url}/health").status_code == 200
    # more choices than the queue holds would never all be queued: a 400 that says so, not a 429 for ever
    err = assert_error(raw(tight_server, "/v1/completions", {"model": name, "prompt": "a", "n": 2, "max_tokens": 2},
                           key=None), 400, param="n")
    assert "--max-queue" in err["message"]


def test_metrics_and_log(server):
    m = metrics(server)
    for name in ("requests_total", "queue_depth", "active_rows", "generated_tokens_total", "tokens_per_second",
                 "prompt_cache_hit_ratio", "prompt_cache_bytes", "achieved_gbps", "max_active_rows"):
        assert f"umakit_{name}" in m
    assert m["umakit_generated_tokens_total"] > 0 and m['umakit_http_responses_total{status="200"}'] > 0
    log = server.log.read_text()
    assert "Serving " in log and "curl " in log and "from openai import OpenAI" in log
    assert " 200 " in log and " 400 " in log and "tok/s" in log


# -- in process: the real scheduler behind the app, for failures a live server cannot be made to have ------
def test_worker_failure_is_a_500_with_the_reason_then_it_restarts(local, name, monkeypatch):
    real = local.engine.batch_decoder
    broken = {"left": 1}

    def flaky(kv_bits=None, lookup=None, mixed=None):
        decoder = real(kv_bits, lookup, mixed)
        if broken["left"]:
            broken["left"] -= 1

            def step(*_):
                raise RuntimeError("injected failure")
            decoder.step = step
        return decoder

    monkeypatch.setattr(local.engine, "batch_decoder", flaky)
    scheduler, app = served(local)
    try:
        chat = ("POST", "/v1/chat/completions", {"model": name, "messages": user("hi"), "max_tokens": 3})
        failed, = asgi_calls(app, [chat])
        err = assert_error(failed, 500)
        assert "RuntimeError" in err["message"] and err["type"] == "server_error"
        assert "injected" not in err["message"] and "log" in err["message"]  # the exception's text: the log only
        deadline = time.monotonic() + 10
        while not scheduler.healthy:  # restarted, with a decoder that works
            assert time.monotonic() < deadline, "the worker did not restart"
            time.sleep(0.05)
        ok, health, text = asgi_calls(app, [chat, ("GET", "/health", None), ("GET", "/metrics", None)])
        assert ok.status_code == 200 and ok.json()["choices"][0]["message"]["content"] is not None
        assert health.json() == {"status": "ok", "server": "umakit"}
        m = read_metrics(text.text)
        assert m["umakit_worker_restarts_total"] == 1 and m["umakit_requests_failed_total"] == 1
    finally:
        scheduler.stop()
    stopped, = asgi_calls(app, [("GET", "/health", None)])
    assert stopped.status_code == 503 and stopped.json()["status"] == "unhealthy"


def test_health_says_loading_until_the_worker_takes_requests(local):
    from umakit.serve import Scheduler, SchedulerSettings, make_app

    scheduler = Scheduler(local, SchedulerSettings(max_concurrency=2))
    app = make_app(local, scheduler)
    before, = asgi_calls(app, [("GET", "/health", None)])
    assert before.status_code == 503 and before.json()["status"] == "loading"
    scheduler.start()
    try:
        after, = asgi_calls(app, [("GET", "/health", None)])
        assert after.status_code == 200 and after.json()["status"] == "ok"
    finally:
        scheduler.stop()


def test_a_bug_of_ours_answers_500_without_its_internals(local, name, monkeypatch, caplog):
    from umakit.serve import app as app_module

    def broken(body):
        raise OSError("/home/alice/.cache/secret-path: device cuda:3 lost")

    monkeypatch.setattr(app_module, "parse_json", broken)
    scheduler, app = served(local)
    try:
        with caplog.at_level("ERROR", logger="umakit.serve"):
            failed, = asgi_calls(app, [("POST", "/v1/chat/completions", {"model": name, "messages": user("hi")})])
    finally:
        scheduler.stop()
    err = assert_error(failed, 500)
    assert "OSError" in err["message"] and "alice" not in err["message"] and "cuda" not in err["message"]
    assert "secret-path" in caplog.text  # the details: in the log, for whoever runs the server


def test_request_timeout_is_a_504(local, name):
    # greedy, and a reply that runs to its cap (checked): a sampled one may end at its first token, before
    # the worker looks at the clock
    assert local.generate("Once upon a time", raw=True, max_tokens=400, temperature=0).finish_reason == "length"
    scheduler, app = served(local, request_timeout_s=1e-3)
    try:
        r, = asgi_calls(app, [("POST", "/v1/completions", {"model": name, "prompt": "Once upon a time",
                                                            "max_tokens": 400, "temperature": 0})])
        assert_error(r, 504)
    finally:
        scheduler.stop()


@requires_default_model
@pytest.mark.parametrize("sig, returncode", [("SIGINT", 130), ("SIGTERM", -15)])
def test_a_signal_lets_the_streams_in_flight_finish_then_exits(tmp_path, sig, returncode):
    """Ctrl-C or `kill` mid-reply: no new connections, the reply streaming finishes whole, then the process
    ends as the signal says (130 and one `Interrupted.` for Ctrl-C; killed by SIGTERM for SIGTERM)."""
    import umakit

    srv = ServerProcess(umakit.resolve_model(None), ["--peak-bandwidth", PEAK], tmp_path / "log")
    try:
        srv.wait_healthy()
        name = httpx.get(f"{srv.url}/v1/models").json()["data"][0]["id"]
        # greedy counting never ends by itself: 300 tokens are still streaming when the signal lands
        payload = {"model": name, "prompt": "1, 2, 3, 4, 5, 6, 7, 8,", "max_tokens": 300, "temperature": 0,
                   "stream": True, "stream_options": {"include_usage": True}}
        chunks = []
        with httpx.stream("POST", f"{srv.url}/v1/completions", json=payload, timeout=60) as r:
            for line in r.iter_lines():
                if not line.startswith("data: "):
                    continue  # the blank line after each event: a second signal here would be a second Ctrl-C
                chunks.append(line[len("data: "):])
                if len(chunks) == 4:
                    srv.proc.send_signal(getattr(signal, sig))  # once
        assert srv.proc.wait(timeout=30) == returncode
    finally:
        srv.stop()
    assert chunks[-1] == "[DONE]"
    finish = [c["choices"][0]["finish_reason"] for c in map(json.loads, chunks[:-1]) if c["choices"]]
    assert finish[-1] == "length" and json.loads(chunks[-2])["usage"]["completion_tokens"] == 300
    log = (tmp_path / "log").read_text()
    assert "Traceback" not in log and "completion=300" in log
    assert log.strip().endswith("Interrupted.") == (sig == "SIGINT")
