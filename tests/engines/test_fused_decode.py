"""The fused CPU decode step (torch engine, fused.py): the eager step's logits for every family it covers;
its one-time C++ build (cpu/build.py): shared, waited for, refused cleanly, never half-installed."""

import contextlib
import itertools
import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest
import torch

import umakit
from umakit.backends.torch.cpu import affine_kernel, build, fused
from umakit.generate.sampling import SamplingParams

from support.markers import requires_default_model

TEXT = "It is a truth universally acknowledged, that a single man in possession of a good fortune"
# The two steps compute the same formulas from float32 values that may differ in their last bits (a norm's
# sum, an exp), and torch's int4 kernel rounds its inputs to bfloat16, so a rounding may differ here and
# there; a sign of RoPE flipped moves logits by 1-2% of the largest. The steps compare with the affine
# kernel's inputs in float32 for that reason: in int8 blocks (the CPU default where AVX512-VNNI is) a
# last-bit difference can move a code by a whole step, which these random models carry to 3% of a logit
# over 24 steps (test_int8_inputs_keep_the_steps_close).
RELATIVE = 0.005


@pytest.fixture(autouse=True)
def float32_inputs(monkeypatch):
    monkeypatch.setattr(affine_kernel, "inputs", lambda: affine_kernel.FLOAT32)


def teacher_forced(model, ids: list[int], eager: bool) -> np.ndarray:
    """Logits (n, V) of each of ``ids`` fed one decode step at a time."""
    engine = model.engine
    cache = engine.make_cache()
    with engine.eager() if eager else contextlib.nullcontext():
        return np.concatenate([engine.logits([t], cache) for t in ids])


def take(model, n: int) -> list[int]:
    """The first ``n`` greedy tokens after TEXT, end-of-sequence or not."""
    engine = model.engine
    stream = engine.generate_tokens(model.tokenizer.encode(TEXT), engine.make_cache(), SamplingParams(temperature=0))
    return list(itertools.islice(stream, n))


def assert_close(fast: np.ndarray, slow: np.ndarray, relative: float = RELATIVE) -> None:
    worst = np.abs(fast - slow).max(axis=-1) / np.abs(slow).max(axis=-1)
    assert worst.max() <= relative, f"step {worst.argmax()} differs by {worst.max():.3g} of its largest logit"


@pytest.mark.parametrize("family, bits, overrides", [
    ("llama", 4, {}),
    ("llama", 8, {}),  # every projection on two nibble planes
    ("qwen2", 4, {}),  # q/k/v biases, a tied head
    ("qwen3", 4, {}),  # q/k norms, head_dim apart from hidden/heads
    ("mistral", 4, {"sliding_window": 8}),  # the window shorter than the text
    ("llama", 4, {"head_dim": 72}),  # attention.cpp's loops: values 64 at a time, then the 8 left
])
def test_fused_step_gives_the_eager_steps_logits(quantized, family, bits, overrides):
    model = umakit.load(quantized(family, bits, **overrides), backend="torch", device="cpu", dtype="bfloat16")
    assert model.engine._fused is not None, build.reason()
    assert "fused decode step" in model.info.weights.quantization
    ids = model.tokenizer.encode(TEXT)[:40]
    assert len(ids) > 20
    assert_close(teacher_forced(model, ids, eager=False), teacher_forced(model, ids, eager=True))


@pytest.mark.parametrize("form", ["INT8", "INT8X2"])
@pytest.mark.parametrize("family, bits", [("llama", 8), ("qwen2", 4)])
def test_int8_inputs_keep_the_steps_close(quantized, family, bits, form, monkeypatch):
    if not affine_kernel.features() & affine_kernel.INT8_LOOPS:
        pytest.skip("the library is not built with int8 loops here")
    monkeypatch.setattr(affine_kernel, "inputs", lambda: getattr(affine_kernel, form))
    model = umakit.load(quantized(family, bits), backend="torch", device="cpu", dtype="bfloat16")
    ids = model.tokenizer.encode(TEXT)[:40]
    assert_close(teacher_forced(model, ids, eager=False), teacher_forced(model, ids, eager=True), relative=0.05)


def batch_logits(engine, prompts: list[list[int]], steps: int, eager: bool) -> np.ndarray:
    """Logits (steps, B, V) of a batch cache's rows, prefilled with ``prompts`` (lengths apart), each then fed
    ``steps`` tokens one step at a time; the cache keeps a spare row, as one does after a row leaves."""
    from umakit.backends.torch.batch_decoder import BatchKVCache

    a = engine.args
    cache = BatchKVCache(a.num_hidden_layers, a.num_key_value_heads, a.head_dim, a.max_position_embeddings,
                         engine.cache_dtype, engine.torch_device)
    lengths = [len(p) for p in prompts]
    cache.reserve(len(prompts) + 1, max(lengths) + steps, 0)
    out = []
    with torch.inference_mode(), engine.eager() if eager else contextlib.nullcontext():
        for i, p in enumerate(prompts):
            single = engine.make_cache()
            engine.prefill(p, single)
            cache.put(i, single)
        for step in range(steps):
            tokens = torch.tensor([[p[(step * 7 + i) % len(p)]] for i, p in enumerate(prompts)])
            out.append(engine._decode_rows(tokens, lengths, cache, max(lengths) + 1).float().numpy())
            lengths = [n + 1 for n in lengths]
    return np.stack(out)


@pytest.mark.parametrize("family, bits, overrides", [
    ("llama", 4, {}),
    ("llama", 8, {}),
    ("qwen2", 4, {}),
    ("qwen3", 4, {}),
    ("mistral", 4, {"sliding_window": 8}),  # rows before and past their window, in one step
])
def test_fused_batch_step_gives_the_eager_batch_steps_logits(quantized, family, bits, overrides):
    model = umakit.load(quantized(family, bits, **overrides), backend="torch", device="cpu", dtype="bfloat16")
    engine = model.engine
    assert engine._fused is not None, build.reason()
    ids = model.tokenizer.encode(TEXT)
    prompts = [ids[:5], ids[:19], ids[3:14]]
    for rows in (prompts, prompts[1:2]):  # several rows (masked keys), one row (its keys narrowed)
        fast, slow = batch_logits(engine, rows, 6, eager=False), batch_logits(engine, rows, 6, eager=True)
        assert fast.shape == (6, len(rows), engine.args.vocab_size)
        assert_close(fast.reshape(-1, fast.shape[-1]), slow.reshape(-1, slow.shape[-1]))


@pytest.mark.parametrize("family, bits, overrides", [
    ("llama", 8, {}),
    ("qwen2", 4, {}),
    ("qwen3", 4, {}),
    ("mistral", 4, {"sliding_window": 8}),
])
def test_tokens_of_one_sequence_and_rows_of_a_batch_get_their_single_steps_bits(quantized, family, bits, overrides,
                                                                               monkeypatch):
    """`logits` of T tokens (a speculative verification) and a batch step, row for row, bit for bit as the
    decode steps each row would have had alone: so speculation accepts what plain decoding picks, and a batch
    row is its lone run."""
    model = umakit.load(quantized(family, bits, **overrides), backend="torch", device="cpu", dtype="bfloat16")
    engine = model.engine
    ids = model.tokenizer.encode(TEXT)
    calls = []
    real = fused.FusedDecoder.__call__
    monkeypatch.setattr(fused.FusedDecoder, "__call__", lambda self, t, c: calls.append(t.numel()) or real(self, t, c))
    cache, alone = engine.make_cache(), engine.make_cache()
    engine.prefill(ids[:9], cache)
    engine.prefill(ids[:9], alone)
    block = ids[9:9 + 7]  # crosses the mistral window
    together = engine.logits(block, cache)
    steps = np.concatenate([engine.logits([t], alone) for t in block])
    assert calls == [7] + [1] * 7 and np.array_equal(together, steps)
    assert cache.offset == alone.offset == 16
    prompts = [ids[:5], ids[:19], ids[3:14]]
    rows = batch_logits(engine, prompts, 4, eager=False)  # (steps, B, V)
    for b, p in enumerate(prompts):
        single = engine.make_cache()
        engine.prefill(p, single)
        fed = [p[(step * 7 + b) % len(p)] for step in range(4)]
        assert np.array_equal(rows[:, b], np.concatenate([engine.logits([t], single) for t in fed])), b


@requires_default_model
def test_speculation_on_the_cpu_default_gives_plain_decodings_text(monkeypatch):
    """On the built-in model's int4 default, greedy prompt lookup once gave other text than plain decoding
    on two of these prompts: its verification ran the eager multi-token forward, plain decoding the fused step."""
    model = umakit.load(backend="torch", device="cpu")
    if fused.covers(model.engine.model):  # the default's layers here (not on a CPU whose default is float16)
        assert model.engine._fused is not None, build.reason()
    for prompt in ("What are three good habits for learning a new language? Explain each briefly.",
                   "Describe a walk through a forest in autumn."):
        plain = model.generate(prompt, max_tokens=128, temperature=0)
        spec = model.generate(prompt, max_tokens=128, temperature=0, prompt_lookup=True)
        assert spec.tokens == plain.tokens and spec.text == plain.text, prompt


def test_the_batch_decoder_runs_on_the_fused_step(quantized, monkeypatch):
    """Rows that join and leave mid-run: each step goes through the fused rows call, and the greedy tokens
    match those of a single-sequence run of the same prompt."""
    from umakit.backends.base import BatchRow

    model = umakit.load(quantized("llama"), backend="torch", device="cpu", dtype="bfloat16")
    engine = model.engine
    calls = []
    real = fused.FusedDecoder.rows
    monkeypatch.setattr(fused.FusedDecoder, "rows", lambda self, *a: calls.append(len(a[1])) or real(self, *a))
    ids = model.tokenizer.encode(TEXT)
    prompts = {0: ids[:6], 1: ids[:17], 2: ids[2:11]}
    greedy = SamplingParams(temperature=0)
    dec = engine.batch_decoder()
    dec.add([BatchRow(0, prompts[0], greedy), BatchRow(1, prompts[1], greedy)])
    got = {0: [], 1: [], 2: []}
    for step in range(10):
        if step == 3:
            dec.add([BatchRow(2, prompts[2], greedy)])
        if step == 6:
            dec.remove([0])
        for rid, token in dec.step():
            got[rid].append(token)
    assert calls == [2, 2, 2, 3, 3, 3, 2, 2, 2, 2]
    for rid, tokens in got.items():
        stream = engine.generate_tokens(prompts[rid], engine.make_cache(), greedy)
        assert tokens == list(itertools.islice(stream, len(tokens))), rid


def test_fused_step_follows_the_cache_as_it_grows(quantized):
    """Past 256 tokens the cache moves to a larger buffer; the fused step reads the new one."""
    model = umakit.load(quantized("llama"), backend="torch", device="cpu", dtype="bfloat16")
    engine = model.engine
    ids = (model.tokenizer.encode(TEXT) * 30)[:300]
    got, want = engine.make_cache(), engine.make_cache()
    engine.prefill(ids[:250], got)
    engine.prefill(ids[:250], want)
    fast = np.concatenate([engine.logits([t], got) for t in ids[250:]])
    with engine.eager():
        slow = np.concatenate([engine.logits([t], want) for t in ids[250:]])
    assert got.capacity > 256 and got.offset == want.offset == 300
    assert_close(fast, slow)


def test_generation_runs_on_the_fused_step(quantized, monkeypatch):
    model = umakit.load(quantized("llama"), backend="torch", device="cpu", dtype="bfloat16")
    calls = []
    real = fused.FusedDecoder.__call__
    monkeypatch.setattr(fused.FusedDecoder, "__call__", lambda self, t, c: calls.append(1) or real(self, t, c))
    assert len(take(model, 12)) == 12 and len(calls) == 12  # every step, the first token's too


def test_a_hooked_layer_runs_eagerly(quantized):
    """A sharded engine all-reduces in forward hooks on attention and the MLP: the fused step would skip them."""
    model = umakit.load(quantized("llama"), backend="torch", device="cpu", dtype="bfloat16")
    engine = model.engine
    ids = model.tokenizer.encode(TEXT)[:12]
    want = teacher_forced(model, ids, eager=True)
    seen = []
    block = engine.model.model.layers[1]
    block.mlp.register_forward_hook(lambda m, i, out: seen.append(1) or out * 2)
    got = teacher_forced(model, ids, eager=False)
    assert len(seen) == len(ids) and "fused" not in engine.weight_info().quantization
    assert np.abs(got - want).max() > RELATIVE * np.abs(want).max()  # the hook's doubling shows


@pytest.mark.parametrize("family, dtype", [("gemma3", "bfloat16"), ("mixtral", "bfloat16"), ("llama", "float32"),
                                           ("llama", "float16")])
def test_what_the_fused_step_does_not_cover_runs_eagerly(quantized, family, dtype):
    if dtype == "float16" and "fbgemm" not in torch.backends.quantized.supported_engines:
        pytest.skip("float16 weights with float32 math need FBGEMM (x86)")
    model = umakit.load(quantized(family), backend="torch", device="cpu", dtype=dtype)
    assert not fused.covers(model.engine.model) and model.engine._fused is None
    assert "fused" not in model.info.weights.quantization
    assert len(take(model, 4)) == 4


# -- the build ---------------------------------------------------------------------
@pytest.fixture
def fresh_state(monkeypatch, tmp_path):
    """build's per-process answer forgotten, and an empty build cache."""
    monkeypatch.setitem(build._state, "ready", None)
    monkeypatch.setitem(build._state, "reason", "")
    monkeypatch.setenv("UMAKIT_NATIVE_DIR", str(tmp_path / "native"))
    return tmp_path / "native"


needs_compiler = pytest.mark.skipif(build.compiler() is None, reason="no C++ compiler here")


@needs_compiler
def test_a_failing_compiler_leaves_its_log_and_no_library(fresh_state, monkeypatch, tmp_path):
    """A compiler that answers --version but fails to compile: its words kept in build.log, no library."""
    real, failing = build.compiler(), tmp_path / "cxx"
    failing.write_text(f'#!/bin/sh\n[ "$1" = "--version" ] && exec {real} --version\n'
                       "echo 'fatal error: no such header' >&2\nexit 3\n")
    failing.chmod(0o755)
    monkeypatch.setenv("CXX", str(failing))
    assert build.ensure() is False
    assert "the C++ build failed" in build.reason()
    (log,) = fresh_state.glob(f"*/{build.LOG}")
    assert "fatal error: no such header" in log.read_text() and str(log) in build.reason()
    assert not list(fresh_state.glob(f"*/{build.NAME}*.so"))
    monkeypatch.setitem(build._state, "ready", None)  # the next start does not compile again
    failing.write_text(f'#!/bin/sh\n[ "$1" = "--version" ] && exec {real} --version\n'
                       f"touch {tmp_path / 'ran'}\nexit 3\n")
    assert build.ensure() is False and "failed earlier" in build.reason() and str(log) in build.reason()
    assert not (tmp_path / "ran").exists()
    log.unlink()  # removed: the next start tries again
    monkeypatch.setitem(build._state, "ready", None)
    from torch.utils import cpp_extension  # a start is a new process: cpp_extension's memory of this build goes

    monkeypatch.setattr(cpp_extension.JIT_EXTENSION_VERSIONER, "entries", {})
    assert build.ensure() is False and (tmp_path / "ran").exists()


def test_no_compiler_no_ninja_and_the_switch_off_are_reasons(fresh_state, monkeypatch):
    monkeypatch.setenv("CXX", "/nonexistent/c++")
    assert build.ensure() is False and "no C++ compiler" in build.reason()
    monkeypatch.delenv("CXX")
    monkeypatch.setitem(build._state, "ready", None)
    monkeypatch.setattr(build, "_ninja_dir", lambda: None)
    assert build.ensure() is False and build.reason() == "ninja is missing: pip install ninja"
    monkeypatch.setitem(build._state, "ready", None)
    monkeypatch.setenv("UMAKIT_NO_NATIVE", "1")
    assert build.ensure() is False and build.reason() == "UMAKIT_NO_NATIVE is set"


def test_without_the_library_the_engine_says_so_and_runs_eagerly(quantized, monkeypatch):
    monkeypatch.setitem(build._state, "ready", False)
    monkeypatch.setitem(build._state, "reason", "no C++ compiler: set CXX, or install g++ or clang++")
    model = umakit.load(quantized("llama"), backend="torch", device="cpu", dtype="bfloat16")
    assert model.engine._fused is None
    assert any("run eagerly" in w and "no C++ compiler" in w for w in model.info.warnings)
    assert len(take(model, 4)) == 4
    monkeypatch.setenv("UMAKIT_NO_NATIVE", "1")  # asked for: nothing to warn about
    assert umakit.load(quantized("llama"), backend="torch", device="cpu", dtype="bfloat16").info.warnings == []


BUILD = """
import json, sys, time
from umakit.backends.torch.cpu import build
t = time.perf_counter()
ok = build.ensure()
print(json.dumps({"ok": ok, "reason": build.reason(), "s": time.perf_counter() - t}))
"""


@needs_compiler
def test_two_processes_share_one_build_and_a_third_reuses_it(tmp_path, monkeypatch):
    """One compiles, the other waits for it; a later start loads the library as is. cpp_extension's own lock
    file, left behind by a build that was killed (it waits on one for ever), does not hold either up."""
    env = {**os.environ, "UMAKIT_NATIVE_DIR": str(tmp_path / "native")}
    env.pop("UMAKIT_NO_NATIVE", None)
    monkeypatch.setenv("UMAKIT_NATIVE_DIR", env["UMAKIT_NATIVE_DIR"])
    killed = build.build_dir(build.compiler())
    killed.mkdir(parents=True)
    (killed / build.BATON).touch()
    both = [subprocess.Popen([sys.executable, "-c", BUILD], env=env, stdout=subprocess.PIPE, text=True)
            for _ in range(2)]
    results = [json.loads(p.communicate(timeout=600)[0]) for p in both]
    assert all(r["ok"] for r in results), results
    (built,) = [p for p in (tmp_path / "native").iterdir() if p.is_dir()]
    (library,) = built.glob(f"{build.NAME}*.so")
    assert built == killed and library.name == f"{build.NAME}.so" and not (built / build.BATON).exists()
    stamp = library.stat().st_mtime_ns
    again = json.loads(subprocess.run([sys.executable, "-c", BUILD], env=env, capture_output=True, text=True,
                                      check=True).stdout)
    assert again["ok"] and library.stat().st_mtime_ns == stamp  # loaded, not rebuilt


def test_a_changed_source_torch_or_compiler_builds_elsewhere(monkeypatch, tmp_path):
    cxx = build.compiler() or "/usr/bin/c++"
    monkeypatch.setenv("UMAKIT_NATIVE_DIR", str(tmp_path))
    first = build.build_dir(cxx)
    changed = tmp_path / "csrc"
    shutil.copytree(build.CSRC, changed)
    with monkeypatch.context() as m:
        m.setattr(build, "CSRC", changed)
        assert build.build_dir(cxx) == first
        header = changed / "affine.h"  # any file of the sources, headers too
        header.write_text(header.read_text() + "\n// changed\n")
        assert build.build_dir(cxx) != first
    assert build.build_dir(cxx) == first
    assert build.build_dir("/usr/bin/clang++") != first
    monkeypatch.setattr(torch, "__version__", "0.0.0")
    assert build.build_dir(cxx) != first
