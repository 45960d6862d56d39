"""y = x @ W^T: the GEMV (M = 1) and small-M GEMM of every projection and of the LM head."""

from __future__ import annotations

import torch

from mtpfactory.ops import Op


def _linear_native(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x: [M, K]; weight: [N, K] in x's dtype. Returns [M, N]."""
    return torch.nn.functional.linear(x, weight)


linear = Op("linear", _linear_native)
