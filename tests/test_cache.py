"""The KV cache (`attnkit.kv.cache`): geometric growth, crop, reset, its checks."""

from __future__ import annotations

import pytest
import torch

import attnkit as ak


def test_kv_cache_grows_geometrically_crops_and_resets():
    cache = ak.KVCache()
    capacities = set()
    for _ in range(100):
        k, _ = cache.append(torch.randn(1, 2, 1, 4), torch.randn(1, 2, 1, 4))
        capacities.add(cache.capacity)
    assert k.shape == (1, 2, 100, 4) and cache.length == 100
    assert len(capacities) <= 4  # 16, 32, 64, 128: a handful of copies, not one per token
    cache.crop(40)
    assert cache.append(torch.randn(1, 2, 1, 4), torch.randn(1, 2, 1, 4))[0].shape[2] == 41
    cache.reset()
    assert cache.length == 0
    with pytest.raises(ak.ShapeContractError, match="one cache per layer"):
        cache.append(torch.randn(1, 3, 1, 4), torch.randn(1, 3, 1, 4))
