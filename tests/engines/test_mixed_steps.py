"""A decode step that carries a waiting prompt's slice in the rows' own forward pass (`BatchDecoder.step(prefill=)`
with ``batch_decoder(mixed=True)``, `umakit serve --mixed-steps`), on the torch engine: the families whose layers
take the mixed pass, a quantized cache, and a quantized model whose rows otherwise take the fused CPU step."""

from __future__ import annotations

import numpy as np
import pytest

import umakit
from umakit.backends.base import BatchRow
from umakit.errors import InvalidArgumentError
from umakit.generate.sampling import SamplingParams
from support.tiny import make_tiny_model

GREEDY = SamplingParams(temperature=0)
ROWS = [[5, 17, 42, 99, 3, 250, 7, 64, 11], [9, 8, 7], [30, 31, 32, 33, 34, 35, 36, 37, 38, 39, 40, 41, 42, 43]]
NEW = [12, 200, 45, 6, 77, 310, 2, 18, 90, 91, 4, 150, 33, 8, 21, 60, 61]  # the prompt prefilled beside them
SLICES = [(0, 6), (6, 7), (7, len(NEW) - 1)]  # its slices: several tokens, one, the rest but its last


def _serve(engine, mixed: bool, kv_bits: int | None = None, logprobs: int | None = None):
    """Rows decode while NEW is prefilled in slices beside them, then NEW joins: every step's tokens (and, with
    ``logprobs``, the rows' figures at the slices' steps), and NEW's cache once its slices are in."""
    decoder = engine.batch_decoder(kv_bits, mixed=mixed)
    assert decoder.mixes is mixed
    decoder.add([BatchRow(i, p, GREEDY, logprobs=logprobs) for i, p in enumerate(ROWS)])
    steps, figures = [decoder.step()], []
    cache = engine.make_cache(kv_bits)
    for lo, hi in SLICES:
        steps.append(decoder.step((NEW[lo:hi], cache)))
        figures.append(decoder.logprobs())
    assert cache.offset == len(NEW) - 1
    continued = engine.logits(NEW[-1:], cache.copy(cache.offset))
    decoder.add([BatchRow(9, NEW, GREEDY, cache=cache)])
    steps += [decoder.step() for _ in range(6)]
    return steps, figures, continued


def _spied(engine, monkeypatch) -> dict:
    """Count the engine's mixed passes, and note its prefill passes (a slice must ride in the rows' pass)."""
    calls = {"mixed": 0, "prefilled": []}
    mixed, prefill = engine.model.mixed, engine.prefill

    def counted(*args):
        calls["mixed"] += 1
        return mixed(*args)

    def noted(tokens, cache):
        calls["prefilled"].append(list(tokens))
        return prefill(tokens, cache)

    monkeypatch.setattr(engine.model, "mixed", counted)
    monkeypatch.setattr(engine, "prefill", noted)
    return calls


def _mixed_only(calls) -> bool:
    return calls["mixed"] == len(SLICES) and not any(t in calls["prefilled"] for t in (NEW[a:b] for a, b in SLICES))


@pytest.mark.parametrize("family", ["llama", "qwen3", "gemma3", "mixtral", "qwen3_moe"])
def test_a_mixed_step_gives_the_separate_steps_tokens_and_cache(torch_models, family, monkeypatch):
    """q/k norms (qwen3), sliding windows and per-layer RoPE (gemma3, past its window of 8), routed experts."""
    engine = torch_models(family).engine
    apart, _, apart_next = _serve(engine, mixed=False)
    calls = _spied(engine, monkeypatch)
    together, _, together_next = _serve(engine, mixed=True)
    assert _mixed_only(calls)
    assert together == apart
    np.testing.assert_allclose(together_next, apart_next, atol=1e-4, rtol=1e-4)


def test_a_mixed_step_with_attention_sinks_and_rope_left_out(tmp_path, monkeypatch):
    """gpt-oss (sinks, sliding layers, MXFP4 experts) and smollm3 (layers without RoPE)."""
    import torch
    import transformers
    from support import mxfp4
    from support.tiny import VOCAB, write_tokenizer

    config = transformers.SmolLM3Config(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, max_position_embeddings=512, num_hidden_layers=2, no_rope_layers=[1, 0], bos_token_id=1,
        eos_token_id=2, pad_token_id=0)
    torch.manual_seed(0)
    transformers.SmolLM3ForCausalLM(config).save_pretrained(tmp_path / "smollm3", safe_serialization=True)
    write_tokenizer(tmp_path / "smollm3")
    for path in (mxfp4.write(tmp_path / "gpt_oss", seed=1), tmp_path / "smollm3"):
        engine = umakit.load(path, backend="torch", device="cpu", dtype="float32").engine
        apart, _, apart_next = _serve(engine, mixed=False)
        with monkeypatch.context() as m:
            calls = _spied(engine, m)
            together, _, together_next = _serve(engine, mixed=True)
        assert _mixed_only(calls) and together == apart, path.name
        np.testing.assert_allclose(together_next, apart_next, atol=1e-4, rtol=1e-4)


def test_a_mixed_step_on_a_quantized_cache(tmp_path, monkeypatch):
    wide = make_tiny_model("llama", tmp_path, hidden_size=128, num_attention_heads=2, num_key_value_heads=1)
    engine = umakit.load(wide, backend="torch", device="cpu", dtype="float32").engine  # heads one KV group wide
    apart, _, apart_next = _serve(engine, mixed=False, kv_bits=8)
    calls = _spied(engine, monkeypatch)
    together, _, together_next = _serve(engine, mixed=True, kv_bits=8)
    assert _mixed_only(calls) and together == apart
    np.testing.assert_allclose(together_next, apart_next, atol=1e-4, rtol=1e-4)


def test_a_mixed_step_leaves_the_fused_cpu_step_for_one_pass(quantized, monkeypatch):
    """A 4-bit model on the CPU default: a plain step is the fused one, a mixed step the eager pass for rows and
    slice; the rows' distributions and the slice's cache match the separate steps' within the forms' rounding."""
    engine = umakit.load(quantized("llama"), backend="torch", device="cpu", dtype="bfloat16").engine
    if engine._fusing() is None:
        pytest.skip("no fused CPU step here (no C++ compiler)")
    apart, apart_figures, apart_next = _serve(engine, mixed=False, logprobs=3)
    calls = _spied(engine, monkeypatch)
    together, together_figures, together_next = _serve(engine, mixed=True, logprobs=3)
    assert _mixed_only(calls) and len(together) == len(apart)
    for a, b in zip(apart_figures, together_figures):
        assert a.keys() == b.keys() == {0, 1, 2}
        for row in a:
            np.testing.assert_allclose([p for _, p in a[row][1]], [p for _, p in b[row][1]], atol=0.05)
    np.testing.assert_allclose(together_next, apart_next, atol=0.05 * np.abs(apart_next).max())


def test_where_mixing_is_asked_of_a_model_that_cannot(torch_models, tiny_dir):
    """Off by default on a CPU (each row keeps its lone step's bits); gemma4's own layers refuse it by name."""
    assert torch_models("llama").engine.batch_decoder().mixes is False
    config = dict(umakit.load(tiny_dir("llama"), backend="torch", dtype="float32").engine.config)
    gemma4 = {**config, "model_type": "gemma4_text", "head_dim": 16, "global_head_dim": 16, "sliding_window": 8,
              "layer_types": ["sliding_attention", "full_attention"], "hidden_activation": "gelu_pytorch_tanh"}
    engine = umakit.load_synthetic(gemma4, backend="torch", device="cpu", dtype="float32").engine
    with pytest.raises(InvalidArgumentError, match="--mixed-steps"):
        engine.batch_decoder(mixed=True)
    assert engine.batch_decoder().mixes is False


@pytest.mark.parametrize("backend", ["mlx", "transformers"])
def test_serve_refuses_mixed_steps_on_an_engine_without_them(tiny_dir, backend):
    from click.testing import CliRunner

    from umakit.cli.main import main

    r = CliRunner().invoke(main, ["serve", str(tiny_dir("llama")), "--backend", backend, "--mixed-steps",
                                  "--port", "0"])
    assert r.exit_code != 0 and "Traceback" not in r.output
    assert r.output.strip().splitlines()[-1] == f"Error: the {backend} backend does not support --mixed-steps yet; " \
                                                "use --backend torch"


def test_the_gpu_checks_mixed_steps_run_here_on_the_cpu(monkeypatch):
    """benchmarks/gpu_check.py's mixed-step check, on the CPU in float32 with a one-layer preset: its checks pass
    and its preset resolves (the run on a GPU must not be the first to find a broken path)."""
    import sys
    from pathlib import Path

    import torch

    import umakit.plan.sources as sources

    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[2] / "benchmarks"))
    import gpu_check

    real = sources.load_preset
    assert real("llama-3-8b")["num_hidden_layers"] == 32
    monkeypatch.setattr(sources, "load_preset", lambda name: dict(
        real(name), num_hidden_layers=1, hidden_size=256, intermediate_size=512, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=1024))
    report = gpu_check.Report()
    with torch.inference_mode():
        gpu_check.check_mixed_steps(report, device="cpu", dtype="float32")
    assert not report.failed() and len(report.checks) == 5, report.markdown("cpu")
    sys.modules.pop("gpu_check", None)
