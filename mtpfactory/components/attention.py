"""Gated GQA attention (Qwen3-Next full attention) over the drafter's paged KV cache.

q|gate = q_proj(x) viewed [heads, 2 * head_dim] (per head: q first, then its gate); q = q_norm(q),
k = k_norm(k_proj(x)), v = v_proj(x) (k_proj and v_proj one GEMV where stored alike, `Projections`); NeoX RoPE on
the first partial_rotary_factor of head_dim; out = o_proj(attention(q, K, V) * sigmoid(gate)).
"""

from __future__ import annotations

import torch
from torch import nn

from mtpfactory import kernels as K
from mtpfactory.components.cache import PagedKVCache
from mtpfactory.components.linear import Linear, Projections
from mtpfactory.components.norms import fusable
from mtpfactory.kernels.rope import rope_inv_freq


class GatedGQAAttention(nn.Module):
    def __init__(self, q_proj: Linear, kv_proj: Projections, o_proj: Linear, q_norm: nn.Module, k_norm: nn.Module,
                 *, num_heads: int, num_kv_heads: int, head_dim: int, rotary_dim: int, rope_theta: float,
                 cache: PagedKVCache) -> None:
        super().__init__()
        self.q_proj, self.kv_proj, self.o_proj = q_proj, kv_proj, o_proj  # kv_proj: (k_proj, v_proj)
        self.q_norm, self.k_norm = q_norm, k_norm
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        # on the cache's device: the Triton RoPE reads it there (on the CPU, `auto` ran the reference every call)
        self.register_buffer("inv_freq", rope_inv_freq(rotary_dim, rope_theta).to(cache.k.device), persistent=False)
        self.scale = head_dim ** -0.5
        self.cache = cache

    def _norm_rope(self, norm: nn.Module, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """norm(x) rotated, [N, heads, D]; x may be a strided view. The built-in RMSNorm makes both in one op
        (`rms_norm_rope`, which reads x at its strides); a norm of another kind (a user's) runs, then the RoPE."""
        if fusable(norm):
            return K.rms_norm_rope(x, norm.weight, norm.eps, norm.zero_centred, positions, self.inv_freq)
        return K.rope_neox(norm(x.contiguous()), positions, self.inv_freq)

    def _kv(self, x: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        n = x.shape[0]
        k, v = (t.view(n, self.num_kv_heads, self.head_dim) for t in self.kv_proj(x))  # [N, kv_heads, D] each
        return self._norm_rope(self.k_norm, k, positions), v

    def write_kv(self, x: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor) -> None:
        """Write the K/V rows of x (already input-normed, [N, H]) at `slots`, without attending."""
        k, v = self._kv(x, positions)
        c = self.cache
        if c.k.dtype == torch.float8_e4m3fn:
            K.reshape_and_cache_fp8(k, v, c.k, c.v, slots, c.k_scale, c.v_scale)
        else:
            K.reshape_and_cache(k, v, c.k, c.v, slots)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
                block_tables: torch.Tensor, context_lens: torch.Tensor) -> torch.Tensor:
        """One row per sequence: write its K/V at `slots`, attend over its context; [B, H] -> [B, H]."""
        b = x.shape[0]
        qg = self.q_proj(x).view(b, self.num_heads, 2 * self.head_dim)
        q, gate = qg[..., : self.head_dim], qg[..., self.head_dim:]  # [B, heads, D] each (strided views)
        q = self._norm_rope(self.q_norm, q, positions)
        self.write_kv(x, positions, slots)
        c = self.cache
        a = K.paged_decode_attention(q, c.k, c.v, block_tables, context_lens, self.scale, gate,
                                     k_scale=c.k_scale, v_scale=c.v_scale)
        return self.o_proj(a.reshape(b, self.num_heads * self.head_dim))


def build_gated_gqa(ctx, prefix: str, *, q_norm: nn.Module, k_norm: nn.Module,
                    cache: PagedKVCache) -> GatedGQAAttention:
    m = ctx.model
    h, nq, nkv, hd = m.hidden_size, m.num_attention_heads, m.num_key_value_heads, m.head_dim
    return GatedGQAAttention(
        ctx.linear(prefix + "q_proj", nq * hd * 2, h, "q"),
        Projections([ctx.linear(prefix + "k_proj", nkv * hd, h, "k"),
                     ctx.linear(prefix + "v_proj", nkv * hd, h, "v")]),
        ctx.linear(prefix + "o_proj", h, nq * hd, "o"),
        q_norm, k_norm, num_heads=nq, num_kv_heads=nkv, head_dim=hd,
        rotary_dim=int(hd * m.partial_rotary_factor), rope_theta=m.rope_theta, cache=cache)
