"""What a model needs and what a device makes of it, from config.json shapes alone: arithmetic, nothing measured.

- `roofline`: bandwidth arithmetic (tokens/s <= bandwidth / bytes per token) and `measure_decode`, the one
  measurement of a run against it;
- `shapes`: a config's shapes, its KV cache and the working memory of a prefill chunk;
- `placement`: which weights stay in device memory and which stream over PCIe (the offload plan);
- `weights`: every matrix of a config at the bits it is stored at;
- `sources`: where a plan's config comes from (a model, a preset in ``presets/``, a file);
- `planner`: `umakit plan` (`plan_model`), and `parallel`, one model over several machines.

`roofline`, `shapes` and `placement` import only `umakit.core`: engines use them. `planner` and `parallel`
also import `hardware`, `checkpoint.config` and, inside functions, the registry (which engine offloads) and
`quantize.recipes` (a recipe's bits).
"""
