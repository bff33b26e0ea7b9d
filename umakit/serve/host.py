"""The models a server answers for: one fixed at start-up (`OneModel`), or many loaded by name (`ModelHost`).

The HTTP layer asks for a model by the name in the request (`acquire`), runs
the request on that model's scheduler, and gives it back when the request
ends (`release`). `OneModel` is `umakit serve MODEL`: the model is loaded
before the port opens and any other name is a 404.

`ModelHost` is `umakit serve` with no model, several, or ``--models``: a
request may name anything `umakit.load` takes (a directory, a .gguf, a Hub
id, the built-in model's name). The first request for a model loads it, on
a thread of its own that then runs its scheduler, so models decode at the
same time, each batching its own rows; requests for a model that is loading
wait for it (bounded by the request timeout). Before a load the host counts
the model's bytes (its files; once loaded, what the engine holds) against
its memory budget, and unloads the least recently used idle models until it
fits; a model with a request in flight is never unloaded, and a model that
cannot fit even alone is refused with a 400 that says how much it needs and
how much there is. A model idle for its keep-alive is unloaded: its worker
stops, its arrays are dropped, and the allocator's cached memory is handed
back (`umakit.backends.release_memory`).
"""

from __future__ import annotations

import asyncio
import contextlib
import difflib
import gc
import logging
import math
import re
import threading
import time
import weakref
from dataclasses import dataclass, field
from typing import Callable

from umakit.errors import UmakitError
from umakit.serve.api_errors import APIError, internal
from umakit.serve.types import SchedulerSettings

log = logging.getLogger("umakit.serve")
DEFAULT_KEEP_ALIVE_S = 300.0  # Ollama's 5 minutes
REAP_EVERY_S = 0.5
RELEASE_WAIT_S = 60.0  # an unloaded model still referenced this long: its memory is handed back anyway
_DURATION = re.compile(r"(\d+(?:\.\d+)?)(ms|s|m|h)")
_UNITS = {"ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}


def parse_keep_alive(value) -> float:
    """Seconds a model stays loaded after its last request: a number of seconds or a duration as Ollama takes it
    ("5m", "1h30m", "10s", "0"); negative means forever (`math.inf`)."""
    bad = UmakitError(f"keep_alive must be a number of seconds or a duration such as 5m, 30s or -1, got {value!r}")
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise bad
    if isinstance(value, str):
        text = value.strip()
        try:
            return parse_keep_alive(float(text))
        except ValueError:
            pass
        sign, text = (-1.0, text[1:]) if text.startswith("-") else (1.0, text)
        parts = _DURATION.findall(text)
        if not text or "".join(n + u for n, u in parts) != text:
            raise bad from None
        value = sign * sum(float(n) * _UNITS[u] for n, u in parts)
    if not math.isfinite(value):
        raise bad
    return math.inf if value < 0 else float(value)


@dataclass
class Lease:
    """A model held for one request."""

    name: str  # as the request named it
    model: object
    scheduler: object
    slot: object = None


class OneModel:
    """`umakit serve MODEL`: one model, loaded before the server starts, never unloaded."""

    def __init__(self, model, scheduler):
        self.model, self.scheduler = model, scheduler
        self.name = model.info.name
        self.created = int(time.time())

    @property
    def healthy(self) -> bool:
        return self.scheduler.healthy

    @property
    def loading(self) -> bool:
        return self.scheduler.loading

    async def acquire(self, name: str, timeout_s: float | None = None) -> Lease:
        if name != self.name:
            raise APIError(404, f"the model '{name}' does not exist; this server serves '{self.name}'",
                           param="model")
        return Lease(name, self.model, self.scheduler)

    def release(self, lease: Lease, keep_alive: float | None = None) -> None:
        pass

    def cards(self) -> list[dict]:
        return [{"id": self.name, "loaded": True, "bytes": self.model.info.weights.total_bytes,
                 "unloads_in_s": None}]

    def metrics(self) -> tuple[dict[str, float], list[tuple[str, dict[str, float]]]]:
        return self.scheduler.metrics(), []


@dataclass
class Slot:
    """One model the host knows: its state, and while loaded its model and scheduler."""

    name: str
    state: str = "unloaded"  # unloaded | loading | ready | failed
    model: object = None
    scheduler: object = None
    error: str | None = None
    bytes: int = 0  # its files before a load, what the engine holds after
    active: int = 0  # requests holding it
    last_used: float = 0.0
    keep_alive_s: float = DEFAULT_KEEP_ALIVE_S  # math.inf: never unloaded for being idle
    loads: int = 0
    thread: threading.Thread | None = None
    ready: threading.Event = field(default_factory=threading.Event)
    stopping: bool = False


class ModelHost:
    """Many models by name, within a memory budget (see the module's docstring).

    ``load(name)`` loads a model (`umakit.load` with the server's engine options); ``size(name)`` gives its
    bytes before loading, raising for a name no model answers to; ``release_memory(device)`` hands an
    unloaded model's cached memory back; ``available()`` names the models on this machine, which the host lists
    beside those it has loaded (a client picks from the list before any is loaded).
    """

    def __init__(self, load: Callable, size: Callable[[str], int], settings: SchedulerSettings, *,
                 budget_bytes: int, keep_alive_s: float = DEFAULT_KEEP_ALIVE_S,
                 release_memory: Callable[[str], None] = lambda device: None,
                 available: Callable[[], list[str]] = list):
        self._load, self._size, self._release_memory = load, size, release_memory
        self._available = available
        self.settings, self.budget_bytes, self.keep_alive_s = settings, budget_bytes, keep_alive_s
        self._slots: dict[str, Slot] = {}
        self._lock = threading.RLock()
        self._closed = False
        # (the unloaded model, its device, when): memory to hand back once the model is gone (None: gone already)
        self._unloaded: list[tuple[weakref.ref | None, str, float]] = []
        self.created = int(time.time())
        self._reaper = threading.Thread(target=self._reap, name="umakit-keep-alive", daemon=True)
        self._reaper.start()

    @property
    def healthy(self) -> bool:
        return not self._closed

    loading = False  # models load on demand, each request waiting for its own

    # -- requests ------------------------------------------------------------------------------------
    async def acquire(self, name: str, timeout_s: float | None = None) -> Lease:
        """The model ``name``, loaded (waiting for its load, started here if need be) and held for a request."""
        slot = await asyncio.to_thread(self._start, name)
        loaded = await asyncio.to_thread(slot.ready.wait, timeout_s)
        with self._lock:
            if not loaded:
                slot.active -= 1
                raise APIError(504, f"the model '{name}' did not load within {timeout_s:g} s")
            if slot.state != "ready":
                slot.active -= 1
                raise APIError(500, f"the model '{name}' failed to load: {slot.error}", code="model_load_failed")
            return Lease(name, slot.model, slot.scheduler, slot)

    def _start(self, name: str) -> Slot:
        """Hold ``name``'s slot for a request, starting its load when it is not loaded.

        Finding the model's files (which may import a GGUF or download from the Hub) happens outside the
        lock, so requests for other models never wait on it; a load another request started meanwhile is
        joined, not repeated."""
        slot = self._hold(name)
        if slot is not None:
            return slot
        need = self._bytes_of(name)
        with self._lock:
            slot = self._hold(name)
            if slot is not None:
                return slot
            self._make_room(name, need)
            slot = self._slots.get(name) or Slot(name, keep_alive_s=self.keep_alive_s)
            self._slots[name] = slot
            slot.state, slot.error, slot.bytes, slot.stopping = "loading", None, need, False
            slot.ready.clear()
            slot.thread = threading.Thread(target=self._serve, args=(slot,), name=f"umakit-model-{name}", daemon=True)
            slot.thread.start()
            slot.active += 1
            slot.last_used = time.monotonic()
            return slot

    def _hold(self, name: str) -> Slot | None:
        """``name``'s slot, held for a request, when it is loaded or loading; else None."""
        with self._lock:
            slot = self._slots.get(name)
            if slot is None or slot.state not in ("loading", "ready"):
                return None
            slot.active += 1
            slot.last_used = time.monotonic()
            return slot

    def preload(self, name: str) -> None:
        """Start loading ``name`` now (a model listed at start-up); a failure is logged, and a request for it
        tries again."""
        try:
            slot = self._start(name)
        except APIError as e:
            log.warning("not loading %s: %s", name, e.message)
            return
        with self._lock:
            slot.active -= 1

    def release(self, lease: Lease, keep_alive: float | None = None) -> None:
        """The request is over; the model stays loaded idle for ``keep_alive`` seconds (the request's own,
        `parse_keep_alive`), or else the server's keep-alive, counted from the last request to end."""
        slot = lease.slot
        lease.model = lease.scheduler = None  # the caller's lease must not keep an unloaded model's arrays alive
        with self._lock:
            slot.active -= 1
            slot.last_used = time.monotonic()
            slot.keep_alive_s = self.keep_alive_s if keep_alive is None else keep_alive
            if slot.active == 0 and slot.keep_alive_s == 0:
                self._unload(slot)

    def _bytes_of(self, name: str) -> int:
        try:
            return self._size(name)
        except UmakitError as e:
            known = [c["id"] for c in self.cards() if c["id"] != name]
            close = difflib.get_close_matches(name, known, n=3)
            hint = f" (did you mean {', '.join(repr(c) for c in close)}?)" if close else ""
            raise APIError(404, f"the model '{name}' does not exist: {e}{hint}", param="model") from e

    def _make_room(self, name: str, need: int) -> None:
        """Unload idle models, least recently used first, until ``need`` more bytes fit the budget."""
        if need > self.budget_bytes:
            raise APIError(400, f"the model '{name}' needs {_gib(need)} and this server's memory budget is "
                                f"{_gib(self.budget_bytes)} (umakit serve --memory-budget)",
                           param="model", code="model_too_large")
        idle = sorted((s for s in self._slots.values() if s.state == "ready" and s.active == 0),
                      key=lambda s: s.last_used)
        while self._used() + need > self.budget_bytes and idle:
            victim = idle.pop(0)
            log.info("unloading %s to make room for %s", victim.name, name)
            self._unload(victim)
        if self._used() + need > self.budget_bytes:
            busy = ", ".join(s.name for s in self._slots.values() if s.state in ("loading", "ready"))
            raise APIError(503, f"the model '{name}' needs {_gib(need)}, and the models in use ({busy}) leave "
                                f"{_gib(self.budget_bytes - self._used())} of the {_gib(self.budget_bytes)} budget; "
                                "try again when they are idle", code="model_memory_busy",
                           headers={"Retry-After": "5"})

    def _used(self) -> int:
        return sum(s.bytes for s in self._slots.values() if s.state in ("loading", "ready"))

    # -- a model's own thread: load, then run its scheduler until unloaded ------------------------------------
    def _serve(self, slot: Slot) -> None:
        from umakit.serve.scheduler import Scheduler

        t0 = time.perf_counter()
        try:
            log.info("loading %s", slot.name)
            model = self._load(slot.name)
            scheduler = Scheduler(model, self.settings)
            slot.model, slot.scheduler = model, scheduler
            slot.bytes = max(model.info.weights.total_bytes, 1)

            def ready():
                with self._lock:
                    slot.state = "ready"
                    slot.loads += 1
                log.info("loaded %s (%s, %.1f s)", slot.name, _gib(slot.bytes), time.perf_counter() - t0)
                slot.ready.set()

            with model.engine.wired():
                scheduler.run(ready=ready, until=lambda: slot.stopping)
        except Exception as e:  # the load failed: the requests waiting hear why, the server serves the others
            if isinstance(e, UmakitError):  # a reason meant for users: it goes in the answers
                log.warning("loading %s failed: %s", slot.name, e)
            else:  # ours: the traceback in the log, the kind alone in the answers (no paths or device details)
                log.exception("loading %s failed", slot.name)
            with self._lock:
                slot.state, slot.error = "failed", str(e) if isinstance(e, UmakitError) else internal(e)
                slot.model = slot.scheduler = None
            slot.ready.set()

    def _unload(self, slot: Slot) -> None:
        """Stop the model's worker and drop it (called with the lock held)."""
        if slot.state != "ready":
            return
        scheduler, model = slot.scheduler, slot.model
        device = model.info.device
        slot.state, slot.stopping = "unloaded", True
        slot.model = slot.scheduler = None
        slot.ready.clear()
        scheduler.stop()
        if slot.thread is not None and slot.thread is not threading.current_thread():
            slot.thread.join(timeout=30)
        # The request that asked for the unload may still hold the model (its scheduler's handle does) until its
        # response is done: the reaper hands the memory back once the model is gone (`_release_gone`).
        self._unloaded.append((weakref.ref(model), device, time.monotonic()))
        del scheduler, model
        log.info("unloaded %s", slot.name)

    def _reap(self) -> None:
        while not self._closed:
            time.sleep(REAP_EVERY_S)
            now = time.monotonic()
            with self._lock:
                for slot in list(self._slots.values()):
                    if slot.state == "ready" and slot.active == 0 and now - slot.last_used >= slot.keep_alive_s:
                        self._unload(slot)
            self._release_gone()

    def _release_gone(self) -> None:
        """Hand back the memory of unloaded models that are gone now (their arrays freed with them); one still
        held somewhere is looked at again at the next reap, for up to `RELEASE_WAIT_S`."""
        with self._lock:
            waiting, self._unloaded = self._unloaded, []
        if not waiting:
            return
        gc.collect()  # a model's objects refer to each other: freed by the collector, not by reference counts
        now, devices, again = time.monotonic(), set(), []
        for ref, device, since in waiting:
            if ref is None or ref() is None or now - since > RELEASE_WAIT_S:
                devices.add(device)
                if ref is not None:  # what the request that held it frees after it: handed back at the next reap
                    again.append((None, device, since))
            else:
                again.append((ref, device, since))
        with self._lock:
            self._unloaded += again
        for device in devices:
            self._release_memory(device)

    def close(self) -> None:
        self._closed = True
        with self._lock:
            for slot in self._slots.values():
                self._unload(slot)

    # -- what it says about itself -------------------------------------------------------------------
    def cards(self) -> list[dict]:
        """Each model the host knows (those it has held, then the rest of this machine's): whether it is loaded,
        its bytes, requests holding it, and in how many seconds it unloads if none comes (None: not while idle)."""
        now = time.monotonic()
        on_disk = self._on_disk()
        with self._lock:
            cards = [{"id": s.name, "loaded": s.state == "ready", "bytes": s.bytes if s.state == "ready" else 0,
                      "active_requests": s.active,
                      "unloads_in_s": None if s.keep_alive_s == math.inf or s.state != "ready"
                      else s.keep_alive_s if s.active else max(s.keep_alive_s - (now - s.last_used), 0.0)}
                     for s in self._slots.values()]
        held = {c["id"] for c in cards}
        return cards + [{"id": n, "loaded": False, "bytes": 0, "active_requests": 0, "unloads_in_s": None}
                        for n in on_disk if n not in held]

    def _on_disk(self) -> list[str]:
        """``available()``'s names; none where the disks cannot be read now (the list is a convenience)."""
        with contextlib.suppress(OSError, UmakitError):
            return list(dict.fromkeys(self._available()))
        return []

    def metrics(self) -> tuple[dict[str, float], list[tuple[str, dict[str, float]]]]:
        """Every loaded model's scheduler figures summed (rates and gauges too), and each model's own state."""
        total: dict[str, float] = {}
        per_model = []
        now = time.monotonic()
        with self._lock:
            slots = list(self._slots.values())
        for s in slots:
            figures = s.scheduler.metrics() if s.scheduler is not None else {}
            step_tokens = figures.pop("step_tokens", 0.0)  # each model's own
            for k, v in figures.items():
                total[k] = max(total.get(k, 0.0), v) if k in ("peak_gbps", "healthy") else total.get(k, 0.0) + v
            per_model.append((s.name, {"loaded": float(s.state == "ready"), "loading": float(s.state == "loading"),
                                       "step_tokens": step_tokens,
                                       "bytes": float(s.bytes if s.state in ("loading", "ready") else 0),
                                       "active_requests": float(s.active), "loads_total": float(s.loads),
                                       "idle_seconds": now - s.last_used if s.last_used else 0.0}))
        total["healthy"] = float(self.healthy)
        total["memory_budget_bytes"] = float(self.budget_bytes)
        return total, per_model


def _gib(n: int) -> str:
    """Bytes for a message: GiB, or MiB under one GiB."""
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"
