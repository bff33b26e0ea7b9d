"""The logic of the CUDA-only branches, run on CPU with the CUDA calls replaced by stand-ins.

- CUDA-graph decode steps: `GraphDecoder` with a fake capture whose replay
  reruns the step on the tensors it was captured with (span doubling, graph
  keys, eviction at MAX_GRAPHS, never a replay on moved cache buffers).
- tinygemm repack: `Int4PackLinear`'s CUDA branch, its two CUDA ops replaced
  by the CPU ops behind a decoder of the CUDA op's documented input layout.
- the offload copy stream: `LayerStreamer`'s CUDA branch against simulated
  streams and events that run queued work in the most hostile order allowed.
- no Triton: the matvec module imports and declines cleanly.
What stays GPU-only is listed in benchmarks/gpu_check.py's docstring.
"""

import sys

import numpy as np
import pytest
import torch
from torch import nn

import umakit
from umakit.backends.torch.cuda import matvec
from umakit.backends.torch import quant
from umakit.backends.torch.cache import StaticKVCache
from umakit.backends.torch.cuda.graphs import MAX_GRAPHS, SPAN_MIN, GraphDecoder
from umakit.backends.torch.offload.layers import LayerStreamer
from umakit.errors import BackendUnavailableError
from umakit.generate.sampling import SamplingParams

PROMPT = [5, 17, 42, 99, 3, 250, 7, 301]


# -- CUDA-graph decode steps ------------------------------------------------------------
class FakeGraph:
    """A captured step: replay reruns it on the tensors it was captured with, as a CUDA graph would."""

    def __init__(self, decoder: GraphDecoder, cache, span: int, static_token, position, logits):
        self.decoder, self.cache, self.span = decoder, cache, span
        self.buffers = (cache.k, cache.v)  # the addresses a real graph bakes in
        self.static_token, self.position, self.logits = static_token, position, logits

    def replay(self):
        assert (self.cache.k, self.cache.v) == self.buffers, "replayed on cache buffers that have moved"
        out = self.decoder.model(self.static_token, self.position, self.cache, static=self.span)[:, -1]
        self.logits.copy_(out)


def fake_capture(decoder: GraphDecoder, captured: list):
    def capture(token, cache, span):
        static_token = token.view(1, 1).clone()
        position = torch.full((1,), cache.offset, dtype=torch.long)
        logits = decoder.model(static_token, position, cache, static=span)[:, -1].clone()  # the warm-up run
        captured.append(span)
        return FakeGraph(decoder, cache, span, static_token, position, logits), static_token, position, logits
    decoder._capture = capture
    return decoder


@pytest.fixture(scope="module")
def llama(tiny_dir):
    return umakit.load(tiny_dir("llama"), backend="torch", device="cpu", dtype="float32")


def tokens(n: int, seed: int = 0) -> list[int]:
    return torch.randint(3, 500, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_graph_steps_across_a_span_boundary_equal_the_full_forward(llama):
    """Spans double at 256; the cache grows a whole span at once, so one graph serves it."""
    captured = []
    step = fake_capture(GraphDecoder(llama.engine.model), captured)
    ids = tokens(SPAN_MIN + 6)
    cache = llama.make_cache()
    llama.engine.prefill(ids[:SPAN_MIN - 3], cache)
    with torch.inference_mode():
        got = [step(torch.tensor([t]), cache)[0].clone().numpy() for t in ids[SPAN_MIN - 3:]]
    assert captured == [SPAN_MIN, 2 * SPAN_MIN]  # the first three steps in one graph, the rest in the next
    assert cache.offset == len(ids) and cache.capacity == 2 * SPAN_MIN
    np.testing.assert_allclose(np.stack(got), llama.logits(ids)[SPAN_MIN - 3:], atol=1e-4, rtol=1e-4)


def test_the_last_span_stops_at_the_context(llama):
    a = llama.engine.args
    cache = StaticKVCache(a.num_hidden_layers, a.num_key_value_heads, a.head_dim, SPAN_MIN + 40, torch.float32,
                          torch.device("cpu"))
    captured = []
    step = fake_capture(GraphDecoder(llama.engine.model), captured)
    ids = tokens(SPAN_MIN + 2, seed=1)
    llama.engine.prefill(ids[:-2], cache)
    with torch.inference_mode():
        got = [step(torch.tensor([t]), cache)[0].clone().numpy() for t in ids[-2:]]
    assert captured == [SPAN_MIN + 40] and cache.capacity == SPAN_MIN + 40
    np.testing.assert_allclose(np.stack(got), llama.logits(ids)[-2:], atol=1e-4, rtol=1e-4)


def test_graphs_are_keyed_on_the_cache_buffers_and_the_oldest_is_evicted(llama):
    captured = []
    step = fake_capture(GraphDecoder(llama.engine.model), captured)
    caches = [llama.make_cache() for _ in range(MAX_GRAPHS + 1)]
    with torch.inference_mode():
        for cache in caches:
            step(torch.tensor([5]), cache)
        assert len(captured) == MAX_GRAPHS + 1 and len(step.graphs) == MAX_GRAPHS
        assert (caches[0].k.data_ptr(), caches[0].v.data_ptr(), caches[0].capacity, SPAN_MIN) not in step.graphs
        step(torch.tensor([6]), caches[-1])  # still held: replayed, not captured again
        assert len(captured) == MAX_GRAPHS + 1
        step(torch.tensor([6]), caches[0])  # evicted: captured again
        assert len(captured) == MAX_GRAPHS + 2 and len(step.graphs) == MAX_GRAPHS


def test_engine_greedy_tokens_through_graph_steps_equal_eager(llama, monkeypatch):
    """The engine reuses the graph's static logits tensor from step to step, as it does on CUDA."""
    stream = llama.engine.generate_tokens(PROMPT, llama.make_cache(), SamplingParams(temperature=0))
    want = [next(stream) for _ in range(12)]
    stream.close()
    captured = []
    monkeypatch.setattr(llama.engine, "_graphs", fake_capture(GraphDecoder(llama.engine.model), captured))
    stream = llama.engine.generate_tokens(PROMPT, llama.make_cache(), SamplingParams(temperature=0))
    got = [next(stream) for _ in range(12)]
    stream.close()
    assert captured == [SPAN_MIN] and got == want


# -- tinygemm repack ---------------------------------------------------------------------
@pytest.fixture
def cuda_int4_ops(monkeypatch):
    """torch's CUDA int4 ops replaced by the CPU ones. `_convert_weight_to_int4pack` takes (N, K/2) uint8,
    element 2i in the high nibble and 2i+1 in the low one (as torch's own tests build it): decoded here."""
    tiles = []

    def convert(pairs: torch.Tensor, inner_k_tiles: int) -> torch.Tensor:
        assert pairs.dtype == torch.uint8 and inner_k_tiles in (2, 4, 8)
        assert (2 * pairs.shape[1]) % (16 * inner_k_tiles) == 0
        tiles.append(inner_k_tiles)
        q = torch.stack([pairs >> 4, pairs & 15], dim=-1).view(pairs.shape[0], -1)  # (N, K)
        return torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32), 2)

    monkeypatch.setattr(torch.ops.aten, "_convert_weight_to_int4pack", convert)
    monkeypatch.setattr(torch.ops.aten, "_weight_int4pack_mm", torch.ops.aten._weight_int4pack_mm_for_cpu)
    return tiles


@pytest.mark.parametrize("bits, cols, group, tiles", [(4, 256, 64, 8), (4, 96, 32, 2), (8, 160, 32, 4)])
def test_cuda_int4_repack_is_exact(cuda_int4_ops, bits, cols, group, tiles):
    g = torch.Generator().manual_seed(0)
    packed, s, b = quant.quantize(torch.randn(48, cols, generator=g) * 0.05, bits, group)
    m = quant.QuantizedLinear(cols, 48, False, bits, group, device="meta")
    m.weight, m.scales, m.biases = packed, s.half(), b.half()
    assert quant.Int4PackLinear.supports(m, torch.device("cuda"))
    cuda = quant.Int4PackLinear(m, torch.device("cuda"))
    cpu = quant.Int4PackLinear(m, torch.device("cpu"))
    assert cuda_int4_ops == [tiles]  # the widest inner-k tiling that divides K (2K for 8 bits)
    x = torch.randn(3, cols, generator=g).to(torch.bfloat16)
    assert torch.equal(cuda(x), cpu(x))  # the same codes, scales and zeros reach the kernel
    want = x.float() @ m.dequantized(torch.float32).T
    assert (cuda(x).float() - want).abs().max() <= 0.02 * want.abs().max()


# -- the offload copy stream ------------------------------------------------------------
class Event:
    def __init__(self, device):
        self.device, self.issued, self.done = device, 0, 0

    def record(self, stream):
        self.issued += 1
        stream.ops.append(("record", self, self.issued))


class Stream:
    def __init__(self, device, name):
        self.device, self.name, self.ops = device, name, []

    def wait_event(self, event):
        self.ops.append(("wait", event, event.issued))  # the record queued last, as CUDA does


class Device:
    """Streams as queues; `run` executes queued work in any order that the waits allow, copies first or last."""

    def __init__(self, copies_first: bool):
        self.copies_first = copies_first
        self.compute, self.copy = Stream(self, "compute"), Stream(self, "copy")
        self.current = self.compute

    def stream(self, stream):
        device = self

        class Context:
            def __enter__(self):
                device.current = stream

            def __exit__(self, *exc):
                device.current = device.compute

        return Context()

    def run(self):
        order = (self.copy, self.compute) if self.copies_first else (self.compute, self.copy)
        while any(s.ops for s in order):
            stream = next(s for s in order if s.ops and self._ready(s.ops[0]))
            kind, *args = stream.ops.pop(0)
            if kind == "record":
                args[0].done = args[1]
            elif kind == "copy":
                with torch.inference_mode():
                    args[0].copy_(args[1])
            elif kind == "compute":
                args[0]()

    @staticmethod
    def _ready(op) -> bool:
        return op[0] != "wait" or op[1].done >= op[2]


class Slot:
    """A ring slot whose copies are queued on the current stream instead of run."""

    def __init__(self, t: torch.Tensor, device: Device):
        self.t, self.device = t, device

    def numel(self):
        return self.t.numel()

    def __getitem__(self, index):
        view, device = self.t[index], self.device

        class View:
            def copy_(self, src, non_blocking=False):
                assert non_blocking and device.current is device.copy, "host-to-device copies go on the copy stream"
                device.copy.ops.append(("copy", view, src))

        return View()


def cuda_streamer(monkeypatch, copies_first: bool, layers=5, offloaded=(1, 2, 3, 4), slots=3):
    """A `LayerStreamer` on CPU switched to its CUDA branch, with torch.cuda's streams simulated."""
    torch.manual_seed(0)
    blocks = nn.ModuleList(nn.Linear(8, 8 + i) for i in range(layers))
    want = {i: {k: v.detach().clone() for k, v in blocks[i].state_dict().items()} for i in range(layers)}
    streamer = LayerStreamer(blocks, offloaded, torch.device("cpu"), slots)
    device = Device(copies_first)
    streamer.cuda = True
    streamer.copy_stream = device.copy
    streamer.ready = [Event(device) for _ in streamer.slots]
    streamer.free = [Event(device) for _ in streamer.slots]
    for s in streamer.slots:
        s.fill_(255)  # stale contents read as NaN
    streamer.slots = [Slot(s, device) for s in streamer.slots]
    monkeypatch.setattr(torch.cuda, "stream", device.stream)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda *a: device.current)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: device.run())
    return blocks, want, streamer, device


def forward(blocks, want, streamer, device, stop: int | None = None):
    """Queue one pass over ``blocks`` as the model does; each layer checks, when it runs, what it reads."""
    for i in range(len(blocks) if stop is None else stop):
        streamer.before(i)
        bound = {k: v for k, v in blocks[i].state_dict().items()}  # the addresses a kernel launch takes

        def layer(i=i, bound=bound):
            for k, v in bound.items():
                assert torch.equal(v, want[i][k]), f"layer {i} read {k} before its copy landed or after it was reused"

        device.current.ops.append(("compute", layer))
        streamer.after(i)


@pytest.mark.parametrize("copies_first", [True, False], ids=["copies-early", "copies-late"])
def test_copy_stream_events_order_every_copy_and_read(monkeypatch, copies_first):
    blocks, want, streamer, device = cuda_streamer(monkeypatch, copies_first)
    for _ in range(3):  # the ring wraps mid-pass (4 streamed layers, 3 slots) and runs on across passes
        forward(blocks, want, streamer, device)
    device.run()
    forward(blocks, want, streamer, device, stop=3)  # a pass cut short: the next starts the ring again
    forward(blocks, want, streamer, device)
    device.run()
    assert streamer.copied_bytes >= 5 * streamer.streamed_bytes


# -- without Triton -------------------------------------------------------------------------
def test_without_triton_the_matvec_module_declines(monkeypatch):
    monkeypatch.setitem(sys.modules, "triton", None)  # import triton raises ImportError
    assert matvec._kernels.__wrapped__() is None
    monkeypatch.setattr(matvec, "_kernels", matvec._kernels.__wrapped__)
    assert matvec.triton_kernel() is None
    w = torch.zeros(4, 8, dtype=torch.int32)
    with pytest.raises(BackendUnavailableError, match="needs Triton"):
        matvec.affine_matvec(torch.zeros(64), w, torch.ones(4, 1), torch.zeros(4, 1), 4, 64, 16, 128)
