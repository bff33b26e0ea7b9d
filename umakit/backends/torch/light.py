"""The torch engine on CPU, started without importing torch: its fused step through libtorch, from C.

Importing torch takes 0.7-1.0 s here, more than llama.cpp's whole start on a
0.5B model. The fused CPU step (csrc/fused_decode.cpp) needs only libtorch,
which loads in 0.14 s, so a one-shot start (`umakit generate`, `umakit run`)
can skip Python's torch: csrc/light.cpp maps the weights the engine kept on
an earlier load and runs the engine's own steps, prefill rows, head and
sampler from C, through the same ATen kernels in the same order, so a run
gives the tokens the engine gives for the same seed (tests/test_light.py).

What it needs was kept by an earlier full load of the same checkpoint: the
int4 packing (packed_cache.py) and, beside it, the rest of the fused step's
inputs and what the engine measured of itself (light_form.py writes both,
keyed like the packing, so a changed checkpoint, torch or format is never
read stale); the built library (native.py records where it is). Anything
missing, ``UMAKIT_NO_NATIVE`` or ``UMAKIT_NO_LIGHT``: the full engine loads, as
before. A `LightEngine` serves the whole engine protocol: what it does not
run itself (a prefill of `FUSED_PREFILL_ROWS` tokens or more, logits of 32 or
more, batches) loads the full engine on first use (importing torch) and
carries the caches over, so nothing a caller does changes.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import json
import os
import signal
import threading
from pathlib import Path
from typing import Iterator, Sequence

from ...checkpoint import Checkpoint
from ...errors import InvalidArgumentError, WriteError
from ...fsutil import atomic_file
from ...home import home_dir
from ...roofline import kv_bytes_per_token
from ...sampling import SamplingParams, seed_or_random
from .. import common
from ..base import BatchRow, WeightInfo
from . import SPEC
from .cache_key import installed_torch_version, light_path, packed_path

CSRC = Path(__file__).with_name("csrc")
SOURCES = (CSRC / "fused_decode.cpp", CSRC / "light.cpp")  # one library (native.py builds it)
HEADERS = (CSRC / "fused_decode.h",)
LIGHT_FORMAT = 1  # bump when light_form.py's file or the C entry points change
METADATA_KEY = "umakit.light"
# A single sequence's prefill of fewer tokens runs as rows of the fused step (each row its own step's bits),
# from this many on as the eager forward (dequantize + one GEMM: 1.5-2x faster at 512 rows). Measured
# crossovers: 96-128 rows on the 135M and 0.5B models, where the eager forward pays ~0.2 s of dequantizing.
FUSED_PREFILL_ROWS = 96
LOGIT_ROWS = 32  # quant.DENSE_ROWS: logits of fewer tokens come from the fused step in the engine too
_DTYPES = {"F32": 0, "BF16": 1, "U8": 2, "F16": 3, "I32": 4, "U32": 2}  # light.cpp's codes (U32: as bytes)


def sources_digest() -> str:
    """A hash of the C++ the library is built from (its build key, and the check of a recorded build)."""
    key = hashlib.sha256()
    for f in (*SOURCES, *HEADERS):
        key.update(f.read_bytes())
    return key.hexdigest()


def native_base() -> Path:
    """Where native.py keeps its builds: ``$UMAKIT_NATIVE_DIR``, else ``$UMAKIT_HOME/native``."""
    return Path(os.environ["UMAKIT_NATIVE_DIR"]) if os.environ.get("UMAKIT_NATIVE_DIR") else home_dir("native")


def _record(torch_version: str) -> Path:
    return native_base() / f"light-{torch_version}.json"


def record_library(library: Path, torch_version: str) -> None:
    """Note where the library of these sources, built against this torch, is (native.py, once it loaded)."""
    entry = {"library": str(library), "sources": sources_digest()}
    with contextlib.suppress(OSError, WriteError):
        path = _record(torch_version)
        if path.exists() and json.loads(path.read_text()) == entry:
            return
        with atomic_file(path) as f:
            f.write(json.dumps(entry))


def _library(torch_version: str) -> ctypes.CDLL | None:
    """The recorded library, loaded, if it was built from these sources against this torch."""
    try:
        entry = json.loads(_record(torch_version).read_text())
        if entry.get("sources") != sources_digest():
            return None
        lib = ctypes.CDLL(entry["library"])
    except (OSError, ValueError, KeyError, WriteError):
        return None
    _declare(lib)
    return lib


def _declare(lib: ctypes.CDLL) -> None:
    p, i64, i32, f64 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_double
    ptr = ctypes.POINTER
    signatures = {
        "umakit_light_error": ([], ctypes.c_char_p),
        "umakit_light_cpu_capability": ([], ctypes.c_char_p),
        "umakit_light_open": ([ptr(ctypes.c_char_p), i32, i32, ptr(i32), ptr(i64), ptr(i32), ptr(i32), ptr(i64),
                               ptr(i64), ptr(f64)], p),
        "umakit_light_close": ([p], None),
        "umakit_light_cache_new": ([p], p),
        "umakit_light_cache_free": ([p], None),
        "umakit_light_cache_offset": ([p], i64),
        "umakit_light_cache_set_offset": ([p, i64], None),
        "umakit_light_cache_capacity": ([p], i64),
        "umakit_light_cache_buffers": ([p, ptr(ptr(ctypes.c_float)), ptr(ptr(ctypes.c_float))], None),
        "umakit_light_forward": ([p, p, ptr(i64), i64, i32], i32),
        "umakit_light_logits": ([p, ptr(ctypes.c_float)], i32),
        "umakit_light_generator": ([ctypes.c_uint64], p),
        "umakit_light_generator_free": ([p], None),
        "umakit_light_sample": ([p, p, ptr(i64), i64, f64, i32, f64, i64, f64, f64], i64),
    }
    for name, (args, res) in signatures.items():
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = args, res


def read_header(path: Path) -> tuple[dict, int]:
    """A safetensors file's header (its tensors and ``__metadata__``) and where its data starts; ValueError for
    a file that is not one."""
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        if not 2 <= n <= min(os.fstat(f.fileno()).st_size - 8, 100 << 20):
            raise ValueError(f"{path} is not a safetensors file")
        header = json.loads(f.read(n))
    if not isinstance(header, dict):
        raise ValueError(f"{path} is not a safetensors file")
    return header, 8 + n


def start(ckpt: Checkpoint, *, device: str, dtype: str = "auto", **_options) -> "LightEngine | None":
    """A `LightEngine` for ``ckpt`` where an earlier load kept what it needs, else None (load the full engine)."""
    if device != "cpu" or os.environ.get("UMAKIT_NO_NATIVE") or os.environ.get("UMAKIT_NO_LIGHT"):
        return None
    if not ckpt.config.get("quantization"):
        return None
    version = installed_torch_version()
    packed = packed_path(ckpt.path, ckpt.files, version) if version else None
    if packed is None or not packed.exists() or not light_path(packed).exists():
        return None
    try:
        header, _ = read_header(light_path(packed))
        manifest = json.loads(header.get("__metadata__", {}).get(METADATA_KEY, "null"))
    except (OSError, ValueError):
        return None
    if not isinstance(manifest, dict) or manifest.get("format") != LIGHT_FORMAT or manifest.get("torch") != version:
        return None
    if dtype not in manifest.get("dtypes", ()):
        return None
    lib = _library(version)
    if lib is None or lib.umakit_light_cpu_capability().decode() != manifest["cpu_capability"]:
        return None
    try:
        files, tensors = _tensors(manifest, packed, ckpt)
        handle = _open(lib, files, tensors, manifest["shape"])
    except (OSError, ValueError, KeyError, TypeError, IndexError):  # a file another version left: not ours
        return None
    return None if handle is None else LightEngine(ckpt, dtype, manifest, lib, handle)


def _tensors(manifest: dict, packed: Path, ckpt: Checkpoint) -> tuple[list[Path], list[tuple]]:
    """The files to map and, in the C entry point's order, each tensor as (file index, offset, dtype code, shape)."""
    files = {"packed": packed, "light": light_path(packed)}
    files.update({f"checkpoint:{name}": ckpt.path / name for name in manifest["checkpoint_files"]})
    order = list(files)
    headers = {name: read_header(path) for name, path in files.items()}
    out = []
    for where, key in manifest["tensors"]:
        header, data = headers[where]
        entry = header[key]
        code = _DTYPES[entry["dtype"]]
        shape = list(entry["shape"])
        if entry["dtype"] == "U32":  # MLX's packed words, read as their bytes
            shape[-1] *= 4
        if len(shape) > 4:
            raise ValueError(f"{key} has {len(shape)} dimensions")
        out.append((order.index(where), data + entry["data_offsets"][0], code, shape))
    return [files[name] for name in order], out


def _open(lib: ctypes.CDLL, files: list[Path], tensors: list[tuple], shape: dict):
    n = len(tensors)
    paths = (ctypes.c_char_p * len(files))(*[str(f).encode() for f in files])
    file_of = (ctypes.c_int * n)(*[t[0] for t in tensors])
    offsets = (ctypes.c_int64 * n)(*[t[1] for t in tensors])
    dtypes = (ctypes.c_int * n)(*[t[2] for t in tensors])
    ndims = (ctypes.c_int * n)(*[len(t[3]) for t in tensors])
    shapes = (ctypes.c_int64 * (4 * n))(*[d for t in tensors for d in (t[3] + [0] * (4 - len(t[3])))])
    s = shape
    ints = [s["layers"], s["heads"], s["kv_heads"], s["head_dim"], s["hidden"], s["vocab"], s["max_tokens"],
            s["embed_bits"], s["embed_group"], s["head_group"], int(s["head_split"]), int(s["qk_norm"]),
            int(s["bias"]), s["window"], *s["groups"], *s["splits"]]
    handle = lib.umakit_light_open(paths, len(files), n, file_of, offsets, dtypes, ndims, shapes,
                                   (ctypes.c_int64 * len(ints))(*ints), (ctypes.c_double * 2)(s["eps"], s["scale"]))
    return handle or None


class LightCache:
    """`umakit.backends.base.KVCache` of a `LightEngine`: the C cache, or, once the full engine took it over,
    the torch engine's cache it was copied into."""

    kv_bits = None
    trimmable = True  # as StaticKVCache: positions are never overwritten

    def __init__(self, engine: "LightEngine"):
        self._engine = engine
        self._lib = engine._lib
        self.handle = self._lib.umakit_light_cache_new(engine._handle)
        if not self.handle:
            raise MemoryError(self._lib.umakit_light_error().decode())
        self.torch_cache = None  # a StaticKVCache once carried over

    def __del__(self):
        self._free()

    def _free(self) -> None:
        if getattr(self, "handle", None):
            self._lib.umakit_light_cache_free(self.handle)
            self.handle = None

    @property
    def offset(self) -> int:
        if self.torch_cache is not None:
            return self.torch_cache.offset
        return self._lib.umakit_light_cache_offset(self.handle)

    @property
    def capacity(self) -> int:
        return self._lib.umakit_light_cache_capacity(self.handle)

    @property
    def nbytes(self) -> int:
        if self.torch_cache is not None:
            return self.torch_cache.nbytes
        return self.capacity * self._engine.kv_bytes_per_token()

    def trim(self, n: int) -> int:
        if self.torch_cache is not None:
            return self.torch_cache.trim(n)
        n = max(min(n, self.offset), 0)
        self._lib.umakit_light_cache_set_offset(self.handle, self.offset - n)
        return n


class LightEngine:
    """`umakit.backends.base.Engine`: the torch engine's CPU default, run from C until torch is needed."""

    spec = SPEC
    name = SPEC.name
    features = SPEC.features
    device = "cpu"
    offload = None
    load_notes: tuple[str, ...] = ()

    def __init__(self, ckpt: Checkpoint, dtype: str, manifest: dict, lib: ctypes.CDLL, handle: int):
        self._ckpt, self._requested = ckpt, dtype
        self._lib, self._handle = lib, handle
        self.config = ckpt.config
        self.quantization = ckpt.config.get("quantization")
        self.dtype = manifest["dtype"]
        self._shape = manifest["shape"]
        self._weights = WeightInfo(**manifest["weight_info"])
        self._full = None  # the TorchEngine, once something needed it

    def __del__(self):
        if getattr(self, "_handle", None):
            self._lib.umakit_light_close(self._handle)
            self._handle = None

    @classmethod
    def from_checkpoint(cls, ckpt, *, device: str, dtype: str = "auto", progress=None, quantize=None,
                        gpu_layers=None, vram_budget=None):
        """A light start where one can be made and nothing it lacks is asked for; else the full engine."""
        plain = quantize is None and gpu_layers is None and vram_budget is None
        return (plain and start(ckpt, device=device, dtype=dtype)) or _torch_engine().from_checkpoint(
            ckpt, device=device, dtype=dtype, progress=progress, quantize=quantize, gpu_layers=gpu_layers,
            vram_budget=vram_budget)

    @classmethod
    def synthetic(cls, config: dict, *, device: str, dtype: str = "auto", bits: int | None = None,
                  group_size: int = 64, gpu_layers: int | None = None, vram_budget: int | str | None = None):
        """Random weights are never kept from an earlier load: the full engine's."""
        return _torch_engine().synthetic(config, device=device, dtype=dtype, bits=bits, group_size=group_size,
                                         gpu_layers=gpu_layers, vram_budget=vram_budget)

    # -- the full engine, when something needs it ------------------------------------------
    def torch_engine(self):
        """The full `TorchEngine` of the same checkpoint (imports torch on first use)."""
        if self._full is None:
            with _sigint_held():
                self._full = _torch_engine().from_checkpoint(self._ckpt, device="cpu", dtype=self._requested)
        return self._full

    def _carried(self, cache):
        """``cache`` as the full engine's: a `LightCache` is copied into a torch cache of the same capacity once."""
        if not isinstance(cache, LightCache):
            return cache
        if cache.torch_cache is None:
            import torch

            full = self.torch_engine()
            into = full.make_cache()
            into.reserve(cache.capacity)  # the same capacity, as if it had grown there
            k, v = ctypes.POINTER(ctypes.c_float)(), ctypes.POINTER(ctypes.c_float)()
            self._lib.umakit_light_cache_buffers(cache.handle, ctypes.byref(k), ctypes.byref(v))
            for src, dst in ((k, into.k), (v, into.v)):
                buf = (ctypes.c_float * dst.numel()).from_address(ctypes.addressof(src.contents))
                dst.copy_(torch.frombuffer(buf, dtype=torch.float32).view(dst.shape))
            into.offset = cache.offset
            cache.torch_cache = into
            cache._free()
        return cache.torch_cache

    def _native(self, cache) -> bool:
        return self._full is None and isinstance(cache, LightCache) and cache.torch_cache is None

    def _forward(self, cache: LightCache, tokens: Sequence[int], logits: bool) -> None:
        n = len(tokens)
        if cache.offset + n > self._shape["max_tokens"]:
            raise InvalidArgumentError(f"{cache.offset + n} tokens do not fit the model's context of "
                                       f"{self._shape['max_tokens']}; shorten the prompt or reply")
        ids = (ctypes.c_int64 * n)(*tokens)
        if self._lib.umakit_light_forward(self._handle, cache.handle, ids, n, int(logits)) != 0:
            raise RuntimeError(self._lib.umakit_light_error().decode())

    # -- engine interface -----------------------------------------------------------------
    def make_cache(self, kv_bits: int | None = None):
        if kv_bits is not None:
            raise InvalidArgumentError("the torch backend does not quantize the KV cache; leave kv_bits unset")
        return self._full.make_cache() if self._full is not None else LightCache(self)

    def prefill(self, tokens: Sequence[int], cache) -> None:
        tokens = list(tokens)
        if not self._native(cache) or len(tokens) >= FUSED_PREFILL_ROWS:
            return self.torch_engine().prefill(tokens, self._carried(cache))
        if tokens:
            self._forward(cache, tokens, logits=False)

    def generate_tokens(self, prompt: Sequence[int], cache, sampling: SamplingParams, seed: int | None = None,
                        history: Sequence[int] = ()) -> Iterator[int]:
        if not prompt:
            raise InvalidArgumentError("the prompt is empty: there is nothing to continue from")
        prompt = list(prompt)
        if not self._native(cache) or len(prompt) - 1 >= FUSED_PREFILL_ROWS:
            yield from self.torch_engine().generate_tokens(prompt, self._carried(cache), sampling, seed, history)
            return
        s = sampling
        gen = _Generator(self._lib, seed_or_random(seed))
        window, penalty = s.repetition_context, s.repetition_penalty != 1.0
        recent = (list(history)[-window:] + prompt)[-window:] if penalty else []
        self.prefill(prompt[:-1], cache)
        self._forward(cache, prompt[-1:], logits=True)
        while True:
            ids = (ctypes.c_int64 * len(recent))(*recent)
            y = self._lib.umakit_light_sample(cache.handle, gen.handle, ids, len(recent), s.repetition_penalty,
                                              int(s.greedy), s.temperature, s.top_k, s.top_p, s.min_p)
            if y < 0:
                raise RuntimeError(self._lib.umakit_light_error().decode())
            if penalty:
                recent = (recent + [y])[-window:]
            yield y
            self._forward(cache, [y], logits=True)

    def logits(self, tokens: Sequence[int], cache=None):
        tokens = list(tokens)
        cache = cache if cache is not None else self.make_cache()
        if not self._native(cache) or not 0 < len(tokens) < LOGIT_ROWS:
            return self.torch_engine().logits(tokens, self._carried(cache))
        import numpy as np

        self._forward(cache, tokens, logits=True)
        out = np.empty((len(tokens), self._shape["vocab"]), dtype=np.float32)
        if self._lib.umakit_light_logits(cache.handle, out.ctypes.data_as(ctypes.POINTER(ctypes.c_float))) != 0:
            raise RuntimeError(self._lib.umakit_light_error().decode())
        return out

    def batch_decoder(self):
        return _CarryingDecoder(self, self.torch_engine().batch_decoder())

    def weight_info(self) -> WeightInfo:
        return self._weights if self._full is None else self._full.weight_info()

    def kv_bytes_per_token(self, kv_bits: int | None = None) -> int:
        s = self._shape
        return kv_bytes_per_token(s["layers"], s["kv_heads"], s["head_dim"], kv_bits=kv_bits, dtype_bytes=4)

    def export_weights(self):
        raise InvalidArgumentError("the torch backend holds weights in execution form and cannot export them; "
                                   "use --backend mlx")

    def wired(self):
        return contextlib.nullcontext()

    def reset_peak_memory(self) -> None:
        common.reset_process_peak_memory()

    def peak_memory(self) -> int:
        return common.process_peak_memory()


class _Generator:
    """torch.Generator(device="cpu").manual_seed(seed), held in C."""

    def __init__(self, lib: ctypes.CDLL, seed: int):
        self._lib, self.handle = lib, lib.umakit_light_generator(seed)

    def __del__(self):
        self._lib.umakit_light_generator_free(self.handle)


class _CarryingDecoder:
    """The full engine's batch decoder, taking rows whose cache a `LightEngine` made."""

    def __init__(self, engine: LightEngine, decoder):
        self._engine, self._decoder = engine, decoder

    @property
    def size(self) -> int:
        return self._decoder.size

    def add(self, rows: Sequence[BatchRow]) -> None:
        self._decoder.add([BatchRow(r.id, r.prompt, r.sampling, r.seed, self._engine._carried(r.cache), r.logprobs)
                           if isinstance(r.cache, LightCache) else r for r in rows])

    def step(self):
        return self._decoder.step()

    def logprobs(self):
        return self._decoder.logprobs()

    def export(self, row_id: int):
        return self._decoder.export(row_id)

    def remove(self, ids) -> None:
        self._decoder.remove(ids)

    def kv_budget_bytes(self) -> int:
        return self._decoder.kv_budget_bytes()

    def context_tokens(self) -> int:
        return self._decoder.context_tokens()


@contextlib.contextmanager
def _sigint_held():
    """Ctrl-C held back until the block ends, then delivered: an import of torch cut short cannot be retried in
    the same process (its C extension is half registered), and a chat carries on after a Ctrl-C."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    caught = []
    previous = signal.signal(signal.SIGINT, lambda *_: caught.append(True))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
        if caught:
            signal.raise_signal(signal.SIGINT)


def _torch_engine():
    """The full engine's class, through the registry (it imports torch)."""
    from .. import engine_class

    return engine_class(SPEC.name)

