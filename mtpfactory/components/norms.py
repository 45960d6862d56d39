"""RMSNorm components: zero-centred (`* (1 + w)`, the Qwen-style heads) and plain (`* w`)."""

from __future__ import annotations

import torch
from torch import nn

from mtpfactory import kernels as K


class RMSNorm(nn.Module):
    def __init__(self, weight: torch.Tensor, eps: float, zero_centred: bool) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.eps, self.zero_centred = eps, zero_centred

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """norm(x), or with `residual` the fused (norm(x + residual), x + residual)."""
        return K.rms_norm(x, self.weight, self.eps, self.zero_centred, residual)


def fusable(norm: nn.Module) -> bool:
    """Whether an op may make `norm` inside a neighbour's kernel, reading its weight, eps and kind: the built-in
    RMSNorm itself only. A subclass or a user's own norm may change `forward`, so it runs itself."""
    return type(norm) is RMSNorm


def build_zero_centred_rmsnorm(ctx, name: str, dim: int, eps: float) -> RMSNorm:
    return RMSNorm(ctx.tensor(name, dim), eps, zero_centred=True)


def build_rmsnorm(ctx, name: str, dim: int, eps: float) -> RMSNorm:
    return RMSNorm(ctx.tensor(name, dim), eps, zero_centred=False)
