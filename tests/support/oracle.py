"""What the engine tests share: transformers as the oracle, the prompts, and the sequential decode loop a batch
is checked against."""

import numpy as np
import torch

PROMPT = [5, 17, 42, 99, 3, 250, 7, 301, 12, 64, 128, 77, 31, 200, 11]  # token ids, for the tiny vocabularies
# Every engine, float32 on the CPU (MLX pinned there: float32 on a Mac too, and batched rows equal single runs
# token for token on the CPU kernels, where Metal may pick other kernels per batch size).
ENGINES = {"mlx": dict(backend="mlx", device="cpu"), "torch": dict(backend="torch", device="cpu", dtype="float32")}

# Very different lengths: one token to a few hundred (the tiny models hold 512).
PROMPTS = [
    "The",
    "The quick brown fox jumps over the lazy dog. " * 8,
    "Paris is",
    [{"role": "user", "content": "Unified memory lets the GPU read every weight."}],
    "Ünïcödé ✓ 東京 🚀",
    "fox " * 60,
    "The capital of France",
    "Unified memory lets the GPU read every weight at full bandwidth. " * 3,
    "dog",
    "The lazy dog. " * 20,
]
MAX_TOKENS = 24


def reference(path):
    """transformers' model of the checkpoint at ``path``, float32."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def ref_logits(ref, tokens):
    with torch.no_grad():
        return ref(torch.tensor([tokens])).logits[0].numpy()


def greedy_reference(ref, prompt, n):
    """transformers' greedy continuation of ``prompt``, ``n`` tokens, each from a forward over all before it."""
    seq = list(prompt)
    for _ in range(n):
        seq.append(int(ref_logits(ref, seq)[-1].argmax()))
    return seq[len(prompt):]


def sequential(model, prompts, **kw):
    """One `Model.generate` per prompt: plain strings raw, message lists through the template."""
    out = []
    for p in prompts:
        args = {"messages": p} if isinstance(p, list) else {"prompt": p, "raw": True}
        out.append(model.generate(**args, **kw))
    return out


def batched_prompts(prompts):
    """The same prompts as batch items, as `sequential` sends them."""
    return [p if isinstance(p, list) else {"prompt": p} for p in prompts]


def static_steps(model, prompt, start: int):
    """Logits of ``prompt[start:]``, one token a step through the CUDA-graph decode step run eagerly (a fixed span
    of the cache under a mask), after ``prompt[:start]`` was prefilled; for `model.logits(prompt)[start:]`."""
    from umakit.backends.torch.cuda.graphs import GraphDecoder

    step = GraphDecoder(model.engine.model, capture=False)
    cache = model.make_cache()
    model.engine.prefill(prompt[:start], cache)
    with torch.inference_mode():
        return np.stack([step(torch.tensor([t]), cache)[0].numpy() for t in prompt[start:]])
