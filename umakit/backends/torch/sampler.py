"""The torch engine's arrays as the sampler's rules (`umakit.generate.sampling`) and the engines' shared sequence
code (`umakit.backends.common`) use them, with torch's generator as the random source.

The categorical draw is an exponential race (argmax of p / E, E ~ Exp(1)),
which needs no host synchronisation.
"""

from __future__ import annotations

from typing import Callable

import torch

from umakit.generate import sampling
from umakit.generate.sampling import SamplingParams, seed_or_random


class TorchOps:
    """`umakit.backends.common.EngineOps` for torch tensors on ``device``."""

    neg_inf = float("-inf")

    def __init__(self, device: torch.device | str = "cpu"):
        self.device = torch.device(device)

    @staticmethod
    def floating(x):
        return x.float()

    @staticmethod
    def gather(x, index):
        return x.gather(-1, index)

    @staticmethod
    def scatter(x, index, values):
        return x.scatter(-1, index, values)

    @staticmethod
    def where(condition, x, y):
        return torch.where(condition, x, y)

    @staticmethod
    def kth_largest(x, k):
        return x.topk(k, dim=-1).values[..., -1:]

    @staticmethod
    def sort_descending(x):
        return x.sort(dim=-1, descending=True)

    @staticmethod
    def softmax(x):
        return x.softmax(dim=-1)

    @staticmethod
    def cumsum(x):
        return x.cumsum(dim=-1)

    @staticmethod
    def max(x):
        return x.amax(dim=-1, keepdim=True)

    @staticmethod
    def argmax(x):
        return x.argmax(dim=-1)

    @staticmethod
    def size(x):
        return x.numel()

    @staticmethod
    def draw(logits, generator):
        race = torch.empty_like(logits).exponential_(generator=generator)
        return (logits.softmax(dim=-1) / race).argmax(dim=-1)

    def random(self, seed, greedy):
        generator = torch.Generator(device=self.device)
        generator.manual_seed(seed_or_random(seed))
        return lambda: generator

    def ids(self, ids):
        return torch.tensor(list(ids), dtype=torch.long, device=self.device)[None]

    @staticmethod
    def append(recent, token, window):
        return torch.cat([recent, token[:, None]], dim=1)[:, -window:]

    @staticmethod
    def tokens(x):
        return x

    @staticmethod
    def concat(xs):
        return torch.cat(xs)

    @staticmethod
    def log_softmax(x):
        return x.log_softmax(dim=-1)

    @staticmethod
    def top(x, n):
        top = x.topk(n, dim=-1)  # sorted
        return top.indices, top.values

    def host(self, x):
        return torch.from_numpy(x).to(self.device)

    def zeros(self, shape):
        return torch.zeros(shape, dtype=torch.float32, device=self.device)


def make_sampler(p: SamplingParams) -> Callable[[torch.Tensor, torch.Tensor, torch.Generator], torch.Tensor]:
    """``sampler(logits (B, V), recent (B, n) int64, generator) -> tokens (B,) int64``."""
    return sampling.make_sampler(TorchOps, p, TorchOps.draw)
