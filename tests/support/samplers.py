"""Each implementation of the sampler's rules run on numpy inputs, for the shared tests: the two engines' samplers
and the numpy distribution speculative decoding verifies against."""

import numpy as np


def mlx_sample(logits: np.ndarray, recent: np.ndarray, params, seed: int) -> np.ndarray:
    import mlx.core as mx

    from umakit.backends.mlx.sampler import make_sampler

    out = make_sampler(params)(mx.array(logits), mx.array(recent.astype(np.uint32)), mx.random.key(seed))
    return np.array(out)


def torch_sample(logits: np.ndarray, recent: np.ndarray, params, seed: int) -> np.ndarray:
    import torch

    from umakit.backends.torch.sampler import make_sampler

    generator = torch.Generator().manual_seed(seed)
    out = make_sampler(params)(torch.from_numpy(logits), torch.from_numpy(recent.astype(np.int64)), generator)
    return out.numpy()


def numpy_sample(logits: np.ndarray, recent: np.ndarray, params, seed: int) -> np.ndarray:
    from umakit.generate.speculative.distribution import draw, greedy_token, probabilities

    rng = np.random.default_rng(seed)
    return np.array([greedy_token(z, r, params) if params.greedy else draw(probabilities(z, r, params), rng)
                     for z, r in zip(logits, recent)])


BACKENDS = {"mlx": mlx_sample, "torch": torch_sample, "numpy": numpy_sample}
