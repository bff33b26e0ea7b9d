"""Foundations every layer may import: no framework, no engine, nothing above them.

- `affine`: MLX's affine quantization format in numbers (widths, group sizes, the config block);
- `validate`: every value a user gives umakit, checked once (flags, ``/set``, batch lines, API keywords);
- `fsutil`: atomic writes, locks, stale-temp sweeps, one `WriteError`;
- `home`: where umakit keeps its files (``$UMAKIT_HOME``).

Modules here import only the standard library, `umakit.errors` and each other.
"""
