"""Prompt lookup for one row of a batch (`umakit.backends.base.Lookup`): its proposals and how many to make.

A batch decoder that speculates keeps one `RowLookup` a greedy row. It proposes
what `PromptLookup` finds in the row's text. In a batch every proposal costs
the step a row's arithmetic, kept or not, so a row starts with FIRST_TOKENS
and doubles them after a step that kept them all (as many as were kept
otherwise), and pauses, as the single-sequence speculative decoder does, for
4 steps, then 8, up to 64, while fewer than 30% are kept.
"""

from __future__ import annotations

from typing import Sequence

from umakit.generate.speculative.decoder import FIRST_PAUSE, MAX_PAUSE, POOR_ACCEPTANCE, SMOOTHING
from umakit.generate.speculative.proposers import PromptLookup

FIRST_TOKENS = 2  # a row's first proposals at most


class RowLookup:
    def __init__(self, text: Sequence[int], ngram: int, most: int):
        self.lookup = PromptLookup(ngram)
        self.lookup.start(text)
        self.most, self.k = most, min(FIRST_TOKENS, most)
        self.rate, self.pause, self.wait = 1.0, FIRST_PAUSE, 0
        self.proposed = self.accepted = 0  # tokens, over the row's life

    def propose(self, room: int) -> list[int]:
        """Up to ``room`` tokens to feed after the row's next one (none while paused)."""
        if self.wait:
            self.wait -= 1
            return []
        if room < 1:
            return []
        return self.lookup.propose(min(self.k, room), None, None)[0]  # type: ignore[arg-type]

    def commit(self, emitted: Sequence[int], proposed: Sequence[int]) -> None:
        """The tokens the row returned this step: the proposals its logits confirmed, then its own pick."""
        self.lookup.commit(emitted, len(emitted) - 1, proposed)
        if not proposed:
            return
        kept = len(emitted) - 1
        self.proposed += len(proposed)
        self.accepted += kept
        self.rate = (1 - SMOOTHING) * self.rate + SMOOTHING * kept / len(proposed)
        self.k = min(2 * self.k, self.most) if kept == len(proposed) else max(kept, 1)
        if self.rate < POOR_ACCEPTANCE:
            self.wait, self.pause, self.rate = self.pause, min(2 * self.pause, MAX_PAUSE), 1.0
        elif kept:
            self.pause = FIRST_PAUSE
