"""KV caches kept across requests, bounded in bytes: a client that sends its conversation again with one
more message prefills only the new tokens.

Each entry is a finished request's cache with the token ids it holds. A new
request takes the entry sharing the longest prefix with its prompt (leaving at
least the prompt's last token to run). A conversation sent again with one more
message extends its entry whole: the entry is handed over, trimmed, and the
finished request puts its own, longer cache back. A prompt that shares only
part of an entry (the same system prompt, another question) gets a copy of
that part and the entry stays, so any number of requests reuse one system
prompt. A cache that cannot be trimmed (a hybrid model's recurrent state, a
sliding window) serves only a prompt that extends its entry whole: the next
turn of its conversation. Least recently used entries go first when the bytes
run out.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Sequence

MIN_SHARED_TOKENS = 4  # shorter shared prefixes are not worth a cache's memory traffic


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


class PromptCache:
    def __init__(self, max_bytes: int):
        self.max_bytes = max_bytes
        # key -> (tokens, cache, salt): an entry serves only requests of its salt
        self._entries: OrderedDict[int, tuple[tuple[int, ...], object, str]] = OrderedDict()
        self._next_key = 0
        self.bytes = 0
        self.lookups = 0
        self.hits = 0

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def hit_ratio(self) -> float:
        return self.hits / self.lookups if self.lookups else 0.0

    def take(self, prompt: Sequence[int], salt: str = ""):
        """(a cache holding a prefix of ``prompt``, its length), or (None, 0). An entry that ``prompt`` extends
        whole leaves the store (the request's own cache will hold more); one it shares only a part of (a system
        prompt, a few-shot header) stays, and the request gets a copy of that part."""
        self.lookups += 1
        best, shared = None, 0
        for key, (tokens, cache, own) in self._entries.items():
            if own != salt:
                continue
            n = common_prefix(tokens, prompt)
            if not cache.trimmable and (n < len(tokens) or n >= len(prompt)):
                continue  # a recurrent state or a sliding window serves only a prompt that extends it whole
            if n > shared:
                best, shared = key, n
        keep = min(shared, len(prompt) - 1)
        if best is None or keep < MIN_SHARED_TOKENS:
            return None, 0
        self.hits += 1
        tokens, cache, _ = self._entries[best]
        if keep < len(tokens):
            self._entries.move_to_end(best)  # recently used: the last to be dropped
            return cache.copy(keep), keep
        del self._entries[best]
        self.bytes -= cache.nbytes
        cache.trim(cache.offset - keep)
        return cache, keep

    def put(self, tokens: Sequence[int], cache, salt: str = "") -> None:
        """Keep ``cache`` (holding ``tokens[:cache.offset]``), dropping the oldest entries to stay in budget."""
        size = cache.nbytes
        if size > self.max_bytes or cache.offset < MIN_SHARED_TOKENS:
            return
        while self._entries and self.bytes + size > self.max_bytes:
            _, (_, old, _) = self._entries.popitem(last=False)
            self.bytes -= old.nbytes
        self._entries[self._next_key] = (tuple(tokens[:cache.offset]), cache, salt)
        self._next_key += 1
        self.bytes += size

    def clear(self) -> None:
        self._entries.clear()
        self.bytes = 0
