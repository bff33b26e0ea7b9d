"""The one owner of the engine: continuous batching across requests, supervised.

A worker thread runs the engine's batched decoder (`Engine.batch_decoder`, the declared protocol) one step at a
time. Every active request is one row of that step, whatever its sampling settings or seed; new requests join
between steps. A prompt is prefilled into a cache of its own, a slice a step (the step budget: serve/budget.py; in
the rows' own pass where the decoder mixes), so running rows stall by one slice at most; then it joins the batch
with that cache (`BatchRow.cache`). A finished row's cache goes into the prompt cache, where the next turn of the
same conversation finds it. A request whose client went away is dropped at the next step. Requests are validated
before they get here; the HTTP layer talks to the worker only through `submit` and each request's event queue.

If the worker fails, every request in flight gets an `ErrorEvent` with the reason, `healthy` is False, and
the worker starts again with a fresh decoder.

`start` runs the worker on a thread of its own; `run` runs it in the calling thread, which `umakit serve` gives
it: its main thread, with HTTP on another. On a CPU that matters. torch's OpenMP threads wait for work by
spinning only while libgomp manages no more threads than there are cores; a team started from any thread but
the process's first is one thread too many on a machine whose cores torch uses, and its threads then sleep
between parallel regions. Waking them costs 20-50 us a region, which made a decode step there twice as slow
(11 ms against 5 on the built-in model, 2 cores).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import threading
import time
from collections import deque
from typing import Callable

from umakit.backends.base import BatchRow
from umakit.generate.stream import FINISH_STOP, DecodeRow
from umakit.serve.budget import StepBudget, measure_model
from umakit.serve.api_errors import internal
from umakit.serve.jobs import Handle, Job, NeverFits, QueueFull, kv_tokens, too_big
from umakit.serve.metrics import RecentRates
from umakit.serve.prompt_cache import PromptCache
from umakit.serve.types import ErrorEvent, FinalEvent, GenerationRequest, SchedulerSettings, TokenEvent, Usage

log = logging.getLogger("umakit.serve")
IDLE_WAIT_S, RESTART_PAUSE_S = 0.05, 0.5  # an idle worker's sleep between looks at the queue; after a failure
GIVE_UP_AFTER = 3  # failures in a row after which waiting requests are failed too
SHARE_MIN_TOKENS = 32  # a running row's cache is copied for a new request sharing at least this much prompt
RATE_WINDOW_S = 5.0  # tokens/s and GB/s in /metrics are over this many recent seconds


class Scheduler:
    def __init__(self, model, settings: SchedulerSettings | None = None):
        self.model, self.settings = model, settings or SchedulerSettings()
        self._lock = threading.Condition()
        self._waiting: deque[Job] = deque()
        self._jobs: dict[int, Job] = {}  # admitted: prefilling or decoding, by row id
        self._ids = itertools.count()
        self._thread: threading.Thread | None = None
        self._stopping = self._healthy = False
        self._ever_healthy = False  # the worker has taken requests once
        self.prompt_cache = PromptCache(self.settings.prompt_cache_bytes)
        w = model.info.weights
        self._weight_bytes = w.bytes_per_token
        self._kv_bytes = model.engine.kv_bytes_per_token(self.settings.kv_bits)
        self._peak_gbps = model.device_info.peak_bandwidth_gbps
        self._counters = dict.fromkeys(
            ("requests_total", "requests_failed_total", "requests_cancelled_total", "requests_rejected_total",
             "generated_tokens_total", "prompt_tokens_total", "cached_tokens_total", "worker_restarts_total",
             "decode_steps_total", "mixed_steps_total"), 0)
        self._max_rows = self._kv_budget = 0
        self._service_s = 1.0  # running mean of a request's time from submission to its end
        self._failures = 0  # worker failures in a row, without a request served in between
        self._bytes_read, self._rows_summed = 0.0, 0
        self._recent = RecentRates(RATE_WINDOW_S)
        self.step_budget: StepBudget | None = None  # measured when settings.step_tokens is None, then its tokens:
        self._step_tokens = self.settings.step_tokens or self.settings.prefill_chunk

    # -- the HTTP side -------------------------------------------------------------
    def start(self) -> None:
        self._stopping = False
        self._thread = threading.Thread(target=self._supervise, name="umakit-scheduler", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + 60
        while not self._healthy and self._thread.is_alive() and time.monotonic() < deadline:
            time.sleep(0.01)

    def run(self, ready: Callable[[], None] | None = None, until: Callable[[], bool] | None = None) -> None:
        """Run the worker in the calling thread until `stop` or until ``until()`` is true. ``ready()`` is called
        once, when the worker first takes requests; a worker that fails before that raises here (`start` would
        leave it unhealthy and retrying)."""
        self._stopping = False
        self._thread = threading.current_thread()
        self._supervise(ready or (lambda: None), until or (lambda: False))  # a `ready`: failing to start raises

    def stop(self) -> None:
        with self._lock:
            self._stopping = True
            self._lock.notify_all()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=10)

    @property
    def healthy(self) -> bool:
        return self._healthy and self._thread is not None and self._thread.is_alive()

    @property
    def loading(self) -> bool:
        """The worker has not taken requests yet (warming up, measuring its step budget)."""
        return not self._ever_healthy

    def check_room(self) -> None:
        """`QueueFull` now if a request would be refused for want of room: checked before a request's template is
        rendered and its prompt tokenized, so a full server does no work for it (`submit` checks again)."""
        with self._lock:
            self._refuse_if_full()

    def _refuse_if_full(self) -> None:  # with the lock held
        if len(self._waiting) >= self.settings.max_queue:
            self._counters["requests_rejected_total"] += 1
            raise QueueFull(f"{len(self._waiting)} requests are waiting already; try again shortly",
                            retry_after_s=self._retry_after())

    def submit(self, request: GenerationRequest, loop: asyncio.AbstractEventLoop, queue=None) -> Handle:
        """Queue ``request``, its events for ``queue`` (default: the handle's own); `QueueFull` when too many wait,
        `NeverFits` when its KV cache alone exceeds what this machine can give a row (it would wait for ever)."""
        with self._lock:
            if self._kv_budget and self._never_fits(request):
                self._counters["requests_rejected_total"] += 1
                raise NeverFits(too_big(request, self._kv_bytes, self._kv_budget))
            self._refuse_if_full()
            if request.timeout_s is None:
                request.timeout_s = self.settings.request_timeout_s
            handle = Handle(request.id or f"req-{next(self._ids)}", loop, self._notify, queue)
            self._waiting.append(Job(handle, request, time.perf_counter()))
            self._counters["requests_total"] += 1
            self._lock.notify_all()
        return handle

    def _retry_after(self) -> float:
        """Seconds until a queue slot is likely free: the queue's share of the rows, at the recent request time."""
        return max(1.0, round(self._service_s * len(self._waiting) / self.settings.max_concurrency, 1))

    def _notify(self) -> None:
        with self._lock:
            self._lock.notify_all()

    def metrics(self) -> dict[str, float]:
        with self._lock:
            tokens, read = self._recent.rates(time.perf_counter())
            decoding = sum(1 for j in self._jobs.values() if j.cache is None)
            return {
                **{k: float(v) for k, v in self._counters.items()},
                "queue_depth": float(len(self._waiting)),
                "active_rows": float(decoding),
                "prefilling_requests": float(len(self._jobs) - decoding),
                "max_active_rows": float(self._max_rows),
                "step_tokens": float(self._step_tokens),
                "tokens_per_second": tokens, "achieved_gbps": read / 1e9,
                "peak_gbps": self._peak_gbps,
                "prompt_cache_hit_ratio": self.prompt_cache.hit_ratio,
                "prompt_cache_bytes": float(self.prompt_cache.bytes),
                "prompt_cache_entries": float(len(self.prompt_cache)),
                "healthy": float(self.healthy),
            }

    # -- the worker ------------------------------------------------------------------
    def _supervise(self, ready: Callable[[], None] | None = None, until: Callable[[], bool] = lambda: False) -> None:
        while not self._stopping and not until():
            try:
                self._run(ready, until)
            except Exception as e:  # the worker must never die silently: fail what is in flight, start again
                if ready is not None and not self._ever_healthy:
                    raise
                log.exception("the generation worker failed")
                reason = internal(e, what="the generation worker failed")
                self._healthy = False
                self._counters["worker_restarts_total"] += 1
                self._failures += 1
                with self._lock:
                    failed = list(self._jobs.values())
                    self._jobs.clear()
                    if self._failures >= GIVE_UP_AFTER:  # it keeps failing: do not leave the queue hanging
                        failed += list(self._waiting)
                        self._waiting.clear()
                self.prompt_cache.clear()  # caches of a failed engine state are not to be trusted
                for job in failed:
                    self._counters["requests_failed_total"] += 1
                    job.handle.put(ErrorEvent(reason, 500))
                time.sleep(RESTART_PAUSE_S)

    def _run(self, ready: Callable[[], None] | None, until: Callable[[], bool]) -> None:
        with self.model.engine.wired():  # the wiring `generate` runs under, held by the worker itself
            self._serve(ready, until)

    def _serve(self, ready: Callable[[], None] | None, until: Callable[[], bool]) -> None:
        decoder = self.model.engine.batch_decoder(self.settings.kv_bits, self.settings.lookup,
                                                  self.settings.mixed_steps)
        self._slice, self._joining = None, []  # the next step's prompt slice and cache; the rows whose prompts it ends
        self._kv_budget = decoder.kv_budget_bytes()
        if self.settings.step_tokens is None and self.step_budget is None:
            self.step_budget = b = measure_model(self.model, self.settings.kv_bits, self.settings.prefill_chunk)
            self._step_tokens = b.tokens
            log.info("prefill: %s", b.describe())
        self._healthy = True
        if not self._ever_healthy:
            self._ever_healthy = True
            if ready is not None:
                ready()
        while not self._stopping and not until():
            self._drop_gone(decoder)
            self._admit()
            did = self._prefill(decoder)
            if decoder.size:
                self._step(decoder)
            elif not did:
                with self._lock:
                    if not self._waiting and not self._stopping and not self._jobs:
                        self._lock.wait(IDLE_WAIT_S)

    def _drop_gone(self, decoder) -> None:
        """Drop requests whose client went away or whose time ran out."""
        now = time.perf_counter()
        with self._lock:
            gone = [(i, j) for i, j in self._jobs.items()
                    if j.handle.cancelled or (j.deadline is not None and now > j.deadline)]
            waiting = [j for j in self._waiting if j.handle.cancelled or (j.deadline is not None and now > j.deadline)]
            for j in waiting:
                self._waiting.remove(j)
            for i, _ in gone:
                del self._jobs[i]
        in_batch = [i for i, j in gone if j.cache is None]
        if self.prompt_cache.max_bytes:
            # a reply its client stopped (a chat's Ctrl-C) is often followed by the same conversation, cut reply
            # included: what was computed of it is kept, as for a reply that ended
            for i, j in gone:
                if j.cache is None and j.handle.cancelled:
                    self.prompt_cache.put(list(j.request.prompt) + j.generated, decoder.export(i),
                                          j.request.cache_salt)
        if in_batch:
            decoder.remove(in_batch)
        for _, j in gone + [(None, j) for j in waiting]:
            if j.handle.cancelled:
                self._counters["requests_cancelled_total"] += 1
            else:
                self._counters["requests_failed_total"] += 1
                j.handle.put(ErrorEvent(f"the request took longer than {j.request.timeout_s:g} s", 504, "timeout"))

    def _admit(self) -> None:
        """Move waiting requests in while rows and KV memory are free, each with the longest cached prefix."""
        while True:
            with self._lock:
                if not self._waiting or len(self._jobs) >= self.settings.max_concurrency:
                    return
                job = self._waiting[0]
                if not self._fits(job):
                    if self._jobs and not self._never_fits(job.request):
                        return  # wait for a row to finish
                    self._waiting.popleft()
                    self._counters["requests_failed_total"] += 1
                    reason = too_big(job.request, self._kv_bytes, self._kv_budget)
                    job.handle.put(ErrorEvent(reason, 400, "kv_cache_exceeded"))
                    continue
                self._waiting.popleft()
            prompt = job.request.prompt
            # (a prompt to score is run from its start: its cached part would go unscored)
            cache, n = self.prompt_cache.take(prompt, job.request.cache_salt) if job.scores is None else (None, 0)
            job.cache = cache if cache is not None else self.model.engine.make_cache(self.settings.kv_bits)
            job.prefilled = job.cached_tokens = n
            job.row = DecodeRow(self.model.tokenizer, job.request.max_tokens, job.request.stop,
                                prompt_tokens=len(prompt) - n, cached_tokens=n, t_start=job.submitted)
            with self._lock:
                self._jobs[next(self._ids)] = job

    def _never_fits(self, request: GenerationRequest) -> bool:
        return kv_tokens(request) * self._kv_bytes > self._kv_budget

    def _fits(self, job: Job) -> bool:
        """Whether one more row fits the KV budget: a batch cache pads every row to the longest one."""
        longest = max(kv_tokens(j.request) for j in [*self._jobs.values(), job])
        need = (len(self._jobs) + 1) * longest * self._kv_bytes
        if need + self.prompt_cache.bytes > self._kv_budget:
            self.prompt_cache.clear()  # stored caches give way to running requests
        return need <= self._kv_budget

    def _prefill(self, decoder) -> bool:
        """Prefill the oldest waiting prompts: while rows decode, one pass of at most the step budget (so none waits
        on more than one pass between two of its tokens; `SchedulerSettings.step_tokens`, or measured), else a
        `prefill_chunk`. A prompt done prefilling joins the batch."""
        budget = self._step_tokens if decoder.size else self.settings.prefill_chunk
        did = passed = False
        while budget > 0 and not (passed and decoder.size):
            with self._lock:
                pending = [(i, j) for i, j in self._jobs.items() if j.cache is not None]
            if not pending:
                return did
            row_id, job = min(pending, key=lambda p: p[1].submitted)
            prompt = job.request.prompt
            if job.prefilled == job.cached_tokens and job.scores is None:  # a running row may hold more of it
                self._share(decoder, job)
            end = min(job.prefilled + budget, len(prompt) - 1)
            if end > job.prefilled:
                budget, passed = budget - (end - job.prefilled), True
                if decoder.size and decoder.mixes and job.scores is None:  # in the rows' next step, their pass
                    self._slice, job.prefilled = (prompt[job.prefilled:end], job.cache), end
                else:
                    job.prefill(self.model.engine, end)
            did = True
            if job.prefilled >= len(prompt) - 1:
                if self._slice is not None and self._slice[1] is job.cache:
                    self._joining.append(row_id)  # once the step has prefilled its last slice
                else:
                    self._join(decoder, row_id, job)
                budget = min(budget, self._step_tokens)  # rows are decoding now
        return did

    def _join(self, decoder, row_id: int, job: Job) -> None:
        r = job.request
        if not r.max_tokens:  # a prompt scored, nothing to generate (a completion's echo with max_tokens 0)
            with self._lock:
                del self._jobs[row_id]
            self._counters["prompt_tokens_total"] += len(r.prompt)
            job.handle.put(FinalEvent("length", Usage(len(r.prompt), 0), "", None, job.scores))
            return
        decoder.add([BatchRow(row_id, r.prompt, r.sampling, r.seed, cache=job.cache, logprobs=r.logprobs,
                              constraint=r.constraint)])
        job.cache = None
        job.start = (time.perf_counter(), self._bytes_read, self._counters["decode_steps_total"], self._rows_summed)

    def _share(self, decoder, job: Job) -> None:
        """Start ``job`` from the cache of a row in the batch whose prompt shares more of its own than ``job``
        holds (at least `SHARE_MIN_TOKENS`): requests sent together with one long system prompt prefill it once,
        before any of them has finished and left it in the prompt cache."""
        with self._lock:
            rows = [(i, j.request.prompt) for i, j in self._jobs.items()
                    if j.cache is None and j.request.cache_salt == job.request.cache_salt]
        job.start_from(decoder, rows, SHARE_MIN_TOKENS)

    def _step(self, decoder) -> None:
        out = decoder.step(self._slice)
        self._counters["mixed_steps_total"] += self._slice is not None
        probs = decoder.logprobs() if any(j.request.logprobs is not None for j in self._jobs.values()) else {}
        now = time.perf_counter()
        rows = decoder.size
        read = self._weight_bytes + rows * decoder.context_tokens() * self._kv_bytes
        with self._lock:
            self._counters["decode_steps_total"] += 1
            self._counters["generated_tokens_total"] += len(out)
            self._bytes_read += read
            self._rows_summed += rows
            self._max_rows = max(self._max_rows, rows)
            self._recent.add(now, len(out), read)
        finished = []
        for row_id, token in out:  # a speculating row's several, in order
            job = self._jobs.get(row_id)
            if job is None or job.row.finished:
                continue
            job.generated.append(token)
            text = job.row.feed(token, now)
            if job.row.finish != FINISH_STOP:
                lp = probs.get(row_id)
                job.handle.put(TokenEvent(text, token, *(lp if lp is not None else (None, None))))
            if job.row.finished:
                finished.append(row_id)
        for row_id in finished:
            self._finish(decoder, row_id, now)
        for row_id in self._joining:  # their last slices prefilled by this step
            self._join(decoder, row_id, self._jobs[row_id])
        self._slice, self._joining = None, []

    def _finish(self, decoder, row_id: int, now: float) -> None:
        job = self._jobs[row_id]
        cache = decoder.export(row_id) if self.prompt_cache.max_bytes else None  # no copy when nothing is kept
        decoder.remove([row_id])
        with self._lock:
            del self._jobs[row_id]
        if cache is not None:
            self.prompt_cache.put(list(job.request.prompt) + job.generated, cache, job.request.cache_salt)
        tail = job.row.close()
        s = job.row.stats()
        t, b, steps, rows = job.start
        span = now - t
        achieved = (self._bytes_read - b) / span / 1e9 if span > 0 else 0.0
        n_steps = self._counters["decode_steps_total"] - steps
        usage = Usage(
            prompt_tokens=len(job.request.prompt), completion_tokens=s.generated_tokens,
            cached_tokens=job.cached_tokens, ttft_s=s.ttft_s, decode_tps=s.decode_tps, achieved_gbps=achieved,
            peak_gbps=self._peak_gbps, mbu=achieved / self._peak_gbps if self._peak_gbps else 0.0,
            batch_rows=(self._rows_summed - rows) / n_steps if n_steps else 0.0,
        )
        self._counters["prompt_tokens_total"] += len(job.request.prompt)
        self._counters["cached_tokens_total"] += job.cached_tokens
        finish = "stop" if job.row.finish in ("stop", "stop_string") else "length"
        job.handle.put(FinalEvent(finish, usage, tail, job.row.stops.matched, job.scores))
        self._service_s = 0.8 * self._service_s + 0.2 * (now - job.submitted)
        self._failures = 0
