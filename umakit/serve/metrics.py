"""`/metrics`: the server's figures in Prometheus' text format."""

from __future__ import annotations

import math
from collections import Counter, deque

METRIC_HELP = {
    "requests_total": "Completion requests accepted by the scheduler.",
    "requests_failed_total": "Accepted requests that ended in an error (worker failure, timeout).",
    "requests_cancelled_total": "Accepted requests whose client went away before the end.",
    "requests_rejected_total": "Requests refused because the queue was full (429).",
    "generated_tokens_total": "Tokens generated, all requests.",
    "prompt_tokens_total": "Prompt tokens of finished requests.",
    "cached_tokens_total": "Prompt tokens found in the prompt cache instead of prefilled.",
    "worker_restarts_total": "Times the generation worker failed and was restarted.",
    "decode_steps_total": "Batched decode steps run.",
    "mixed_steps_total": "Decode steps that carried a waiting prompt's slice in their pass (--mixed-steps).",
    "queue_depth": "Requests waiting for a row.",
    "active_rows": "Rows decoding now.",
    "prefilling_requests": "Requests prefilling their prompt now.",
    "max_active_rows": "Most rows decoded together in one step since start.",
    "step_tokens": "Prompt tokens prefilled between two decode steps while rows decode (--step-tokens, or measured).",
    "tokens_per_second": "Tokens generated per second, over the last few seconds.",
    "achieved_gbps": "Bytes the engine read per second (GB/s), over the last few seconds.",
    "peak_gbps": "The device's peak memory bandwidth (GB/s).",
    "prompt_cache_hit_ratio": "Share of requests that found a cached prefix.",
    "prompt_cache_bytes": "Bytes held by the prompt cache.",
    "prompt_cache_entries": "Caches held by the prompt cache.",
    "healthy": "1 when the generation worker runs.",
    "memory_budget_bytes": "Bytes the loaded models may take (umakit serve --memory-budget).",
}
MODEL_METRIC_HELP = {
    "loaded": "1 while the model is loaded.", "loading": "1 while the model loads.",
    "step_tokens": "Prompt tokens prefilled between two decode steps while rows decode (--step-tokens, or measured).",
    "bytes": "Bytes the model holds (its files while it loads).", "active_requests": "Requests holding the model.",
    "loads_total": "Times the model was loaded.", "idle_seconds": "Seconds since the model's last request ended.",
}


class RecentRates:
    """Tokens and bytes of the steps of the last ``window`` seconds, as rates a second."""

    def __init__(self, window: float):
        self.window, self._steps = window, deque()

    def add(self, now: float, tokens: int, read: float) -> None:
        self._steps.append((now, tokens, read))

    def rates(self, now: float) -> tuple[float, float]:
        """(tokens, bytes) a second over the window."""
        while self._steps and now - self._steps[0][0] > self.window:
            self._steps.popleft()
        if not self._steps:
            return 0.0, 0.0
        span = max(now - self._steps[0][0], 1e-9)
        return sum(t for _, t, _ in self._steps) / span, sum(b for _, _, b in self._steps) / span


def prometheus(metrics: dict[str, float], responses: Counter, per_model: list = ()) -> str:
    """Prometheus text format: the scheduler's figures, the HTTP responses by status and, on a server of many
    models, each model's state (``umakit_model_*{model="..."}``), named ``umakit_*``."""
    lines = []
    for name, value in metrics.items():
        full = f"umakit_{name}"
        lines += [f"# HELP {full} {METRIC_HELP.get(name, name.replace('_', ' ') + '.')}",
                  f"# TYPE {full} {'counter' if name.endswith('_total') else 'gauge'}",
                  f"{full} {_number(value)}"]
    lines += ["# HELP umakit_http_responses_total HTTP responses sent, by status.",
              "# TYPE umakit_http_responses_total counter"]
    lines += [f'umakit_http_responses_total{{status="{s}"}} {n}' for s, n in sorted(responses.items())]
    for key in (per_model[0][1] if per_model else ()):
        full = f"umakit_model_{key}"
        lines += [f"# HELP {full} {MODEL_METRIC_HELP[key]}",
                  f"# TYPE {full} {'counter' if key.endswith('_total') else 'gauge'}"]
        lines += [f'{full}{{model="{_label(name)}"}} {_number(values[key])}' for name, values in per_model]
    return "\n".join(lines) + "\n"


def _label(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _number(value: float) -> str:
    value = float(value)
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    return str(int(value)) if value.is_integer() else repr(value)
