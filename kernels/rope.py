"""NeoX-style rotary embedding on the first `rotary_dim` dims of each head (the rest pass through)."""

from __future__ import annotations

import torch

from mtpfactory.ops import Op


def _rope_neox_native(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """x: [N, heads, D]; positions: [N] int; inv_freq: [rotary_dim / 2] fp32. Returns x rotated, x's dtype.

    Pairs (i, i + rotary_dim/2) rotate by angle position * inv_freq[i]; cos and sin are rounded to x's
    dtype before use, as the Hugging Face models do.
    """
    rd = 2 * inv_freq.numel()
    freqs = positions.to(torch.float32)[:, None] * inv_freq.to(x.device, torch.float32)[None, :]  # [N, rd/2]
    emb = torch.cat([freqs, freqs], dim=-1)
    cos, sin = emb.cos().to(x.dtype)[:, None, :], emb.sin().to(x.dtype)[:, None, :]  # [N, 1, rd]
    rot, rest = x[..., :rd], x[..., rd:]
    half = rd // 2
    rotated = torch.cat([-rot[..., half:], rot[..., :half]], dim=-1)
    return torch.cat([rot * cos + rotated * sin, rest], dim=-1)


rope_neox = Op("rope_neox", _rope_neox_native)


def rope_inv_freq(rotary_dim: int, theta: float) -> torch.Tensor:
    """The inverse frequencies of NeoX RoPE: theta^(-2i / rotary_dim), fp32 [rotary_dim / 2]."""
    return 1.0 / (theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.float32) / rotary_dim))
