"""Adapters that run each backend's sampler on numpy inputs, for shared tests."""

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


BACKENDS = {"mlx": mlx_sample, "torch": torch_sample}
