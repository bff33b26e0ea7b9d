"""PyTorch backend: CUDA on NVIDIA GPUs, CPU elsewhere.

Importing this package imports no torch: the registry reads `SPEC` here and
imports `engine` only when the engine is chosen.
"""

from umakit.backends.base import (BATCH, BATCH_KV_BITS, CONSTRAIN, DETERMINISTIC, LOOKUP, MIXED, OFFLOAD, QUANTIZED_KV,
                                  EngineSpec)

# The model types backends/torch/model/llama.py runs (config.json's, of the language model).
ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3", "smollm3", "gemma3_text", "gemma4_text", "mixtral",
                 "qwen3_moe", "gpt_oss")
# The RoPE scaling kinds model/rope.py computes.
ROPE_KINDS = ("default", "linear", "llama3", "yarn", "dynamic", "longrope", "proportional")

SPEC = EngineSpec(name="torch", module="umakit.backends.torch.engine", cls="TorchEngine", dependency="torch",
                  extra="umakit[cuda]", devices=("cuda", "cpu"),
                  features=frozenset({QUANTIZED_KV, BATCH, BATCH_KV_BITS, OFFLOAD, CONSTRAIN, LOOKUP, MIXED,
                                      DETERMINISTIC}),
                  architectures=ARCHITECTURES, rope_kinds=ROPE_KINDS,
                  exact_groups=lambda device, dtype: device == "cpu" and dtype in ("auto", "bfloat16"))


def __getattr__(name):
    if name == "TorchEngine":
        from umakit.backends.torch.engine import TorchEngine

        return TorchEngine
    raise AttributeError(name)
