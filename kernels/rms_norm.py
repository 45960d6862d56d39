"""RMSNorm, plain (`x * rsqrt(mean(x^2) + eps) * w`) or zero-centred (`... * (1 + w)`), optionally fused
with the residual add that precedes it. Computed in fp32, returned in the input dtype."""

from __future__ import annotations

import torch

from mtpfactory.ops import Op


def _rms_norm_native(x: torch.Tensor, weight: torch.Tensor, eps: float, zero_centred: bool,
                     residual: torch.Tensor | None = None):
    """x, residual: [..., H]; weight: [H]. With `residual`, returns (norm(x + residual), x + residual)."""
    if residual is not None:
        x = x + residual
    xf = x.float()
    w = weight.float() + 1.0 if zero_centred else weight.float()
    y = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * w).to(x.dtype)
    return y if residual is None else (y, x)


rms_norm = Op("rms_norm", _rms_norm_native)
