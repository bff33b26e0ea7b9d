"""Model files: finding, reading and writing checkpoints, before any engine is involved.

- `files`: a checkpoint directory found (a path, a Hub id, a ``.gguf``, the built-in model) and checked from its
  headers before any tensor is read (`resolve`, `open_checkpoint`, `validate_checkpoint`), re-exported here;
- `config`: config.json as any transformers version writes it, mapped onto the names the engines read;
- `tokenizer`: the tokenizer, its chat template and the streaming detokenizer;
- `writer`: the one writer of model directories (`umakit quantize`, GGUF imports);
- `default`: the built-in model, found in its pip package;
- `gguf/`: GGUF files read and converted exactly to the MLX layout, imported once.

Imports `umakit.core` and the standard library (`gguf/` also numpy, gguf and mlx, on use); never an engine.
"""

from umakit.checkpoint.files import (
    FLOAT_DTYPES,
    Checkpoint,
    TensorInfo,
    display_name,
    generation_eos_ids,
    open_checkpoint,
    read_config,
    resolve,
    size_on_disk,
    validate_checkpoint,
)

__all__ = ["FLOAT_DTYPES", "Checkpoint", "TensorInfo", "display_name", "generation_eos_ids", "open_checkpoint", "read_config",
           "resolve", "size_on_disk", "validate_checkpoint"]
