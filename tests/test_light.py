"""The torch engine's light start (backends/torch/light.py): kept by a full load, started without importing
torch, and bit for bit the full engine: its tokens, logits and caches, handing over to it for what it lacks."""

import itertools
import json
import os
import subprocess
import sys
import typing

import numpy as np
import pytest

import umakit
from umakit.backends import base
from umakit.backends.torch import light, native
from umakit import checkpoint
from umakit.backends.torch.cache_key import light_path, packed_path
from umakit.backends.torch.engine import TorchEngine
from umakit.errors import InvalidArgumentError
from umakit.sampling import SamplingParams

from conftest import requires_default_model

TEXT = "It is a truth universally acknowledged, that a single man in possession of a good fortune"
GREEDY = SamplingParams(temperature=0)
SAMPLED = SamplingParams(temperature=0.9, top_k=40, top_p=0.9, min_p=0.02, repetition_penalty=1.3,
                         repetition_context=16)
FAMILIES = [
    ("llama", 4, {}),
    ("llama", 8, {}),  # every projection on two nibble planes, an 8-bit table
    ("qwen2", 4, {}),  # q/k/v biases, a tied head
    ("qwen3", 4, {}),  # q/k norms
    ("mistral", 4, {"sliding_window": 8}),
]


def load_both(path):
    """(the full engine's model, the light start's model) of a quantized checkpoint."""
    full = umakit.load(path, backend="torch", device="cpu", dtype="bfloat16")  # keeps the light file
    assert full.engine._fusing() is not None, native.reason()
    lite = umakit.load(path, backend="torch", device="cpu", dtype="bfloat16", light_start=True)
    assert isinstance(lite.engine, light.LightEngine)
    return full, lite


def light_file(path):
    """Where a full load keeps the light start's file of the checkpoint at ``path``."""
    import torch

    ckpt = checkpoint.open_checkpoint(path)
    return light_path(packed_path(ckpt.path, ckpt.files, torch.__version__))


def take(engine, prompt, n, sampling=GREEDY, seed=None, cache=None, history=()):
    stream = engine.generate_tokens(prompt, cache if cache is not None else engine.make_cache(), sampling, seed,
                                    history)
    out = list(itertools.islice(stream, n))
    stream.close()
    return out


@pytest.mark.parametrize("family, bits, overrides", FAMILIES)
def test_a_light_start_gives_the_engines_tokens_logits_and_caches(quantized, family, bits, overrides):
    full, lite = load_both(quantized(family, bits, **overrides))
    f, g = full.engine, lite.engine
    ids = full.tokenizer.encode(TEXT)
    assert take(g, ids, 24) == take(f, ids, 24)
    assert take(g, ids, 24, SAMPLED, seed=7) == take(f, ids, 24, SAMPLED, seed=7)
    assert take(g, ids, 8, SAMPLED, seed=8) != take(g, ids, 8, SAMPLED, seed=7)  # the seed is honoured
    assert np.array_equal(g.logits(ids[:9]), f.logits(ids[:9]))
    # a conversation: turns appended to one cache, a reply cut and trimmed; then a message too long for the
    # light step (FUSED_PREFILL_ROWS), which carries the cache over to the full engine
    long = (ids * 12)[:light.FUSED_PREFILL_ROWS + 5]
    out = {}
    for name, e in (("full", f), ("lite", g)):
        cache = e.make_cache()
        e.prefill(ids[:9], cache)
        first = take(e, ids[9:14], 6, cache=cache, history=ids[:9])
        assert cache.trim(3) == 3
        tail = e.logits(ids[14:17], cache)
        second = take(e, long, 5, SAMPLED, seed=3, cache=cache)
        out[name] = (first, tail, second, cache.offset)
    assert out["lite"][0] == out["full"][0] and np.array_equal(out["lite"][1], out["full"][1])
    assert out["lite"][2:] == out["full"][2:]
    assert g._full is not None  # the long message loaded the full engine
    assert g.weight_info() == f.weight_info() and lite.info.weights == full.info.weights


def test_a_light_engine_declares_the_protocol_and_hands_batches_over(quantized):
    full, lite = load_both(quantized("llama"))
    g = lite.engine
    assert isinstance(g, base.Engine) and g.spec is full.engine.spec and g.features == full.engine.features
    members = set(typing.get_type_hints(base.Engine)) | {n for n, v in vars(base.Engine).items() if callable(v)}
    assert all(hasattr(g, m) for m in members if not m.startswith("_"))
    assert (g.device, g.dtype, g.quantization) == (full.engine.device, full.engine.dtype, full.engine.quantization)
    assert g.kv_bytes_per_token() == full.engine.kv_bytes_per_token()
    with pytest.raises(InvalidArgumentError):
        g.make_cache(kv_bits=8)
    ids = full.tokenizer.encode(TEXT)
    held = g.make_cache()
    g.prefill(ids[:7], held)  # a light cache, carried over when the batch decoder takes it
    like = full.engine.make_cache()
    full.engine.prefill(ids[:7], like)
    assert g._full is None and held.offset == 7 and held.nbytes == like.nbytes > 0
    decoder = g.batch_decoder()
    assert isinstance(decoder, base.BatchDecoder)
    decoder.add([base.BatchRow(0, ids[:12], GREEDY, cache=held), base.BatchRow(1, ids[:5], GREEDY)])
    got = {0: [], 1: []}
    for _ in range(8):
        for rid, token in decoder.step():
            got[rid].append(token)
    assert got[0][:6] == take(full.engine, ids[:12], 6) and got[1][:6] == take(full.engine, ids[:5], 6)


def test_what_a_light_start_lacks_loads_the_full_engine(quantized, monkeypatch):
    path = quantized("qwen2")
    load_both(path)

    def engine(**kw):
        return umakit.load(path, backend="torch", device="cpu", light_start=True, **kw).engine

    # kept by a load asked for bfloat16, and used by one asked for "auto" where that means the same form
    auto_is_int4 = umakit.load(path, backend="torch", device="cpu").info.dtype == "bfloat16"
    assert isinstance(engine(dtype="auto"), light.LightEngine if auto_is_int4 else TorchEngine)
    assert isinstance(engine(dtype="float32"), TorchEngine)  # another form than the one kept
    assert isinstance(umakit.load(path, backend="torch", device="cpu", dtype="bfloat16").engine, TorchEngine)
    with monkeypatch.context() as m:
        m.setenv("UMAKIT_NO_LIGHT", "1")
        assert isinstance(engine(dtype="bfloat16"), TorchEngine)
    with monkeypatch.context() as m:  # C++ other than the recorded build's
        m.setattr(light, "sources_digest", lambda: "0" * 64)
        assert isinstance(engine(dtype="bfloat16"), TorchEngine)
    batch = umakit.load(path, backend="torch", device="cpu", dtype="bfloat16", light_start=True,
                        needs=frozenset({base.BATCH}))
    assert isinstance(batch.engine, TorchEngine)  # a server's or a batch's: the full engine from the start
    kept = light_file(path)
    kept.unlink()
    assert isinstance(engine(dtype="bfloat16"), TorchEngine) and kept.exists()  # that load wrote it again
    assert isinstance(engine(dtype="bfloat16"), light.LightEngine)
    os.utime(path / "model.safetensors")  # a changed checkpoint: another key, nothing stale read
    assert isinstance(engine(dtype="bfloat16"), TorchEngine)


def test_the_light_file_holds_its_manifest_and_refers_to_the_checkpoints_table(quantized):
    path = quantized("llama", 8)
    full, _ = load_both(path)
    kept = light_file(path)
    header, _ = light.read_header(kept)
    manifest = json.loads(header["__metadata__"][light.METADATA_KEY])
    assert manifest["format"] == light.LIGHT_FORMAT and "bfloat16" in manifest["dtypes"]
    assert manifest["shape"]["embed_bits"] == 8 and manifest["checkpoint_files"] == ["model.safetensors"]
    assert not any(k.startswith("embed.") for k in header)  # the table is read from the checkpoint, not copied
    assert kept.exists() and kept.with_name(kept.name.replace(".light", "")).exists()  # beside the packing


SCRIPT = """
import json, sys
import umakit
from umakit.sampling import SamplingParams
m = umakit.load(sys.argv[1], backend="torch", device="cpu", dtype="bfloat16", light_start=True)
ids = m.tokenizer.encode(sys.argv[2])
stream = m.engine.generate_tokens(ids, m.engine.make_cache(), SamplingParams(temperature=0.8, top_p=0.9), 5)
tokens = [next(stream) for _ in range(16)]
print(json.dumps({"engine": type(m.engine).__name__, "torch": "torch" in sys.modules, "tokens": tokens}))
"""


def test_a_light_start_imports_no_torch_and_gives_the_engines_tokens_at_its_threads(quantized):
    """In a process of its own, with the machine's threads (the suite runs torch on one)."""
    path = quantized("qwen3")
    full, _ = load_both(path)
    env = {**os.environ, "OMP_NUM_THREADS": "2"}
    run = subprocess.run([sys.executable, "-c", SCRIPT, str(path), TEXT], capture_output=True, text=True, env=env,
                         timeout=300)
    assert run.returncode == 0, run.stderr
    got = json.loads(run.stdout)
    assert got["engine"] == "LightEngine" and got["torch"] is False
    want = subprocess.run([sys.executable, "-c", SCRIPT.replace("light_start=True", "light_start=False"), str(path),
                           TEXT], capture_output=True, text=True, env=env, timeout=300)
    assert want.returncode == 0, want.stderr
    assert json.loads(want.stdout)["engine"] == "TorchEngine" and json.loads(want.stdout)["tokens"] == got["tokens"]


@requires_default_model
def test_umakit_generate_on_the_built_in_model_answers_alike_from_a_light_start(tmp_path):
    """The first `umakit generate` loads the full engine and keeps the light file; the second starts light."""
    env = {**os.environ, "UMAKIT_HOME": str(tmp_path / "home")}
    cmd = [str(umakit_bin()), "generate", "-p", "Name three colours.", "--max-tokens", "24", "--seed", "4"]
    probe = ("import sys\nsys.argv = {argv!r}\nfrom umakit.cli.main import main\ntry:\n    main()\n"
             "except SystemExit as e:\n    code = e.code\nprint('torch' in sys.modules, file=sys.stderr)\n"
             "sys.exit(code)")
    outs = []
    for _ in range(2):
        run = subprocess.run([sys.executable, "-c", probe.format(argv=cmd)], capture_output=True, text=True, env=env,
                             timeout=600)
        assert run.returncode == 0, run.stderr
        outs.append((run.stdout, run.stderr.strip().splitlines()[-1]))
    assert outs[0][1] == "True" and outs[1][1] == "False"  # torch imported by the first run only
    assert outs[0][0] == outs[1][0] and len(outs[0][0]) > 10


def umakit_bin():
    from pathlib import Path

    return Path(sys.executable).with_name("umakit")


INTERRUPTED = """
import json, os, signal, sys, threading
import umakit
m = umakit.load(sys.argv[1], backend="torch", device="cpu", dtype="bfloat16", light_start=True)
engine = m.engine
assert "torch" not in sys.modules
threading.Timer(0.3, lambda: os.kill(os.getpid(), signal.SIGINT)).start()  # amid importing torch
try:
    engine.torch_engine()
    out = "not interrupted"
except KeyboardInterrupt:
    out = "interrupted"
print(json.dumps({"out": out, "full": engine._full is not None, "rows": len(engine.logits(list(range(3, 45))))}))
"""


def test_ctrl_c_while_the_full_engine_loads_comes_after_it(quantized):
    """An import of torch cut short cannot be retried in that process: a chat that hands over to the full engine
    and gets Ctrl-C then must still have an engine afterwards."""
    path = quantized("llama")
    load_both(path)
    run = subprocess.run([sys.executable, "-c", INTERRUPTED, str(path)], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    assert json.loads(run.stdout) == {"out": "interrupted", "full": True, "rows": 42}


def test_a_stale_or_damaged_light_file_is_written_again(quantized):
    path = quantized("llama")
    load_both(path)
    kept = light_file(path)
    for damage in (b"not a safetensors file", kept.read_bytes().replace(b'\\"format\\": 1', b'\\"format\\": 0')):
        kept.write_bytes(damage)
        assert isinstance(umakit.load(path, backend="torch", device="cpu", dtype="bfloat16",
                                      light_start=True).engine, TorchEngine)  # passed over, and written again
        assert isinstance(umakit.load(path, backend="torch", device="cpu", dtype="bfloat16",
                                      light_start=True).engine, light.LightEngine)


def test_past_the_caches_first_growth_and_the_engines_limits_alike(quantized):
    """Across 256 positions the cache grows (cache.py's GROW_STEP, mirrored in light.cpp); the light engine's
    limits of its own (logits rows, prefill rows) are the engine's."""
    from umakit.backends.torch import cache, quant

    assert light.LOGIT_ROWS == quant.DENSE_ROWS and cache.GROW_STEP == 256  # light.cpp's constants
    full, lite = load_both(quantized("llama"))
    ids = full.tokenizer.encode(TEXT)[:20]
    assert take(lite.engine, ids, 300, SAMPLED, seed=2) == take(full.engine, ids, 300, SAMPLED, seed=2)
    cache_ = lite.engine.make_cache()
    lite.engine.prefill((ids * 20)[:light.FUSED_PREFILL_ROWS - 1], cache_)
    assert lite.engine._full is None and cache_.offset == light.FUSED_PREFILL_ROWS - 1
