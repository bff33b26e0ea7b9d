"""Speculative decoding: several tokens verified per read of the target's weights, losslessly.

A step runs the last committed token and up to ``k`` proposed tokens through
the target in one forward pass (`Engine.logits` on the cache), which reads
every weight once whatever ``k`` is, and keeps the longest prefix the target
agrees with plus one token of its own:

- greedy: a proposal is kept while it is the target's argmax, so the text is
  token for token what plain greedy decoding gives;
- sampling: standard speculative sampling (Leviathan et al.; Chen et al.):
  keep proposal d with probability min(1, p(d)/q(d)), else draw from the
  normalised residual max(p - q, 0), and after k kept ones draw a bonus token
  from p; the output distribution is the target's (q is one-hot for prompt lookup).

Rejected positions are trimmed from the caches at once, so the caches always
hold the committed text but its last token, as in plain decoding. ``k``
adapts: it grows after a fully accepted step and shrinks to what was
accepted otherwise, and speculation pauses (for longer each time) while
acceptance is poor, so text it does not help runs at close to plain speed.
Only the declared engine protocol is used, so every engine gets it.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Iterator, Sequence

import numpy as np

from umakit.errors import InvalidArgumentError
from umakit.generate.lookup import FIRST_PAUSE, MAX_PAUSE, POOR_ACCEPTANCE, SMOOTHING
from umakit.generate.sampling import SamplingParams, seed_or_random
from umakit.generate.speculative.distribution import draw, greedy_token, probabilities



@dataclass
class SpeculativeStats:
    """How speculation went: per generated token, how many target forward passes it took."""

    method: str  # "prompt_lookup" | "draft"
    max_draft_tokens: int
    proposed: int = 0  # tokens offered for verification
    accepted: int = 0  # of those, kept
    target_steps: int = 0  # forward passes of the target after the prompt
    emitted: int = 0  # tokens handed out
    draft_steps: int = 0  # forward passes of the draft (0 for prompt lookup)
    target_bytes_per_step: float = 0.0  # weights + KV cache one target step reads
    draft_bytes_per_step: float = 0.0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.proposed if self.proposed else 0.0

    @property
    def tokens_per_step(self) -> float:
        """Mean tokens gained per target step (1.0 is plain decoding)."""
        return self.emitted / self.target_steps if self.target_steps else 0.0

    @property
    def target_steps_per_token(self) -> float:
        return self.target_steps / self.emitted if self.emitted else 0.0

    @property
    def bytes_per_token(self) -> float:
        """Bytes read per generated token, target and draft together."""
        if not self.emitted:
            return 0.0
        return (self.target_steps * self.target_bytes_per_step + self.draft_steps * self.draft_bytes_per_step) \
            / self.emitted

    def to_dict(self) -> dict:
        return {**asdict(self), "acceptance_rate": self.acceptance_rate, "tokens_per_step": self.tokens_per_step,
                "target_steps_per_token": self.target_steps_per_token, "bytes_per_token": self.bytes_per_token}


class SpeculativeDecoder:
    """`generate_tokens` with speculation, for one target engine and one proposer."""

    def __init__(self, engine, proposer, max_draft_tokens: int, context_length: int = 0,
                 draft_bytes_per_step: float = 0.0):
        self.engine = engine
        self.proposer = proposer
        self.max_draft_tokens = max_draft_tokens
        self.context_length = context_length
        self.draft_bytes_per_step = draft_bytes_per_step  # weights one draft step reads (0 for prompt lookup)
        self.stats = self._new_stats()  # of the latest `generate_tokens`

    def _new_stats(self) -> SpeculativeStats:
        return SpeculativeStats(self.proposer.method, self.max_draft_tokens,
                                draft_bytes_per_step=self.draft_bytes_per_step)

    def generate_tokens(self, prompt: Sequence[int], cache, sampling: SamplingParams, seed: int | None = None,
                        history: Sequence[int] = ()) -> Iterator[int]:
        """As `Engine.generate_tokens`: prefill ``prompt`` after ``cache``, then yield tokens until closed."""
        if not prompt:
            raise InvalidArgumentError("the prompt is empty: there is nothing to continue from")
        if sampling.counts_tokens or sampling.logit_bias:
            raise InvalidArgumentError("speculative decoding does not apply the presence and frequency penalties "
                                       "or a logit bias: give one or the other")
        if not cache.trimmable:
            raise InvalidArgumentError("speculative decoding needs a KV cache that can be rewound; this model's "
                                       "sliding-window layers cannot be: drop --draft/--prompt-lookup")
        self.stats = stats = self._new_stats()
        engine, proposer = self.engine, self.proposer
        rng = np.random.default_rng(seed_or_random(seed))
        window = sampling.repetition_context
        seen = list(history) + list(prompt)
        engine.prefill(list(prompt[:-1]), cache)
        proposer.start(seen)
        last = prompt[-1]
        k = self.max_draft_tokens
        rate, pause, wait = 1.0, FIRST_PAUSE, 0
        while True:
            room = self.context_length - cache.offset - 1 if self.context_length else k
            proposed, dists = ([], None) if wait or room < 1 else proposer.propose(min(k, room), sampling, rng)
            wait = max(wait - 1, 0)
            rows = engine.logits([last, *proposed], cache)  # (1 + len(proposed), V)
            stats.target_steps += 1
            out: list[int] = []
            token = None
            for i, d in enumerate(proposed):
                recent = (seen[-window:] + out)[-window:]
                if sampling.greedy:
                    best = greedy_token(rows[i], recent, sampling)
                    if best == d:
                        out.append(d)
                        continue
                    token = best
                    break
                p = probabilities(rows[i], recent, sampling)
                q_d = 1.0 if dists is None else dists[i][d]
                if rng.random() * q_d < p[d]:  # accept with probability min(1, p(d) / q(d))
                    out.append(d)
                    continue
                residual = np.maximum(p - (_one_hot(d, p.shape[0]) if dists is None else dists[i]), 0.0)
                token = draw(residual, rng) if residual.sum() > 0 else draw(p, rng)
                break
            accepted = len(out)
            if token is None:  # every proposal kept: the last row gives a bonus token
                recent = (seen[-window:] + out)[-window:]
                row = rows[accepted]
                token = greedy_token(row, recent, sampling) if sampling.greedy else \
                    draw(probabilities(row, recent, sampling), rng)
            cache.trim(len(proposed) - accepted)  # the cache now holds `last` and the kept proposals
            out.append(token)
            proposer.commit(out, accepted, proposed)
            if proposed:
                stats.proposed += len(proposed)
                stats.accepted += accepted
                rate = (1 - SMOOTHING) * rate + SMOOTHING * accepted / len(proposed)
                k = min(k + 1, self.max_draft_tokens) if accepted == len(proposed) else max(accepted, 1)
                if rate < POOR_ACCEPTANCE:
                    wait, pause, rate = pause, min(2 * pause, MAX_PAUSE), 1.0
                elif accepted:
                    pause = FIRST_PAUSE
            stats.draft_steps = proposer.steps
            for t in out:
                seen.append(t)
                stats.emitted += 1
                yield t
            last = token


def _one_hot(i: int, n: int) -> np.ndarray:
    out = np.zeros(n)
    out[i] = 1.0
    return out
