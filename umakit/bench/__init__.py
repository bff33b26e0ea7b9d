"""`umakit bench` as a library: measure a loaded model against the bandwidth roofline.

- `measure`: settings, the timed single and batched runs, the context sweep and
  the offload sweep (`run_bench`, `run_offload_sweep`);
- `records`: the record dataclasses, reading and writing their JSON;
- `plots`: PNGs of records and the modelled curves they draw;
- `speculative`: plain against speculative decoding of one copy-heavy prompt.
"""

from umakit.bench.measure import (
    CONTEXT_PROBE_TOKENS,
    DEFAULT_BATCH,
    DEFAULT_GEN_TOKENS,
    DEFAULT_PROMPT_TOKENS,
    DEFAULT_REPEAT,
    DEFAULT_SWEEP_STEPS,
    DEFAULT_WARMUP,
    GREEDY,
    BenchSettings,
    layer_count,
    random_prompt,
    run_bench,
    run_offload_sweep,
    sweep_gpu_layers,
)
from umakit.bench.plots import ceiling_curve, modelled_sweep, plot_records, plot_sweep
from umakit.bench.records import (
    RECORD_VERSION,
    BenchRecord,
    ContextPoint,
    Run,
    Summary,
    SweepPoint,
    load_record,
    write_record,
)
from umakit.bench.speculative import check_speculative_settings, run_speculative_bench

__all__ = [
    "CONTEXT_PROBE_TOKENS",
    "DEFAULT_BATCH",
    "DEFAULT_GEN_TOKENS",
    "DEFAULT_PROMPT_TOKENS",
    "DEFAULT_REPEAT",
    "DEFAULT_SWEEP_STEPS",
    "DEFAULT_WARMUP",
    "GREEDY",
    "RECORD_VERSION",
    "BenchRecord",
    "BenchSettings",
    "ContextPoint",
    "Run",
    "Summary",
    "SweepPoint",
    "ceiling_curve",
    "check_speculative_settings",
    "layer_count",
    "load_record",
    "modelled_sweep",
    "plot_records",
    "plot_sweep",
    "random_prompt",
    "run_bench",
    "run_offload_sweep",
    "run_speculative_bench",
    "sweep_gpu_layers",
    "write_record",
]
