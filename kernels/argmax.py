"""Batched argmax over the vocab, ties to the lowest index."""

from __future__ import annotations

import torch

from mtpfactory.ops import Op


def _argmax_native(logits: torch.Tensor) -> torch.Tensor:
    """logits: [B, V]. Returns int64 [B]: the first index of each row's maximum."""
    return torch.argmax(logits, dim=-1)


argmax = Op("argmax", _argmax_native)
