"""A checkpoint (or random weights) into the torch model, on its device and in its execution forms.

- `loader`: tensors streamed from safetensors into the model, the offload split, the compute dtype;
- `synthetic`: random weights in a real architecture's shapes, for benchmarks;
- `packed`: the CPU int4 packing of a checkpoint, kept under ``$UMAKIT_HOME/packed/`` for later loads.
"""
