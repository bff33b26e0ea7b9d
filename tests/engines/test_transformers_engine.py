"""This year's families on the transformers engine (backends/transformers/): tiny random checkpoints saved by the
installed transformers for gpt_oss (attention sinks, sliding layers, experts), qwen3_next (hybrid: gated delta-net
linear attention beside full attention), gemma4 (text), smollm3 and lfm2 (convolution layers): logits and greedy
tokens against transformers itself, batch rows against lone runs, and `umakit batch` and `umakit serve` on one."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
import torch
from torch import nn

import umakit
from support.oracle import greedy_reference, ref_logits, reference
from support.tiny import VOCAB, write_tokenizer
from umakit.backends.base import BatchRow
from umakit.generate.sampling import SamplingParams

transformers = pytest.importorskip("transformers")

GREEDY = SamplingParams(temperature=0)
SMALL = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
             head_dim=16, max_position_embeddings=512, bos_token_id=1, eos_token_id=2, pad_token_id=0)
FAMILIES = {
    "gpt_oss": ("GptOssConfig", "GptOssForCausalLM", dict(
        num_hidden_layers=2, num_local_experts=4, num_experts_per_tok=2, sliding_window=8,
        layer_types=["sliding_attention", "full_attention"],
        rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 4.0, "beta_fast": 32.0,
                         "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 128})),
    "qwen3_next": ("Qwen3NextConfig", "Qwen3NextForCausalLM", dict(
        num_hidden_layers=4, full_attention_interval=2, linear_num_value_heads=4, linear_num_key_heads=2,
        linear_key_head_dim=16, linear_value_head_dim=16, num_experts=4, num_experts_per_tok=2,
        moe_intermediate_size=32, shared_expert_intermediate_size=32)),
    "gemma4": ("Gemma4TextConfig", "Gemma4ForCausalLM", dict(
        num_hidden_layers=3, sliding_window=8, vocab_size_per_layer_input=VOCAB, hidden_size_per_layer_input=16,
        layer_types=["sliding_attention", "sliding_attention", "full_attention"])),
    "smollm3": ("SmolLM3Config", "SmolLM3ForCausalLM", dict(num_hidden_layers=4)),
    "lfm2": ("Lfm2Config", "Lfm2ForCausalLM", dict(
        num_hidden_layers=3, layer_types=["conv", "full_attention", "conv"])),
}
PROMPT = [(7 * i) % 400 + 3 for i in range(40)]  # longer than the sliding windows


def make(family: str, path):
    cfg_name, model_name, extra = FAMILIES[family]
    config = getattr(transformers, cfg_name)(**{**SMALL, **extra})
    torch.manual_seed(0)
    model = getattr(transformers, model_name)(config)
    with torch.no_grad():  # decisive routers and norms of their own, so a wrong expert or norm would show
        for name, p in model.named_parameters():
            if name.endswith((".router.weight", ".gate.weight")):
                p.mul_(20)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path, safe_serialization=True)
    write_tokenizer(path)
    return path


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request, tmp_path_factory):
    return request.param, make(request.param, tmp_path_factory.mktemp(request.param))


def test_logits_and_greedy_tokens_are_transformers(family):
    name, path = family
    model = umakit.load(path, backend="transformers", dtype="float32")
    assert model.info.backend == "transformers" and model.info.weights.params > 0
    ref = reference(path)
    want = ref_logits(ref, PROMPT)
    np.testing.assert_allclose(model.logits(PROMPT), want, atol=1e-4 * np.abs(want).max(), rtol=0)
    tokens = model.engine.generate_tokens(PROMPT, model.make_cache(), GREEDY)
    assert [next(tokens) for _ in range(10)] == greedy_reference(ref, PROMPT, 10)


def test_the_cpu_default_holds_float_linears_as_float16_weights(family):
    """"auto" on a CPU: every float linear layer as FBGEMM's float16 weights with float32 math (half the bytes a
    step reads), the logits within float16's rounding of the weights, the weights' bytes counted."""
    from umakit.backends.torch.quant.kernels import Fp16Linear

    if not Fp16Linear.available():
        pytest.skip("this torch has no FBGEMM")
    _, path = family
    model = umakit.load(path, backend="transformers", device="cpu")
    exact = umakit.load(path, backend="transformers", device="cpu", dtype="float32")
    assert not any(type(m) is torch.nn.Linear for m in model.engine.model.modules())
    assert model.info.dtype == "float16" and exact.info.dtype == "float32"
    want = exact.logits(PROMPT)
    np.testing.assert_allclose(model.logits(PROMPT), want, atol=1e-2 * np.abs(want).max(), rtol=0)
    halves = sum(m.packed_nbytes for m in model.engine.model.modules() if isinstance(m, Fp16Linear))
    assert halves > 0 and model.info.weights.total_bytes < exact.info.weights.total_bytes


def test_batch_rows_are_their_lone_runs_whatever_the_cache(family):
    """Rows of different lengths, one joining mid-way: each row's tokens are its lone run's (the hybrid model's
    recurrent state, the sliding windows and the convolution states kept per row)."""
    _, path = family
    engine = umakit.load(path, backend="transformers", dtype="float32").engine
    prompts = {0: PROMPT, 1: PROMPT[:5], 2: [9, 8, 7, 6, 5, 4, 3, 2, 1, 11, 12, 13]}
    decoder = engine.batch_decoder()
    decoder.add([BatchRow(i, p, GREEDY) for i, p in prompts.items() if i != 2])
    got = {i: [] for i in prompts}
    passes = []
    hook = engine.model.register_forward_hook(lambda module, args, out: passes.append(1))
    for step in range(10):
        if step == 3:
            decoder.add([BatchRow(2, prompts[2], GREEDY)])
        if step == 6:  # a row leaves; the others go on
            exported = decoder.export(1)
            decoder.remove([1])
        passes.clear()
        for row, token in decoder.step():
            got[row].append(token)
        assert len(passes) == 1, step  # every row in one forward pass
    hook.remove()
    assert decoder.context_tokens() == len(PROMPT) + 9
    rest = engine.generate_tokens([got[1][-1]], exported, GREEDY)  # the exported row goes on alone
    got[1] += [next(rest) for _ in range(3)]
    for i, p in prompts.items():
        lone = engine.generate_tokens(p, engine.make_cache(), GREEDY)
        want = [next(lone) for _ in range(len(got[i]))]
        assert got[i] == want, i


def test_auto_takes_it_for_an_architecture_no_compact_engine_runs(tmp_path):
    """A CPU without MLX's model file for a family: "auto" loads it on transformers' classes and says so."""
    import dataclasses

    from umakit import backends

    path = make("lfm2", tmp_path / "lfm2")
    mlx = backends.ENGINES["mlx"]
    blind = dataclasses.replace(mlx, finds_architecture=lambda t: False)
    saved = dict(backends.ENGINES)
    backends.ENGINES["mlx"] = blind
    try:
        m = umakit.load(path, dtype="float32")
    finally:
        backends.ENGINES.clear()
        backends.ENGINES.update(saved)
    assert m.info.backend == "transformers"
    assert m.info.warnings[0].startswith("running on transformers (cpu): torch does not run lfm2")


def test_batch_command_runs_a_hybrid_model(tmp_path):
    path = make("qwen3_next", tmp_path / "qwen3_next")
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"id": i, "prompt": p}) + "\n"
                               for i, p in enumerate(["The quick", "Paris is", "fox fox"])))
    out = tmp_path / "out.jsonl"
    run = subprocess.run([sys.executable, "-m", "umakit.cli.main", "batch", str(path), "-i", str(prompts), "-o", str(out),
                          "--backend", "transformers", "--max-tokens", "6", "--temp", "0", "--raw"],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(rows) == 3 and all(r.get("text") is not None for r in rows), rows


@pytest.mark.slow
def test_serve_answers_concurrent_requests_on_a_hybrid_model(tmp_path, tmp_path_factory):
    """`umakit serve --backend transformers` on qwen3_next: concurrent greedy chats, each its lone reply."""
    from support.serve_helpers import concurrent_chats

    (got,), want = concurrent_chats(make("qwen3_next", tmp_path / "qwen3_next"), "transformers", tmp_path_factory,
                                    "hybrid")
    assert got == want


def quantized_twin(path, out, table_bits: int | None = None):
    """``path``'s checkpoint with every ``nn.Linear`` of its layers in MLX's 4-bit groups of 32 (and, with
    ``table_bits``, its input embeddings at that width, a tied head reading them), and its float twin: the same
    model holding the dequantized weights. Scales and biases are float16, as the packed forms read them."""
    from safetensors.torch import load_file, save_file

    from umakit.backends.torch.quant import layout

    model = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    kinds = {p: m for p, m in model.named_modules() if type(m) is nn.Linear and "lm_head" not in p
             and m.in_features % 32 == 0}
    if table_bits:
        kinds.update({p: m for p, m in model.named_modules() if isinstance(m, nn.Embedding) and m.embedding_dim % 32 == 0})
    state = load_file(path / "model.safetensors")
    quantized, twin, block = {}, {}, {"group_size": 32, "bits": 4}
    for name, t in state.items():
        module = name.removesuffix(".weight")
        if module not in kinds or not name.endswith(".weight"):
            quantized[name] = twin[name] = t
            continue
        bits = table_bits if isinstance(kinds[module], nn.Embedding) else 4
        if bits != 4:
            block[module] = {"group_size": 32, "bits": bits}
        packed, scales, biases = layout.quantize(t.float(), bits, 32)
        scales, biases = scales.half(), biases.half()
        quantized.update({name: packed, f"{module}.scales": scales, f"{module}.biases": biases})
        twin[name] = layout.dequantize(packed, scales, biases, bits, 32).to(t.dtype)
    for d, tensors, extra in ((out / "q", quantized, {"quantization": block, "quantization_config": block}),
                              (out / "twin", twin, {})):
        d.mkdir(parents=True)
        for f in path.iterdir():
            if f.name != "model.safetensors":
                (d / f.name).write_bytes(f.read_bytes())
        save_file(tensors, d / "model.safetensors")
        config = json.loads((d / "config.json").read_text())
        (d / "config.json").write_text(json.dumps({**config, **extra}))
    return out / "q", out / "twin", len(kinds)


def test_a_quantized_checkpoint_runs_its_packed_layers_as_its_float_twin(family, tmp_path):
    """MLX's layout (an imported GGUF, GPTQ, AWQ or compressed-tensors checkpoint) on transformers' classes: the
    packed layers swapped in by name, the same logits as the float model holding the dequantized weights, within
    the packed forms' tolerance (int8 inputs in two passes on a CPU that has the affine kernel: a prompt shorter
    than the bfloat16 GEMMs' 16 tokens, and longer than the sliding windows)."""
    name, path = family
    table = 8 if name == "gemma4" else None  # its scaled tables, and a tied head reading the main one
    q, twin, n = quantized_twin(path, tmp_path, table)
    model = umakit.load(q, backend="transformers", dtype="float32")
    ref = umakit.load(twin, backend="transformers", dtype="float32")
    assert model.info.weights.quantization.startswith("4-bit g32") and n >= 4, model.info.weights.quantization
    assert model.info.weights.params == ref.info.weights.params
    prompt = PROMPT[:12]
    ours, want = model.logits(prompt), ref.logits(prompt)
    assert np.abs(ours - want).max() <= 2e-3 * np.abs(want).max(), np.abs(ours - want).max()
    stream = lambda m: [t for _, t in zip(range(8), m.engine.generate_tokens(prompt, m.engine.make_cache(), GREEDY))]  # noqa: E731
    assert stream(model) == stream(ref)


def test_a_quantized_checkpoint_whose_names_are_not_transformers_is_refused(tmp_path):
    from umakit.errors import UnsupportedModelError

    path = make("smollm3", tmp_path / "float")
    q, _, _ = quantized_twin(path, tmp_path)
    from safetensors.torch import load_file, save_file

    state = load_file(q / "model.safetensors")
    renamed = {k.replace("model.layers.0.", "model.layers.0.block."): v for k, v in state.items()}
    save_file(renamed, q / "model.safetensors")
    with pytest.raises(UnsupportedModelError, match="model.layers.0.block"):
        umakit.load(q, backend="transformers", dtype="float32")


def test_a_chat_goes_back_to_its_last_prompt_instead_of_prefilling_all_again(family):
    """Sliding windows and linear-attention states cannot be trimmed: the chat marks the cache at each prompt and
    the next turn rewinds there; a cache of full attention trims. Either way the next turn reuses the conversation,
    with the replies of a chat that prefills everything again."""
    from support.chats import chat_turns

    _, path = family
    model = umakit.load(path, backend="transformers", dtype="float32")
    turns, fresh = chat_turns(model, ["The quick brown fox", "Paris is the capital", "again"])
    assert turns[0][0] == 0 and all(reused > 0 for reused, _ in turns[1:]), turns
    assert [reply for _, reply in turns] == fresh


def test_speculating_rows_keep_their_lone_tokens_in_fewer_steps(tmp_path, monkeypatch):
    """`batch --prompt-lookup`/`--draft` on this engine: proposals from the rows' lone continuations, every third
    one wrong (`Oracle`), each speculating row verified in one forward pass of its own and its cache cropped back
    past what its argmax rejected; in fewer steps than tokens. A smollm3 (full attention) of larger weights than
    the other tiny models, whose greedy replies do not settle on one repeated token (stale keys would show)."""
    from engines.test_batch_lookup import REPEATS, lone, speculates_as_lone
    from umakit.backends.transformers import batch_decoder

    config = transformers.SmolLM3Config(**{**SMALL, "num_hidden_layers": 4, "initializer_range": 0.3})
    torch.manual_seed(0)
    transformers.SmolLM3ForCausalLM(config).save_pretrained(tmp_path, safe_serialization=True)
    write_tokenizer(tmp_path)
    model = umakit.load(tmp_path, backend="transformers", dtype="float32")
    assert min(len(set(lone(model, p, 30, temperature=0).tokens)) for p in REPEATS) > 5
    speculates_as_lone(model, batch_decoder, monkeypatch)


def test_speculation_is_refused_where_the_cache_cannot_give_positions_back(family):
    """Sliding windows, recurrent and convolution states: refused by name, before any row is added."""
    from umakit.backends.base import Lookup
    from umakit.errors import InvalidArgumentError

    name, path = family
    model = umakit.load(path, backend="transformers", dtype="float32")
    if model.make_cache().trimmable:
        assert model.engine.batch_decoder(lookup=Lookup(ngram=2, tokens=4)).size == 0
        return
    with pytest.raises(InvalidArgumentError, match=f"--prompt-lookup.*{name}"):
        model.engine.batch_decoder(lookup=Lookup(ngram=2, tokens=4))


def test_the_kernel_fallback_note_is_not_printed_in_a_reply(tmp_path):
    """On a CPU transformers notes, on a hybrid model's first forward pass, that flash-linear-attention's kernels
    fall back to PyTorch's, through its own handler on stderr: the library never prints, so that note is dropped
    (what reaches transformers' handlers is collected here; the note's once-only record is cleared first, so that
    an earlier test cannot have used it up)."""
    import logging

    from support import gguf_qwen35
    from transformers.utils import logging as hf_logging

    model = umakit.load(gguf_qwen35.make(tmp_path / "m"), backend="transformers", dtype="float32")
    hf_logging.warning_once.cache_clear()
    seen = []
    handler = logging.Handler()
    handler.emit = lambda record: seen.append(record.getMessage())
    logging.getLogger("transformers").addHandler(handler)
    try:
        [_ for _, _ in zip(range(3), model.engine.generate_tokens(PROMPT[:5], model.make_cache(), GREEDY))]
    finally:
        logging.getLogger("transformers").removeHandler(handler)
    assert not [m for m in seen if "falling back" in m], seen
