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
    (2.0, 0.0001, 512),  # one worth 20,000: at most a whole prefill chunk
])
def test_the_budget_is_the_slice_whose_tokens_cost_what_the_fixed_part_does(fixed, per, want):
    fake = FakePass(fixed, per)
    got = budget.measure(fake.prefill, [5, 6, 7], most=512, clock=fake.clock)
    assert got.tokens == want
    assert got.fixed_s == pytest.approx(fixed) and got.per_token_s == pytest.approx(per)
    assert fake.lengths == [budget.SMALL] * budget.ROUNDS + [budget.LARGE] * budget.ROUNDS
    assert f"{want} prompt tokens" in got.describe()


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
