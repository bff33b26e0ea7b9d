"""umakit's compact transformer in torch, named as checkpoints name their tensors.

- `llama`: the model (config dataclass, attention, MLP, block, forward; prefill and decode steps), which is
  llama, mistral, qwen2 and qwen3, switched by config fields;
- `gemma`: what gemma3 does differently (its norms, embedding scale, soft-capping), as those fields;
- `moe`: mixture-of-experts layers (router, stacked experts) for mixtral and qwen3_moe.

Imports torch, `umakit.checkpoint.config` and the torch engine's `quant`; nothing about loading or devices.
"""
