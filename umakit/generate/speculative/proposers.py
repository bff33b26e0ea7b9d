"""Where speculated tokens come from: a smaller draft model here; the text so far (prompt lookup) in
`umakit.generate.lookup`.

A proposer keeps its own view of the sequence in step with the target's:
`start` sees the prompt, `propose` offers up to ``k`` tokens to follow the
committed text (with the draft's distribution for each, when it has one), and
`commit` hears how many of them the target accepted.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from umakit.generate.sampling import SamplingParams
from umakit.generate.speculative.distribution import draw, greedy_token, probabilities


class DraftModel:
    """Candidates from a smaller model with the same tokenizer, decoded ahead one token at a time.

    Its cache holds the committed text but for ``behind``, the tokens it has not
    run yet (at least the last one, as the target's cache does). Proposing runs
    those and the first ``k - 1`` drafts; `commit` trims the rejected drafts.
    While speculation pauses the draft does no work: it catches up in one
    prefill when it next proposes.
    """

    method = "draft"

    def __init__(self, engine, vocab_size: int):
        self.engine = engine
        self.vocab_size = vocab_size  # the target's logits width: the draft's q is padded or cut to it
        self.cache = None
        self.behind: list[int] = []
        self.recent: list[int] = []
        self.forward_steps = 0

    def start(self, context: Sequence[int]) -> None:
        self.cache = self.engine.make_cache()
        self.behind = list(context)
        self.recent = list(context)

    def propose(self, k: int, sampling: SamplingParams, rng) -> tuple[list[int], list | None]:
        if len(self.behind) > 1:
            self.engine.prefill(self.behind[:-1], self.cache)
            self.forward_steps += 1
        self.behind = self.behind[-1:]
        tokens, dists = [], []
        feed = self.behind[0]
        window = sampling.repetition_context
        for _ in range(k):
            logits = self.engine.logits([feed], self.cache)[-1]
            self.forward_steps += 1
            recent = (self.recent[-window:] + tokens)[-window:]
            if sampling.greedy:
                token, q = greedy_token(logits, recent, sampling), None
            else:
                q = self._fit(probabilities(logits, recent, sampling))
                token = draw(q, rng)
            tokens.append(token)
            dists.append(q)
            feed = token
        return tokens, (dists if not sampling.greedy else None)

    def _fit(self, q: np.ndarray) -> np.ndarray:
        if q.shape[0] == self.vocab_size:
            return q
        out = np.zeros(self.vocab_size)
        n = min(self.vocab_size, q.shape[0])
        out[:n] = q[:n]
        return out / out.sum()

    def commit(self, tokens: Sequence[int], accepted: int, proposed: Sequence[int]) -> None:
        """``tokens`` were committed: ``accepted`` of the ``proposed`` drafts, then the target's own token."""
        if proposed:
            # The cache ran the last token and drafts 1 .. k-1; keep those that were accepted.
            if accepted < len(proposed):
                self.cache.trim(len(proposed) - 1 - accepted)
                self.behind = [tokens[-1]]
            else:
                self.behind = [proposed[-1], tokens[-1]]
        else:
            self.behind += list(tokens)
        self.recent += list(tokens)

    @property
    def steps(self) -> int:
        return self.forward_steps
