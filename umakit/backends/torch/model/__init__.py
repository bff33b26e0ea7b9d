"""umakit's compact transformer in torch, named as checkpoints name their tensors.

- `llama`: the model (config dataclass, attention, MLP, block, forward; prefill and decode steps), which is
  llama, mistral, qwen2 and qwen3, switched by config fields;
- `gemma`: what gemma3 does differently (its norms, embedding scale, soft-capping), as those fields;
- `moe`: mixture-of-experts layers (router, stacked experts) for mixtral and qwen3_moe;
- `openai_moe`: what gpt-oss does differently (attention sinks, its router and experts), as those fields;
- `gemma4`: gemma4's layers (per-layer head sizes, shared keys and values, per-layer inputs), extending `llama`'s
  model; `gemma` reads their config;
- `rope`: RoPE's frequencies for every scaling kind a checkpoint may name, and the rotation.

Imports torch, `umakit.checkpoint.config` and the torch engine's `quant`; nothing about loading or devices.
"""
