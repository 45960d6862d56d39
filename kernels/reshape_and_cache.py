"""Write rows of K and V into the paged cache at their slots (slot = block * block_size + offset)."""

from __future__ import annotations

import torch

from mtpfactory.ops import Op


def _reshape_and_cache_native(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                              v_cache: torch.Tensor, slots: torch.Tensor) -> None:
    """k, v: [N, kv_heads, D]; k_cache, v_cache: [blocks, block_size, kv_heads, D]; slots: [N] int.

    Values are cast to the cache dtype; in place."""
    nb, bs = k_cache.shape[:2]
    k_cache.view(nb * bs, *k_cache.shape[2:])[slots] = k.to(k_cache.dtype)
    v_cache.view(nb * bs, *v_cache.shape[2:])[slots] = v.to(v_cache.dtype)


reshape_and_cache = Op("reshape_and_cache", _reshape_and_cache_native)
