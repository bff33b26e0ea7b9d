"""The serving scheduler in-process: continuous batching, chunked prefill, prompt cache, cancellation, failures."""

from __future__ import annotations

import asyncio
import time

import pytest

import umakit
from umakit.generate.sampling import SamplingParams
from umakit.serve.jobs import QueueFull
from umakit.serve.scheduler import Scheduler
from umakit.serve.types import ErrorEvent, FinalEvent, GenerationRequest, SchedulerSettings, TokenEvent

GREEDY = SamplingParams(temperature=0)
PROMPTS = ["The quick brown fox", "Paris is the capital of", "Unified memory lets the GPU read",
           "The lazy dog", "fox", "The quick brown fox jumps over the lazy dog. Paris is"]


@pytest.fixture(scope="module", params=["torch", "mlx"])
def model(request, tiny_dir):
    # MLX pinned to its CPU kernels: exact batched-vs-single equality is not promised on Metal.
    return umakit.load(tiny_dir("llama"), backend=request.param, dtype="float32",
                       device="cpu" if request.param == "mlx" else None)


@pytest.fixture
def loop():
    loop = asyncio.new_event_loop()
    yield loop
    loop.close()


def run_all(loop, handles, timeout=60):
    async def collect(h):
        events = []
        while True:
            e = await asyncio.wait_for(h.queue.get(), timeout)
            events.append(e)
            if isinstance(e, (FinalEvent, ErrorEvent)):
                return events

    async def all_of():
        return await asyncio.gather(*(collect(h) for h in handles))

    return loop.run_until_complete(all_of())


def text_and_tokens(events):
    tokens = [e.token for e in events if isinstance(e, TokenEvent)]
    final = events[-1]
    return "".join(e.text for e in events if isinstance(e, TokenEvent)) + final.text, tokens, final


def request(model, prompt, n, **kw):
    return GenerationRequest(model.encode(prompt, raw=True), n, kw.pop("sampling", GREEDY), **kw)


def test_concurrent_requests_decode_together_and_each_gets_its_lone_tokens(model, loop):
    s = Scheduler(model, SchedulerSettings(max_concurrency=8, prefill_chunk=4))  # chunks shorter than the prompts
    s.start()
    try:
        lengths = [12, 5, 20, 9, 16, 7]
        handles = [s.submit(request(model, p, n), loop) for p, n in zip(PROMPTS, lengths)]
        results = run_all(loop, handles)
        m = s.metrics()
    finally:
        s.stop()
    for prompt, n, events in zip(PROMPTS, lengths, results):
        text, tokens, final = text_and_tokens(events)
        want = model.generate(prompt, raw=True, max_tokens=n, temperature=0)
        assert (text, tokens) == (want.text, want.tokens)
        assert final.usage.completion_tokens == len(want.tokens)
        assert final.finish_reason == ("stop" if want.finish_reason == "stop" else "length")
    assert m["max_active_rows"] > 1 and m["active_rows"] == 0
    emitted = sum(len(text_and_tokens(r)[1]) for r in results)
    assert m["requests_total"] == len(PROMPTS) and m["generated_tokens_total"] >= emitted


def test_mixed_steps_carry_the_prompt_slices_and_each_request_gets_its_lone_tokens(model, loop):
    """`--mixed-steps`: prompts that arrive while a row decodes ride in its steps' own passes, a slice a step (the
    tiny float model's rows keep their lone tokens there); an engine without the feature refuses it at start."""
    settings = SchedulerSettings(max_concurrency=8, prefill_chunk=4, step_tokens=3, mixed_steps=True)
    if model.engine.name != "torch":
        looks = iter([False])
        with pytest.raises(Exception, match="--mixed-steps"):
            Scheduler(model, settings).run(until=lambda: next(looks, True))
        return
    s = Scheduler(model, settings)
    s.start()
    try:
        lengths = [60, 12, 5, 20, 9, 16]
        first = s.submit(request(model, PROMPTS[0], lengths[0]), loop)
        opened = loop.run_until_complete(asyncio.wait_for(first.queue.get(), 60))  # it decodes from here on
        handles = [first] + [s.submit(request(model, p, n), loop) for p, n in zip(PROMPTS[1:], lengths[1:])]
        results = run_all(loop, handles)
        results[0].insert(0, opened)
        m = s.metrics()
    finally:
        s.stop()
    for prompt, n, events in zip(PROMPTS, lengths, results):
        want = model.generate(prompt, raw=True, max_tokens=n, temperature=0)
        assert text_and_tokens(events)[:2] == (want.text, want.tokens)
    assert m["mixed_steps_total"] > 0 and m["requests_total"] == len(PROMPTS)


def test_the_next_turn_finds_the_previous_cache(model, loop):
    s = Scheduler(model, SchedulerSettings())
    s.start()
    try:
        first = request(model, PROMPTS[0], 10)
        (events,) = run_all(loop, [s.submit(first, loop)])
        _, tokens, final = text_and_tokens(events)
        assert final.usage.cached_tokens == 0
        follow = first.prompt + tokens + model.encode(" and then", raw=True)
        (events,) = run_all(loop, [s.submit(GenerationRequest(follow, 8, GREEDY), loop)])
        _, again, final = text_and_tokens(events)
        assert final.usage.cached_tokens >= len(first.prompt) + len(tokens) - 1
        stream = model.engine.generate_tokens(follow, model.make_cache(), GREEDY)
        assert again == [next(stream) for _ in range(len(again))]
        assert s.metrics()["prompt_cache_hit_ratio"] > 0
    finally:
        s.stop()


def test_requests_sharing_a_system_prompt_prefill_it_once(model, loop):
    """Four requests sent together after one long shared header, then four more: the first prefills the header;
    the other three copy it from its row in the batch, the next four from the prompt cache (an entry that stays);
    every reply is still its lone greedy run's."""
    header = model.encode("You are a careful assistant. " * 12, raw=True)  # far over SHARE_MIN_TOKENS
    prompts = [header + model.encode(q, raw=True) for q in PROMPTS[:4]]
    s = Scheduler(model, SchedulerSettings(max_concurrency=8, step_tokens=8))
    s.start()
    try:
        first = run_all(loop, [s.submit(GenerationRequest(p, 6, GREEDY), loop) for p in prompts])
        after_first = s.metrics()["cached_tokens_total"]
        second = run_all(loop, [s.submit(GenerationRequest(p[:-1] + [5], 6, GREEDY), loop) for p in prompts])
        total = s.metrics()["cached_tokens_total"]
    finally:
        s.stop()
    assert [text_and_tokens(r)[2].usage.cached_tokens >= len(header) for r in first] == [False, True, True, True]
    assert after_first >= 3 * len(header)
    assert all(text_and_tokens(r)[2].usage.cached_tokens >= len(header) for r in second)
    assert total - after_first >= 4 * len(header)
    for p, events in zip(prompts, first):
        stream = model.engine.generate_tokens(p, model.make_cache(), GREEDY)
        assert text_and_tokens(events)[1] == [next(stream) for _ in range(6)]


def test_a_scored_prompt_gets_each_tokens_logprob_beside_rows_and_the_same_reply(model, loop):
    """A request that asks for its prompt's logprobs (a completion's echo) is scored slice by slice while other
    rows decode (mixed steps or not), never from the prompt cache or another row's cache: every score is the
    model's over the whole prompt, its top-n the most likely, and its reply still its lone greedy run's."""
    import numpy as np

    from umakit.generate.scoring import token_scores

    ids = model.encode(PROMPTS[5], raw=True)
    want = token_scores(model.engine.logits(ids), ids[1:], 3)
    s = Scheduler(model, SchedulerSettings(max_concurrency=4, step_tokens=4))
    s.start()
    try:
        run_all(loop, [s.submit(GenerationRequest(ids, 3, GREEDY), loop)])  # the prompt, in the prompt cache
        others = [s.submit(request(model, p, 12), loop) for p in PROMPTS[:2]]
        scored = s.submit(GenerationRequest(ids, 5, GREEDY, prompt_logprobs=3), loop)
        *_, events = run_all(loop, [*others, scored])
    finally:
        s.stop()
    text, tokens, final = text_and_tokens(events)
    assert final.usage.cached_tokens == 0 and [e.token for e in final.prompt_scores] == ids
    assert final.prompt_scores[0].logprob is None
    got = [e.logprob for e in final.prompt_scores[1:]]
    assert np.allclose(got, [lp for lp, _ in want], atol=2e-4)
    assert [[t for t, _ in e.top_logprobs] for e in final.prompt_scores[1:]] == [[t for t, _ in top] for _, top in want]
    assert tokens == model.generate(PROMPTS[5], raw=True, max_tokens=5, temperature=0).tokens


def test_a_request_that_can_never_fit_is_refused_at_once_and_blocks_nobody(model, loop, monkeypatch):
    """Room for about 100 tokens of KV cache: a request for 1,000 is refused when submitted (never queued, even
    behind a running one), and requests that fit go on."""
    from umakit.serve.jobs import NeverFits

    budget = 100 * model.engine.kv_bytes_per_token()
    decoder = type(model.engine.batch_decoder())
    monkeypatch.setattr(decoder, "kv_budget_bytes", lambda self: budget)
    s = Scheduler(model, SchedulerSettings(max_concurrency=4))
    s.start()
    try:
        running = s.submit(request(model, PROMPTS[0], 20), loop)
        with pytest.raises(NeverFits, match="ask for fewer max_tokens"):
            s.submit(request(model, PROMPTS[1], 1000), loop)
        after = s.submit(request(model, PROMPTS[2], 8), loop)
        results = run_all(loop, [running, after])
    finally:
        s.stop()
    assert all(isinstance(r[-1], FinalEvent) for r in results)
    assert s.metrics()["requests_rejected_total"] == 1


def test_a_cancelled_request_frees_its_row_and_others_finish(model, loop):
    s = Scheduler(model, SchedulerSettings())
    s.start()
    try:
        long = s.submit(request(model, PROMPTS[2], 400), loop)
        short = s.submit(request(model, PROMPTS[1], 6), loop)

        async def cancel_after_first_token():
            await long.queue.get()
            long.cancel()

        loop.run_until_complete(cancel_after_first_token())
        (events,) = run_all(loop, [short])
        assert isinstance(events[-1], FinalEvent)
        for _ in range(100):
            if s.metrics()["active_rows"] == 0:
                break
            loop.run_until_complete(asyncio.sleep(0.02))
        m = s.metrics()
        assert m["active_rows"] == 0 and m["requests_cancelled_total"] == 1
    finally:
        s.stop()


def test_a_handler_that_falls_behind_gets_a_408_and_its_row_is_freed(model, loop, monkeypatch):
    """The events a handler has not taken are bounded: past the bound, one 408 and the request stops."""
    from umakit.serve.jobs import Handle

    monkeypatch.setattr(Handle, "MAX_PENDING", 8)
    s = Scheduler(model, SchedulerSettings())
    s.start()
    try:
        unread = s.submit(request(model, PROMPTS[2], 200), loop)  # nobody takes its events while it runs
        for _ in range(250):
            if s.metrics()["active_rows"] == 0 and unread.cancelled:
                break
            loop.run_until_complete(asyncio.sleep(0.02))
        assert unread.cancelled and s.metrics()["active_rows"] == 0
        events = [loop.run_until_complete(unread.get()) for _ in range(unread.queue.qsize())]
        assert len(events) == 9 and all(isinstance(e, TokenEvent) for e in events[:8])
        assert isinstance(events[-1], ErrorEvent) and events[-1].status == 408
        (other,) = run_all(loop, [s.submit(request(model, PROMPTS[1], 6), loop)])
        assert isinstance(other[-1], FinalEvent)
    finally:
        s.stop()


def test_a_failing_worker_fails_requests_with_the_reason_and_restarts(model, loop, monkeypatch):
    s = Scheduler(model, SchedulerSettings())
    real = type(model.engine).batch_decoder
    calls = {"n": 0}

    def flaky(engine, kv_bits=None, lookup=None, mixed=None):
        decoder = real(engine, kv_bits, lookup, mixed)
        calls["n"] += 1
        if calls["n"] == 1:
            def boom(*_):
                raise RuntimeError("injected step failure")
            decoder.step = boom
        return decoder

    monkeypatch.setattr(type(model.engine), "batch_decoder", flaky)
    s.start()
    try:
        (events,) = run_all(loop, [s.submit(request(model, PROMPTS[0], 5), loop)])
        assert isinstance(events[-1], ErrorEvent) and events[-1].status == 500
        assert "RuntimeError" in events[-1].message and "injected" not in events[-1].message  # its text: the log only
        for _ in range(200):
            if s.healthy:
                break
            loop.run_until_complete(asyncio.sleep(0.02))
        assert s.healthy and s.metrics()["worker_restarts_total"] == 1
        (events,) = run_all(loop, [s.submit(request(model, PROMPTS[0], 5), loop)])
        assert isinstance(events[-1], FinalEvent)
    finally:
        s.stop()


def test_a_full_queue_refuses_with_a_retry_hint(model, loop):
    s = Scheduler(model, SchedulerSettings(max_queue=1))  # not started: nothing leaves the queue
    s.submit(request(model, PROMPTS[0], 4), loop)
    with pytest.raises(QueueFull) as e:
        s.submit(request(model, PROMPTS[1], 4), loop)
    assert e.value.retry_after_s > 0


def test_a_request_past_its_timeout_gets_504(model, loop):
    s = Scheduler(model, SchedulerSettings())
    s.start()
    try:
        (events,) = run_all(loop, [s.submit(request(model, PROMPTS[0], 400, timeout_s=1e-4), loop)])
        assert isinstance(events[-1], ErrorEvent) and events[-1].status == 504
    finally:
        s.stop()


def test_sampled_requests_with_their_own_settings_share_steps(model, loop):
    s = Scheduler(model, SchedulerSettings())
    s.start()
    try:
        hot = SamplingParams(temperature=0.9, top_k=20)
        reqs = [request(model, PROMPTS[0], 12, sampling=hot, seed=7), request(model, PROMPTS[0], 12, sampling=hot,
                                                                              seed=7),
                request(model, PROMPTS[1], 12)]
        results = run_all(loop, [s.submit(r, loop) for r in reqs])
    finally:
        s.stop()
    a, b, c = (text_and_tokens(r)[1] for r in results)
    assert a == b  # the same seed, the same tokens, whatever else runs in the batch
    assert c == model.generate(PROMPTS[1], raw=True, max_tokens=12, temperature=0).tokens


def test_run_serves_in_the_calling_thread_until_told(model, monkeypatch):
    """`run` (what `umakit serve` uses): the worker in this thread, requests from another one."""
    import threading

    s = Scheduler(model, SchedulerSettings())
    real = type(model.engine).batch_decoder
    stepped_in, ready, results = set(), [], []

    def spying(engine, kv_bits=None, lookup=None, mixed=None):
        decoder = real(engine, kv_bits, lookup, mixed)
        step = decoder.step
        decoder.step = lambda *slice: stepped_in.add(threading.current_thread()) or step(*slice)
        return decoder

    def client():
        other = asyncio.new_event_loop()
        try:
            results.append(run_all(other, [s.submit(request(model, PROMPTS[1], 6), other)]))
        finally:
            other.close()

    thread = threading.Thread(target=client)
    monkeypatch.setattr(type(model.engine), "batch_decoder", spying)
    deadline = time.monotonic() + 60  # bounded, whatever goes wrong
    s.run(ready=lambda: ready.append(s.healthy) or thread.start(),
          until=lambda: (ready and not thread.is_alive()) or time.monotonic() > deadline)
    thread.join(timeout=60)
    assert ready == [True]  # called once, with the worker taking requests
    (events,) = results[0]
    text, tokens, _ = text_and_tokens(events)
    want = model.generate(PROMPTS[1], raw=True, max_tokens=6, temperature=0)
    assert (text, tokens) == (want.text, want.tokens)
    assert stepped_in == {threading.current_thread()}


def test_run_raises_when_the_worker_cannot_start(model, monkeypatch):
    def broken(engine, kv_bits=None, lookup=None, mixed=None):
        raise RuntimeError("no decoder today")

    monkeypatch.setattr(type(model.engine), "batch_decoder", broken)
    ready = []
    with pytest.raises(RuntimeError, match="no decoder today"):
        Scheduler(model, SchedulerSettings()).run(ready=lambda: ready.append(1))
    assert ready == []


@pytest.fixture(scope="module", params=["mlx-qwen3_next", "transformers-qwen3_next", "transformers-gemma4"])
def unrewindable(request, tmp_path_factory):
    """Models whose cache cannot be trimmed: a hybrid's recurrent state (qwen3_next, on MLX and on transformers),
    sliding windows past their size (gemma4)."""
    backend, family = request.param.split("-")
    path = tmp_path_factory.mktemp(family) / "model"
    if backend == "mlx":
        from support.mlx_models import make
    else:
        from engines.test_transformers_engine import make
    return umakit.load(make(family, path), backend=backend, dtype="float32")


def test_the_next_turn_extends_an_untrimmable_cache_whole(unrewindable, loop):
    """The prompt cache keeps such a cache for a prompt that extends it whole (a conversation's next turn), and
    gives none to one that shares only a part (which would need trimming)."""
    model = unrewindable
    s = Scheduler(model, SchedulerSettings())
    s.start()
    try:
        first = GenerationRequest([(7 * i) % 400 + 3 for i in range(24)], 10, GREEDY)
        (events,) = run_all(loop, [s.submit(first, loop)])
        _, tokens, _ = text_and_tokens(events)
        follow = first.prompt + tokens + [33, 44, 55]
        (events,) = run_all(loop, [s.submit(GenerationRequest(follow, 8, GREEDY), loop)])
        _, again, final = text_and_tokens(events)
        assert final.usage.cached_tokens >= len(first.prompt) + len(tokens) - 1
        stream = model.engine.generate_tokens(follow, model.make_cache(), GREEDY)
        assert again == [next(stream) for _ in range(len(again))]
        part = follow[:20] + [66, 77, 88]  # shares a part only
        (events,) = run_all(loop, [s.submit(GenerationRequest(part, 4, GREEDY), loop)])
        _, other, final = text_and_tokens(events)
        assert final.usage.cached_tokens == 0
        stream = model.engine.generate_tokens(part, model.make_cache(), GREEDY)
        assert other == [next(stream) for _ in range(len(other))]
    finally:
        s.stop()
