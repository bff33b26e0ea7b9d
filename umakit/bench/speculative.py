"""`umakit bench --speculative`: plain and speculative decoding of one copy-heavy prompt, in one run.

Random token ids (what `run_bench` feeds) give prompt lookup nothing to copy,
so this measure uses text: a request to copy a passage, through the model's
chat template. Plain and speculative runs alternate, greedy, the same number
of tokens each (end-of-sequence ignored), so the record holds both speeds, how
many proposals were accepted and how far past the one-token roofline it went.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, replace

from umakit.errors import InvalidArgumentError
from umakit.bench.measure import GREEDY, WARMUP_TOKENS, BenchSettings, Progress
from umakit.bench.records import BenchRecord, Run, machine_dict, model_dict, summarize, timestamp, versions_dict

PASSAGE = (
    "Decoding one token reads every weight of the model once, so a machine that moves eight hundred gigabytes "
    "a second can never decode faster than eight hundred gigabytes divided by the bytes of the model. "
    "Speculative decoding checks several proposed tokens in one pass over the weights and keeps those the "
    "model agrees with, so text that repeats what came before is written faster than that limit allows."
)
COPY_REQUEST = "Repeat the following text exactly, word for word:\n\n"


def copy_prompt(model) -> list[int]:
    """The prompt ids of the copy request, through the model's chat template."""
    if model.tokenizer is None:
        raise InvalidArgumentError("--speculative measures text: give a model with a tokenizer, not --synthetic")
    return model.encode(COPY_REQUEST + PASSAGE)


def check_speculative_settings(settings: BenchSettings) -> None:
    """Refuse the settings a speculative bench cannot honour (call before loading anything)."""
    if settings.batch > 1 or settings.kv_bits is not None or settings.contexts:
        raise InvalidArgumentError("--speculative measures one sequence: drop --batch, --kv-bits and --contexts")


def _timed(model, source, ids: list[int], gen_tokens: int) -> tuple[Run, list[int]]:
    engine = model.engine
    engine.reset_peak_memory()
    t0 = time.perf_counter()
    stream = source.generate_tokens(ids, model.make_cache(), GREEDY, seed=0)
    tokens = [next(stream)]
    t1 = time.perf_counter()
    tokens += [next(stream) for _ in range(gen_tokens - 1)]
    t2 = time.perf_counter()
    stream.close()
    tps = (gen_tokens - 1) / (t2 - t1)
    r, _ = model.measure_decode(tps, len(ids) + gen_tokens // 2)
    run = Run(t1 - t0, len(ids) / (t1 - t0), tps, r.achieved_gbps, r.mbu, r.bytes_per_token, engine.peak_memory())
    return run, tokens


def run_speculative_bench(model, decoder, settings: BenchSettings | None = None,
                          progress: Progress | None = None) -> BenchRecord:
    """Plain runs (the record's ``runs``) against ``decoder``'s runs (its ``speculative`` block), alternating."""
    settings = settings or BenchSettings()
    check_speculative_settings(settings)
    ids = copy_prompt(model)
    steps = settings.warmup + settings.repeat
    for i in range(settings.warmup):
        for source in (model.engine, decoder):
            _timed(model, source, ids, min(settings.gen_tokens, WARMUP_TOKENS))
        if progress:
            progress("warm-up", i + 1, steps)
    plain, spec, same = [], [], True
    for i in range(settings.repeat):
        run, want = _timed(model, model.engine, ids, settings.gen_tokens)
        plain.append(run)
        run, got = _timed(model, decoder, ids, settings.gen_tokens)
        spec.append(run)
        same = same and got == want
        if progress:
            progress(f"run {i + 1}/{settings.repeat}", settings.warmup + i + 1, steps)
    s = decoder.stats  # of the last speculative run
    ceiling = spec[-1].bytes_per_token and model.device_info.peak_bandwidth_gbps * 1e9 / spec[-1].bytes_per_token
    tps = statistics.median(r.decode_tps for r in spec)
    speculative = {
        **s.to_dict(), "runs": [asdict(r) for r in spec], "summary": {k: asdict(v) for k, v in summarize(spec).items()},
        "speedup": tps / statistics.median(r.decode_tps for r in plain),
        "over_one_token_roofline": tps / ceiling if ceiling else 0.0, "same_tokens": same,
    }
    return BenchRecord(
        machine=machine_dict(model.device_info), model=model_dict(model, None),
        settings=asdict(replace(settings, prompt_tokens=len(ids))), versions=versions_dict(), runs=plain,
        summary=summarize(plain), synthetic=False, created=timestamp(), speculative=speculative,
    )
