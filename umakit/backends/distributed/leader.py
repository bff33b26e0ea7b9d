"""Rank 0 drives, the other ranks follow: the sharded engine behind the declared protocol.

Every call a user makes on rank 0 (`LeaderEngine`, its caches and batch
decoders) is first sent to the other ranks as a small message, then run
locally; `follow` on each other rank runs the same call on its own shard, so
every collective inside the model meets its partners. Caches and decoders
are named by ids that rank 0 hands out; ids freed on rank 0 travel with its
next message.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import hashlib
import json
import sys
import time
import weakref
from dataclasses import asdict
from importlib import metadata
from typing import ClassVar, Iterable, Iterator, Sequence

from umakit.generate.sampling import SamplingParams, seed_or_random
from umakit.backends import common
from umakit.backends.base import BatchRow, EngineSpec, Lookup, WeightInfo, refuse_options
from umakit.backends.distributed import DistributedError
from umakit.core.sharding import TENSOR
from umakit.backends.distributed.watchdog import stop_on_sigterm


def _fingerprint(ckpt) -> bytes:
    """What every rank must agree on: umakit's version, the config and every tensor's name, type and shape."""
    try:
        version = metadata.version("umakit")
    except metadata.PackageNotFoundError:
        version = "unknown"
    tensors = sorted((k, str(t.dtype), list(t.shape)) for k, t in ckpt.tensors.items())
    blob = json.dumps([version, ckpt.config, tensors], sort_keys=True, default=str).encode()
    return hashlib.sha256(blob).digest()


def check_same_everywhere(channel, ckpt) -> None:
    """Refuse, on every rank, a run whose ranks hold different checkpoints or umakit versions."""
    odd = channel.gather_equal(_fingerprint(ckpt), "the start-up check")
    if odd:
        raise DistributedError(f"rank(s) {', '.join(map(str, odd))} loaded a different checkpoint or umakit "
                               "version than rank 0; give every rank the same model files and umakit")


def per_token_collectives(parallel: str, layers: int, ranks: int) -> int:
    """Collectives one decode step waits on, in sequence: two all-reduces per layer (tensor) or a hop per stage
    and the final gather (pipeline), then the token's broadcast and rank 0's message."""
    return (2 * layers if parallel == TENSOR else ranks) + 2


def timed(run_one, reps: int = 16, warmup: int = 4) -> float:
    """Median seconds of ``run_one()`` (one synchronous collective): the first ones pay for connection set-up."""
    for _ in range(warmup):
        run_one()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        run_one()
        times.append(time.perf_counter() - t0)
    return sorted(times)[reps // 2]


def lead_or_follow(local, channel, leader_cls, comm_s_per_token: float = 0.0):
    """Rank 0: a ``leader_cls`` over ``local``, shut down at exit. Other ranks: follow rank 0, then exit.

    ``comm_s_per_token``: what a decode step waits on the link, as measured at load (`WeightInfo`).
    """
    stop_on_sigterm(channel.rank, channel.size)
    if channel.rank == 0:
        leader = leader_cls(local, channel)
        leader.comm_s_per_token = comm_s_per_token
        leader.load_notes = (*leader.load_notes, f"the link: {comm_s_per_token * 1e3:.2f} ms of each decode step "
                             "waits on collectives (measured at load)")
        atexit.register(leader.shutdown)
        return leader
    follow(local, channel)
    sys.exit(0)  # a follower has no caller of its own: its run ends with rank 0's


class LeaderCache:
    """`umakit.backends.base.KVCache` on rank 0: the local shard's cache, with an id the others know."""

    def __init__(self, inner, cid: int, leader: "LeaderEngine"):
        self.inner, self.id, self._leader = inner, cid, leader
        weakref.finalize(self, leader.pending_free.append, cid)

    offset = property(lambda self: self.inner.offset)
    nbytes = property(lambda self: self.inner.nbytes)
    kv_bits = property(lambda self: self.inner.kv_bits)
    trimmable = property(lambda self: self.inner.trimmable)

    def trim(self, n: int) -> int:
        self._leader.send("trim", cache=self.id, n=n)
        return self.inner.trim(n)

    def mark(self) -> int:
        return self.offset  # the ranks' caches are trimmable ones

    def rewind(self, mark: int) -> int:
        return self.trim(self.offset - mark)

    def copy(self, n: int) -> "LeaderCache":
        cid = self._leader.new_id()
        self._leader.send("copy", cache=self.id, into=cid, n=n)
        return LeaderCache(self.inner.copy(n), cid, self._leader)


class LeaderBatch:
    """`umakit.backends.base.BatchDecoder` on rank 0: the local decoder, every call mirrored on the others."""

    def __init__(self, leader: "LeaderEngine", did: int):
        self._leader, self.id = leader, did
        self.inner = leader.local.batch_decoder()
        self._last: list = []
        weakref.finalize(self, leader.pending_free.append, -did)

    @property
    def size(self) -> int:
        return self.inner.size

    def add(self, rows: Sequence[BatchRow]) -> None:
        if any(r.constraint is not None for r in rows):  # the followers would draw unmasked tokens
            refuse_options(self._leader.spec, constrain=True)
        # Seeds are drawn here and sent, so that every rank's sampler draws the same tokens.
        rows = [BatchRow(r.id, list(r.prompt), r.sampling, seed_or_random(r.seed), r.cache, r.logprobs) for r in rows]
        self._leader.send("batch_add", batch=self.id, rows=[
            {"id": r.id, "prompt": r.prompt, "sampling": asdict(r.sampling), "seed": r.seed,
             "cache": None if r.cache is None else r.cache.id, "logprobs": r.logprobs} for r in rows])
        with self._leader.channel.guarded():
            self.inner.add([BatchRow(r.id, r.prompt, r.sampling, r.seed, None if r.cache is None else r.cache.inner,
                                     r.logprobs) for r in rows])

    mixes = False  # a prompt slice is prefilled on every rank in a pass of its own

    def step(self, prefill=None) -> list[tuple[int, int]]:
        common.prefill_apart(self._leader, prefill)
        # The previous step's tokens travel with this message: a follower that drew others stops the run.
        self._leader.send("batch_step", batch=self.id, check=self._last)
        with self._leader.channel.guarded("a batch step"):
            self._last = self.inner.step()
        return self._last

    def logprobs(self):
        return self.inner.logprobs()

    def export(self, row_id: int) -> LeaderCache:
        cid = self._leader.new_id()
        self._leader.send("batch_export", batch=self.id, row=row_id, cache=cid)
        return LeaderCache(self.inner.export(row_id), cid, self._leader)

    def remove(self, ids: Iterable[int]) -> None:
        ids = list(ids)
        self._leader.send("batch_remove", batch=self.id, ids=ids)
        self.inner.remove(ids)

    def kv_budget_bytes(self) -> int:
        return self.inner.kv_budget_bytes()

    def context_tokens(self) -> int:
        return self.inner.context_tokens()


class LeaderEngine:
    """`umakit.backends.base.Engine` on rank 0 of a sharded run; a subclass per engine sets ``spec``."""

    spec: ClassVar[EngineSpec]
    offload = None

    def __init_subclass__(cls, **kw):
        super().__init_subclass__(**kw)
        cls.name, cls.features = cls.spec.name, cls.spec.features

    def __init__(self, local, channel):
        self.local, self.channel = local, channel
        self.device, self.dtype, self.config = local.device, local.dtype, local.config
        self.quantization, self.load_notes = local.quantization, local.load_notes
        self.pending_free: list[int] = []
        self.comm_s_per_token = 0.0
        self._ids = 0
        self._closed = False

    @classmethod
    def from_checkpoint(cls, ckpt, **options):
        raise DistributedError("a sharded engine is made by umakit.load(..., parallel=...) under mlx.launch")

    @classmethod
    def synthetic(cls, config, **options):
        raise DistributedError("--parallel does not take --synthetic models yet; give a model directory")

    def new_id(self) -> int:
        self._ids += 1
        return self._ids

    def send(self, op: str, **fields) -> None:
        freed, self.pending_free[:] = list(self.pending_free), []
        self.channel.send({"op": op, "free": freed, **fields})

    def shutdown(self) -> None:
        if not self._closed and not self.channel.broken:
            self._closed = True
            with contextlib.suppress(DistributedError):
                self.send("shutdown")

    def make_cache(self, kv_bits: int | None = None) -> LeaderCache:
        inner = self.local.make_cache(kv_bits)  # raises on a bad kv_bits before anyone else acts
        cid = self.new_id()
        self.send("cache", cache=cid, kv_bits=kv_bits)
        return LeaderCache(inner, cid, self)

    def prefill(self, tokens: Sequence[int], cache: LeaderCache) -> None:
        self.send("prefill", cache=cache.id, tokens=[int(t) for t in tokens])
        with self.channel.guarded():
            self.local.prefill(tokens, cache.inner)

    def logits(self, tokens: Sequence[int], cache: LeaderCache | None = None):
        cache = cache if cache is not None else self.make_cache()
        self.send("logits", cache=cache.id, tokens=[int(t) for t in tokens])
        with self.channel.guarded():
            return self.local.logits(tokens, cache.inner)

    def generate_tokens(self, prompt: Sequence[int], cache: LeaderCache, sampling: SamplingParams,
                        seed: int | None = None, history: Sequence[int] = ()) -> Iterator[int]:
        if not prompt:
            return self.local.generate_tokens(prompt, cache.inner, sampling)  # raises the local error
        return self._generate(list(map(int, prompt)), cache, sampling, seed_or_random(seed), list(history))

    def _generate(self, prompt, cache, sampling, seed, history) -> Iterator[int]:
        self.send("generate", cache=cache.id, prompt=prompt, sampling=asdict(sampling), seed=seed, history=history)
        tokens = self.local.generate_tokens(prompt, cache.inner, sampling, seed, history)
        guarded = self.channel.guarded
        try:
            with guarded():
                token = next(tokens)
            while True:
                yield token
                # One more step on every rank, as this one is about to take; the token this one fed
                # travels with it, so a rank that fed another stops the run instead of drifting.
                self.send("next", fed=token)
                with guarded():
                    token = next(tokens)
        finally:
            tokens.close()

    def batch_decoder(self, kv_bits: int | None = None, lookup: Lookup | None = None,
                      mixed: bool | None = None) -> LeaderBatch:
        refuse_options(self.spec, batch_kv_bits=kv_bits, lookup=lookup, mixed=mixed)
        did = self.new_id()
        self.send("batch", batch=did)
        return LeaderBatch(self, did)

    def make_deterministic(self) -> None:
        refuse_options(self.spec, deterministic=True)

    def weight_info(self) -> WeightInfo:
        """This rank's weights, and the link time a decode step waits on."""
        return dataclasses.replace(self.local.weight_info(), comm_s_per_token=self.comm_s_per_token)

    def kv_bytes_per_token(self, kv_bits: int | None = None) -> int:
        return self.local.kv_bytes_per_token(kv_bits)

    def export_weights(self):
        raise DistributedError("a sharded engine holds a part of the weights only; export from a single process")

    def wired(self):
        return self.local.wired()

    def reset_peak_memory(self) -> None:
        self.local.reset_peak_memory()

    def peak_memory(self) -> int:
        return self.local.peak_memory()


def follow(engine, channel) -> None:
    """Another rank: run rank 0's calls on this rank's shard until it says shutdown (or is lost)."""
    with channel.guarded():
        _follow(engine, channel)


def _follow(engine, channel) -> None:
    caches: dict[int, object] = {}
    batches: dict[int, object] = {}
    last: dict[int, list] = {}
    message = channel.receive(bounded=False)
    while message["op"] != "shutdown":
        for i in message.get("free", ()):
            (batches if i < 0 else caches).pop(abs(i), None)
        op = message["op"]
        after = None
        if op == "cache":
            caches[message["cache"]] = engine.make_cache(message["kv_bits"])
        elif op == "trim":
            caches[message["cache"]].trim(message["n"])
        elif op == "copy":
            caches[message["into"]] = caches[message["cache"]].copy(message["n"])
        elif op == "prefill":
            engine.prefill(message["tokens"], caches[message["cache"]])
        elif op == "logits":
            engine.logits(message["tokens"], caches[message["cache"]])
        elif op == "generate":
            after = _follow_generation(engine, channel, message, caches[message["cache"]])
        elif op == "batch":
            batches[message["batch"]] = engine.batch_decoder()
        elif op == "batch_add":
            batches[message["batch"]].add([
                BatchRow(r["id"], r["prompt"], SamplingParams(**r["sampling"]), r["seed"],
                         None if r["cache"] is None else caches[r["cache"]], r["logprobs"]) for r in message["rows"]])
        elif op == "batch_step":
            b = message["batch"]
            if [list(t) for t in last.get(b, [])] != [list(t) for t in message["check"]]:
                raise DistributedError(f"rank {channel.rank} sampled other batch tokens than rank 0; "
                                       "the ranks' results diverged")
            with channel.guarded("a batch step"):
                last[b] = batches[b].step()
        elif op == "batch_export":
            caches[message["cache"]] = batches[message["batch"]].export(message["row"])
        elif op == "batch_remove":
            batches[message["batch"]].remove(message["ids"])
        elif op != "next":  # a "next" for a generation rank 0 had already left: nothing to run
            raise DistributedError(f"rank 0 sent an unknown request {op!r}: are both ranks on the same umakit?")
        message = after or channel.receive(bounded=False)


def _follow_generation(engine, channel, message, cache) -> dict:
    """Step as often as rank 0 does; returns the first message that is not "next" (rank 0 moved on)."""
    tokens = engine.generate_tokens(message["prompt"], cache, SamplingParams(**message["sampling"]),
                                    message["seed"], message["history"])
    try:
        fed = next(tokens)
        while True:
            following = channel.receive(bounded=False)
            if following["op"] != "next":
                return following
            if following["fed"] != fed:
                raise DistributedError(f"rank {channel.rank} decoded token {fed} where rank 0 decoded "
                                       f"{following['fed']}; the ranks' results diverged")
            fed = next(tokens)
    finally:
        tokens.close()
