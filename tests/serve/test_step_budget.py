"""The step budget (serve/budget.py): measured from a prefill pass's fixed and per-token costs, and used."""

from __future__ import annotations

import pytest

import umakit
from umakit.serve import budget
from umakit.serve.scheduler import Scheduler
from umakit.serve.types import SchedulerSettings


class FakePass:
    """A prefill whose pass costs ``fixed`` + ``per`` a token on a clock of its own (the first pass also pays a
    warm-up), so the measurement is checked without timing anything."""

    def __init__(self, fixed: float, per: float, warm_up: float = 0.5):
        self.now, self.fixed, self.per, self.warm_up, self.lengths = 0.0, fixed, per, warm_up, []

    def clock(self) -> float:
        return self.now

    def prefill(self, ids) -> None:
        self.now += self.fixed + self.per * len(ids) + self.warm_up
        self.warm_up = 0.0
        self.lengths.append(len(ids))


@pytest.mark.parametrize("fixed, per, want", [
    (0.060, 0.00046, 128),  # the built-in model's passes on a 2-core CPU: 130 tokens cost what the fixed part does
    (0.300, 0.0064, 32),  # a 1.5B Q4_K_M's: 47, in steps of 16
    (0.001, 0.0001, 16),  # a fixed part worth 10 tokens: the least
    (0.4, 0.00001, 512),  # one worth 40,000: at most a whole prefill chunk
])
def test_the_budget_is_the_slice_whose_tokens_cost_what_the_fixed_part_does(fixed, per, want):
    fake = FakePass(fixed, per)
    got = budget.measure(fake.prefill, [5, 6, 7], most=512, clock=fake.clock)
    assert got.tokens == want
    assert got.fixed_s == pytest.approx(fixed) and got.per_token_s == pytest.approx(per)
    assert fake.lengths == [budget.SMALL if w == "small" else budget.LARGE for w in budget.ORDER]
    assert f"{want} prompt tokens" in got.describe()


def test_a_slow_model_gets_the_least_budget_without_a_long_pass_timed():
    fake = FakePass(0.2, 0.030)  # 16 tokens: 0.68 s, as a 7B on a 2-core CPU
    got = budget.measure(fake.prefill, [1, 2], most=512, clock=fake.clock)
    assert got.tokens == budget.LEAST and fake.lengths == [budget.SMALL] * 2
    assert "a prefill pass of 16 tokens took 680 ms" in got.describe()


def test_a_budget_never_exceeds_the_prefill_chunk():
    fake = FakePass(0.060, 0.00046)
    assert budget.measure(fake.prefill, [1], most=8, clock=fake.clock).tokens == 8


@pytest.mark.parametrize("given", [None, 24])
def test_the_scheduler_measures_its_budget_unless_given_one(tiny_dir, given):
    model = umakit.load(tiny_dir("llama"), backend="torch", dtype="float32")
    s = Scheduler(model, SchedulerSettings(step_tokens=given))
    s.start()
    try:
        step_tokens = s.metrics()["step_tokens"]
    finally:
        s.stop()
    if given is None:
        assert s.step_budget is not None and step_tokens == s.step_budget.tokens
        assert budget.LEAST <= step_tokens <= SchedulerSettings.prefill_chunk
    else:
        assert s.step_budget is None and step_tokens == given


def test_a_running_row_waits_on_one_prefill_pass_at_most(tiny_dir, monkeypatch):
    """While rows decode, a loop runs one prefill pass, whatever budget the last prompt's slice left over."""
    import asyncio

    from umakit.generate.sampling import SamplingParams
    from umakit.serve.types import FinalEvent, GenerationRequest

    model = umakit.load(tiny_dir("llama"), backend="torch", dtype="float32")
    engine, events = model.engine, []
    real_prefill, real_decoder = engine.prefill, type(engine).batch_decoder

    def spying(self, kv_bits=None, lookup=None, mixed=None):
        decoder = real_decoder(self, kv_bits, lookup, mixed)
        step = decoder.step
        decoder.step = lambda *slice: events.append("step") or step(*slice)
        return decoder

    def prefill(ids, cache):  # the decoder's own call for a row whose cache holds its prompt already has no tokens
        if len(ids):
            events.append("prefill")
        return real_prefill(ids, cache)

    monkeypatch.setattr(engine, "prefill", prefill)
    monkeypatch.setattr(type(engine), "batch_decoder", spying)
    s = Scheduler(model, SchedulerSettings(max_concurrency=8, step_tokens=16))
    loop = asyncio.new_event_loop()
    s.start()
    try:
        # prompts of 21 tokens: a 16-token slice and a 4-token tail each, which used to leave 12 tokens of the
        # budget to the next prompt's pass in the same loop
        prompts = [[(7 * k + i) % 50 + 1 for i in range(21)] for k in range(4)]
        handles = [s.submit(GenerationRequest(p, 12, SamplingParams(temperature=0)), loop) for p in prompts]

        async def finish(h):
            while not isinstance(await asyncio.wait_for(h.queue.get(), 60), FinalEvent):
                pass

        async def all_of():
            await asyncio.gather(*(finish(h) for h in handles))

        loop.run_until_complete(all_of())
    finally:
        s.stop()
        loop.close()
    first = events.index("step")
    later = "".join("s" if e == "step" else "p" for e in events[first:])
    assert "pp" not in later, later
    assert later.count("p") >= 3  # prompts did prefill while rows decoded
