"""Embedding gather: rows of the token table."""

from __future__ import annotations

import torch

from mtpfactory.ops import Op


def _embedding_native(ids: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """ids: [N] int; table: [V, H]. Returns [N, H]."""
    return table.index_select(0, ids)


embedding = Op("embedding", _embedding_native)
