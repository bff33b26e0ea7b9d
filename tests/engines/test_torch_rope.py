"""RoPE kinds on the torch engine against transformers: yarn's, dynamic's and longrope's inverse frequencies and
attention factors against transformers' own ``rope_init_fn``, and tiny models' logits and greedy tokens against
transformers at positions far past their original context."""

import numpy as np
import pytest
import torch

import umakit
from support.oracle import ref_logits, reference
from support.tiny import make_tiny_model
from umakit.backends.torch.model.rope import _inv_freq, rope_attention_factor
from umakit.errors import UnsupportedModelError
from umakit.generate.sampling import SamplingParams

transformers = pytest.importorskip("transformers")

YARN = [
    {"factor": 4.0, "original_max_position_embeddings": 32},
    {"factor": 8.0, "original_max_position_embeddings": 64, "beta_fast": 16, "beta_slow": 2},
    {"factor": 4.0, "original_max_position_embeddings": 32, "mscale": 0.707, "mscale_all_dim": 1.0},  # DeepSeek's
    {"factor": 2.0, "original_max_position_embeddings": 64, "attention_factor": 1.3, "truncate": False},
    {"factor": None, "original_max_position_embeddings": 32},  # the factor from max_position_embeddings
]


@pytest.mark.parametrize("params", YARN, ids=range(len(YARN)))
@pytest.mark.parametrize("head_dim", [16, 64])
def test_yarn_frequencies_and_factor_are_transformers(params, head_dim):
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    rope = {"rope_type": "yarn", "rope_theta": 10000.0, **params}
    config = transformers.Qwen3Config(hidden_size=4 * head_dim, num_attention_heads=4, num_key_value_heads=2,
                                      head_dim=head_dim, max_position_embeddings=256, rope_parameters=rope)
    want, factor = ROPE_INIT_FUNCTIONS["yarn"](config, "cpu")
    torch.testing.assert_close(_inv_freq(head_dim, 10000.0, rope, 256), want, atol=1e-7, rtol=1e-6)
    assert rope_attention_factor(rope, 256) == pytest.approx(factor, rel=1e-12)


def test_other_kinds_are_refused_by_name():
    with pytest.raises(UnsupportedModelError, match="'mrope' is not supported on the torch engine"):
        _inv_freq(16, 10000.0, {"rope_type": "mrope"})


@pytest.fixture(scope="module")
def yarn_model(tmp_path_factory):
    rope = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 32}
    return make_tiny_model("qwen3", tmp_path_factory.mktemp("yarn"), max_position_embeddings=256,
                           rope_parameters=rope)


def test_a_yarn_model_runs_as_transformers_runs_it_past_its_original_context(yarn_model):
    model = umakit.load(yarn_model, backend="torch", dtype="float32")
    ref = reference(yarn_model)
    prompt = [(7 * i) % 90 + 3 for i in range(100)]  # positions up to 3x the original 32
    np.testing.assert_allclose(model.logits(prompt), ref_logits(ref, prompt), atol=1e-4, rtol=1e-4)
    ours = model.engine.generate_tokens(prompt, model.make_cache(), SamplingParams(temperature=0))
    ours = [next(ours) for _ in range(16)]
    seq = list(prompt)
    for _ in range(16):
        seq.append(int(ref_logits(ref, seq)[-1].argmax()))
    assert ours == seq[len(prompt):]


@pytest.mark.parametrize("family, reads", [("qwen3_moe", False), ("mixtral", False), ("qwen3", True)])
def test_an_mlx_model_file_that_never_reads_rope_scaling_is_refused_not_run_unscaled(family, reads, tmp_path):
    """mlx-lm's qwen3_moe.py and mixtral.py declare rope_scaling and never apply it: such a checkpoint is refused on
    MLX, pointing at the torch engine, which runs it as transformers does."""
    pytest.importorskip("mlx_lm")
    rope = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 32}
    path = make_tiny_model(family, tmp_path, max_position_embeddings=256, rope_parameters=rope, head_dim=16)
    prompt = [(7 * i) % 90 + 3 for i in range(40)]
    if reads:
        assert umakit.load(path, backend="mlx", device="cpu", dtype="float32").logits(prompt).shape[0] == 40
    else:
        with pytest.raises(UnsupportedModelError, match=f"mlx-lm's {family} model never reads rope_scaling.*yarn"):
            umakit.load(path, backend="mlx", device="cpu", dtype="float32")
    np.testing.assert_allclose(umakit.load(path, backend="torch", dtype="float32").logits(prompt),
                               ref_logits(reference(path), prompt), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("factor", [2.0, 4.0])
@pytest.mark.parametrize("head_dim", [16, 64])
def test_dynamic_frequencies_are_transformers_at_every_length(factor, head_dim):
    from types import SimpleNamespace

    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from umakit.backends.torch.model.rope import dynamic_inv_freq

    rope = {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": factor}
    config = transformers.LlamaConfig(hidden_size=4 * head_dim, num_attention_heads=4, num_key_value_heads=2,
                                      head_dim=head_dim, max_position_embeddings=32, rope_parameters=rope)
    args = SimpleNamespace(rope_original=32, rope_scaling=rope, head_dim=head_dim, rope_theta=10000.0)
    at_rest = _inv_freq(head_dim, 10000.0, rope, 32)
    torch.testing.assert_close(at_rest, ROPE_INIT_FUNCTIONS["dynamic"](config, "cpu")[0], atol=1e-7, rtol=1e-6)
    for n in (8, 32, 33, 48, 100, 1000):
        want = ROPE_INIT_FUNCTIONS["dynamic"](config, "cpu", seq_len=n)[0]
        prompt = dynamic_inv_freq(args, at_rest, torch.arange(n), rows=False)  # a prompt of n tokens
        rows = dynamic_inv_freq(args, at_rest, torch.tensor([n - 1, 3]), rows=True)  # a batch: row 0 at n - 1
        torch.testing.assert_close(prompt.reshape(-1, head_dim // 2)[0], want, atol=1e-7, rtol=1e-6)
        torch.testing.assert_close(rows.reshape(-1, head_dim // 2)[0], want, atol=1e-7, rtol=1e-6)


@pytest.fixture(scope="module")
def dynamic_model(tmp_path_factory):
    rope = {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 4.0}  # a context of 4 x 32 tokens
    return make_tiny_model("llama", tmp_path_factory.mktemp("dynamic"), max_position_embeddings=32,
                           rope_parameters=rope)


def test_a_dynamic_rope_model_runs_as_transformers_runs_it_past_its_original_context(dynamic_model):
    """The prompt's logits against transformers' forward over it; greedy decoding against transformers' decode
    steps on its own cache (each step's frequencies for its own length, the cached keys as written)."""
    model = umakit.load(dynamic_model, backend="torch", dtype="float32")
    assert model.info.context_length == 128 and model.engine._fused is None
    prompt = [(7 * i) % 90 + 3 for i in range(60)]  # positions up to three times the original 32
    np.testing.assert_allclose(model.logits(prompt), ref_logits(reference(dynamic_model), prompt), atol=1e-4,
                               rtol=1e-4)
    ours = model.engine.generate_tokens(prompt, model.make_cache(), SamplingParams(temperature=0))
    ours = [next(ours) for _ in range(16)]
    ref = transformers.AutoModelForCausalLM.from_pretrained(dynamic_model, dtype=torch.float32)
    theirs, step = [], ref(torch.tensor([prompt]), use_cache=True)
    with torch.no_grad():
        for _ in range(16):  # transformers' decode steps on its cache, without generate's EOS handling
            theirs.append(int(step.logits[0, -1].argmax()))
            step = ref(torch.tensor([theirs[-1:]]), cache=step.past_key_values, use_cache=True)
    assert ours == theirs


def test_dynamic_rope_batch_rows_are_their_lone_runs(dynamic_model):
    """Each row of a batch takes the frequencies of its own length, as its lone run's decode steps do (transformers
    would give a batch those of its longest row)."""
    from support.oracle import batched_prompts, sequential

    from umakit.generate.batch import generate_batch

    model = umakit.load(dynamic_model, backend="torch", dtype="float32")
    prompts = ["the cat sat on the mat " * 3, "a b c d e f g h i j k l " * 4, "hello world"]
    expected = sequential(model, prompts, max_tokens=40, temperature=0)
    run = generate_batch(model, batched_prompts(prompts), max_tokens=40, sampling=SamplingParams(temperature=0),
                         batch_size=3, raw=True)
    assert any(len(model.tokenizer.encode(p)) + 40 > 32 for p in prompts)
    assert [r.tokens for r in run] == [r.tokens for r in expected]


LONGROPE = {"rope_type": "longrope", "rope_theta": 10000.0, "original_max_position_embeddings": 32,
            "short_factor": [1.0 + 0.1 * i for i in range(8)], "long_factor": [1.0 + 0.9 * i for i in range(8)]}


@pytest.mark.parametrize("extra", [{}, {"attention_factor": 1.2}, {"factor": 3.0}])
def test_longrope_frequencies_and_factor_are_transformers_at_every_length(extra):
    from types import SimpleNamespace

    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from umakit.backends.torch.model.rope import dynamic_inv_freq

    rope = {**LONGROPE, **extra}
    config = transformers.LlamaConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                      max_position_embeddings=128, rope_parameters=dict(rope))
    args = SimpleNamespace(rope_original=32, rope_scaling=rope, head_dim=16, rope_theta=10000.0)
    at_rest = _inv_freq(16, 10000.0, rope, 128)
    short, factor = ROPE_INIT_FUNCTIONS["longrope"](config, "cpu")
    torch.testing.assert_close(at_rest, short, atol=1e-7, rtol=1e-6)
    assert rope_attention_factor(rope, 128) == pytest.approx(factor, rel=1e-12)
    for n in (8, 32, 33, 100):
        want = ROPE_INIT_FUNCTIONS["longrope"](config, "cpu", seq_len=n)[0]
        got = dynamic_inv_freq(args, at_rest, torch.arange(n), rows=False).reshape(-1, 8)[0]
        torch.testing.assert_close(got, want, atol=1e-7, rtol=1e-6)


def test_a_longrope_model_runs_as_transformers_runs_it_past_its_original_context(tmp_path):
    path = make_tiny_model("llama", tmp_path, max_position_embeddings=128, rope_parameters=dict(LONGROPE),
                           head_dim=16)
    model = umakit.load(path, backend="torch", dtype="float32")
    assert model.info.backend == "torch"
    prompt = [(7 * i) % 90 + 3 for i in range(60)]
    np.testing.assert_allclose(model.logits(prompt), ref_logits(reference(path), prompt), atol=1e-4, rtol=1e-4)
    short = [(5 * i) % 90 + 3 for i in range(20)]  # within the original context: the short factors
    np.testing.assert_allclose(model.logits(short), ref_logits(reference(path), short), atol=1e-4, rtol=1e-4)
    ours = model.engine.generate_tokens(short, model.make_cache(), SamplingParams(temperature=0))
    ours = [next(ours) for _ in range(24)]  # crossing the original context while decoding
    ref = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    theirs, step = [], ref(torch.tensor([short]), use_cache=True)
    with torch.no_grad():
        for _ in range(24):
            theirs.append(int(step.logits[0, -1].argmax()))
            step = ref(torch.tensor([theirs[-1:]]), cache=step.past_key_values, use_cache=True)
    assert ours == theirs


def test_longrope_reads_a_top_level_original_context_and_refuses_what_it_lacks():
    from umakit.backends.torch.model.llama import ModelArgs

    base = dict(model_type="llama", vocab_size=32, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    scaling = {k: v for k, v in LONGROPE.items() if k not in ("rope_theta", "original_max_position_embeddings")}
    phi3 = ModelArgs.from_config({**base, "original_max_position_embeddings": 32, "rope_scaling": scaling})
    assert phi3.rope_original == 32 and phi3.rope_scaling["original_max_position_embeddings"] == 32
    with pytest.raises(UnsupportedModelError, match="without original_max_position_embeddings"):
        ModelArgs.from_config({**base, "rope_scaling": scaling})
    with pytest.raises(UnsupportedModelError, match="without long_factor"):
        ModelArgs.from_config({**base, "rope_scaling": {**LONGROPE, "long_factor": None}})
    with pytest.raises(UnsupportedModelError, match="dynamic RoPE scaling without a numeric 'factor'"):
        ModelArgs.from_config({**base, "rope_scaling": {"rope_type": "dynamic"}})
