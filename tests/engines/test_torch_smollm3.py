"""smollm3 on the torch engine's compact code (llama's, with RoPE left out of every fourth layer, as its
``no_rope_layers`` says): logits and greedy tokens against transformers, float32 and 4-bit, batch rows against
lone runs, and "auto" taking the torch engine for it."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import umakit
from support.oracle import batched_prompts, greedy_reference, ref_logits, reference, sequential
from support.tiny import VOCAB, write_tokenizer
from umakit.generate.sampling import SamplingParams

transformers = pytest.importorskip("transformers")

PROMPT = [(7 * i) % 400 + 3 for i in range(40)]


@pytest.fixture(scope="module")
def smollm3(tmp_path_factory):
    config = transformers.SmolLM3Config(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, max_position_embeddings=512, num_hidden_layers=4, no_rope_layers=[1, 1, 1, 0],
        bos_token_id=1, eos_token_id=2, pad_token_id=0)
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("smollm3")
    transformers.SmolLM3ForCausalLM(config).save_pretrained(path, safe_serialization=True)
    write_tokenizer(path)
    return path


def test_smollm3_runs_on_the_compact_code_as_transformers_runs_it(smollm3):
    model = umakit.load(smollm3, dtype="float32")
    assert model.info.backend == "torch" and not model.info.warnings
    assert model.engine.model.args.nope_layers == (3,)
    ref = reference(smollm3)
    np.testing.assert_allclose(model.logits(PROMPT), ref_logits(ref, PROMPT), atol=1e-4, rtol=1e-4)
    ours = model.engine.generate_tokens(PROMPT, model.make_cache(), SamplingParams(temperature=0))
    assert [next(ours) for _ in range(12)] == greedy_reference(ref, PROMPT, 12)


def test_a_4_bit_smollm3_decodes_as_its_float_twin_on_its_packed_forms(smollm3, tmp_path):
    """`umakit quantize`'s 4-bit form, on the CPU default (packed kernels, the fused decode step leaving RoPE out
    of the layers that have none), against the same quantized weights in float32."""
    from click.testing import CliRunner

    from umakit.cli.main import main

    out = tmp_path / "q4"
    result = CliRunner().invoke(main, ["quantize", str(smollm3), "-o", str(out), "--bits", "4", "--group-size", "32"])
    assert result.exit_code == 0, result.output
    packed = umakit.load(out, backend="torch", device="cpu")
    exact = umakit.load(out, backend="torch", device="cpu", dtype="float32")
    assert packed.engine._fused is not None
    ours = packed.engine.generate_tokens(PROMPT, packed.make_cache(), SamplingParams(temperature=0))
    want = exact.engine.generate_tokens(PROMPT, exact.make_cache(), SamplingParams(temperature=0))
    assert [next(ours) for _ in range(12)] == [next(want) for _ in range(12)]


def test_smollm3_batch_rows_are_their_lone_runs(smollm3):
    model = umakit.load(smollm3, backend="torch", dtype="float32")
    prompts = ["the cat sat on the mat", "a b c d e f g h", "hello world " * 5]
    expected = sequential(model, prompts, max_tokens=16, temperature=0)
    run = model.generate_batch(batched_prompts(prompts), max_tokens=16, temperature=0, batch_size=2, raw=True)
    assert [r.tokens for r in run] == [r.tokens for r in expected]


def test_the_fused_step_leaves_rope_out_where_the_eager_step_does(smollm3, tmp_path):
    from click.testing import CliRunner

    from umakit.cli.main import main

    out = tmp_path / "q4"
    assert CliRunner().invoke(main, ["quantize", str(smollm3), "-o", str(out), "--bits", "4"]).exit_code == 0
    packed = umakit.load(out, backend="torch", device="cpu")
    # fewer than 32 tokens: each its own fused decode step; and fewer than the eager pass's bfloat16 GEMMs' 16,
    # so both multiply on the kernel
    fused = packed.logits(PROMPT[:12])
    with packed.engine.eager():
        eager = packed.logits(PROMPT[:12])
    np.testing.assert_allclose(fused, eager, atol=1e-4, rtol=1e-4)


def test_a_config_without_the_list_takes_every_interval_th_layer_as_transformers_does():
    from umakit.backends.torch.model.rope import nope_layers

    assert nope_layers({"num_hidden_layers": 8, "no_rope_layers": None}) == (3, 7)
    assert nope_layers({"num_hidden_layers": 6, "no_rope_layer_interval": 3}) == (2, 5)
    want = transformers.SmolLM3Config(num_hidden_layers=8, no_rope_layer_interval=2).no_rope_layers
    assert nope_layers({"num_hidden_layers": 8, "no_rope_layers": want}) == (1, 3, 5, 7)
