"""Prompt lookup: what followed the last earlier occurrence of a sequence's last n-gram, and how many to propose.

Below the engines (as `sampling.py` is), so that a batch decoder can speculate row by row (`RowLookup`, for
`umakit.backends.base.Lookup`) with the same proposer and the same adaptation as the single-sequence speculative
decoder (`umakit.generate.speculative`). A row proposes what `PromptLookup` finds in its text. In a batch every
proposal costs the step a row's arithmetic, kept or not, so a row starts with FIRST_TOKENS and doubles them after
a step that kept them all (as many as were kept otherwise); either decoder pauses for FIRST_PAUSE steps, then
twice that, up to MAX_PAUSE, while fewer than POOR_ACCEPTANCE of its proposals are kept.
"""

from __future__ import annotations

from typing import Sequence

from umakit.generate.sampling import SamplingParams

POOR_ACCEPTANCE = 0.3  # below this running acceptance rate, speculation pauses
FIRST_PAUSE = 4  # target steps of the first pause; each pause after a poor run doubles, up to MAX_PAUSE
MAX_PAUSE = 64
SMOOTHING = 0.5  # weight of the newest step in the running acceptance rate
FIRST_TOKENS = 2  # a row's first proposals at most
GREEDY = SamplingParams(temperature=0)  # a speculating row's: its every token is its logits' argmax


class PromptLookup:
    """Candidates copied from the text so far: what followed the last earlier occurrence of the last n-gram.

    llama.cpp's and vLLM's n-gram speculation: no second model, and a big win
    where the reply copies from the prompt (edits, summaries, code, RAG). The
    longest n-gram (``ngram`` down to 2, or 1 when ``ngram`` is 1) with an
    earlier occurrence wins; the index is updated as tokens are committed, so a
    lookup costs a dictionary probe per n-gram size.
    """

    method = "prompt_lookup"  # proposals are certain: q is one-hot at each proposed token

    def __init__(self, ngram: int):
        self.sizes = list(range(ngram, 1, -1)) or [1]
        self.tokens: list[int] = []
        self.index: dict[int, dict[tuple, int]] = {n: {} for n in self.sizes}

    def start(self, context: Sequence[int]) -> None:
        for t in context:
            self._append(t)

    def _append(self, token: int) -> None:
        # Register the n-grams ending at the current end: the token that follows them is the one being appended.
        end = len(self.tokens)
        for n in self.sizes:
            if end >= n:
                self.index[n][tuple(self.tokens[end - n:end])] = end
        self.tokens.append(token)

    def propose(self, k: int, sampling: SamplingParams, rng) -> tuple[list[int], list | None]:
        end = len(self.tokens)
        for n in self.sizes:
            if end < n:
                continue
            start = self.index[n].get(tuple(self.tokens[end - n:end]))
            if start is not None:
                return self.tokens[start:start + k], None
        return [], None

    def commit(self, tokens: Sequence[int], accepted: int, proposed: Sequence[int]) -> None:
        for t in tokens:
            self._append(t)

    @property
    def steps(self) -> int:
        return 0  # no model runs


class RowLookup:
    """One greedy row's speculation in a batch: its proposals each step, adapted as above; from its own text, or
    from ``proposer`` (a row's draft model, `umakit.generate.speculative.DraftModel`: the same three calls)."""

    def __init__(self, text: Sequence[int], ngram: int, most: int, proposer=None):
        self.lookup = proposer if proposer is not None else PromptLookup(ngram)
        self.lookup.start(text)
        self.most, self.k = most, min(FIRST_TOKENS, most)
        self.rate, self.pause, self.wait = 1.0, FIRST_PAUSE, 0

    def propose(self, room: int) -> list[int]:
        """Up to ``room`` tokens to feed after the row's next one (none while paused)."""
        if self.wait:
            self.wait -= 1
            return []
        if room < 1:
            return []
        return self.lookup.propose(min(self.k, room), GREEDY, None)[0]

    def commit(self, emitted: Sequence[int], proposed: Sequence[int]) -> None:
        """The tokens the row returned this step: the proposals its logits confirmed, then its own pick."""
        self.lookup.commit(emitted, len(emitted) - 1, proposed)
        if not proposed:
            return
        kept = len(emitted) - 1
        self.rate = (1 - SMOOTHING) * self.rate + SMOOTHING * kept / len(proposed)
        self.k = min(2 * self.k, self.most) if kept == len(proposed) else max(kept, 1)
        if self.rate < POOR_ACCEPTANCE:
            self.wait, self.pause, self.rate = self.pause, min(2 * self.pause, MAX_PAUSE), 1.0
        elif kept:
            self.pause = FIRST_PAUSE
