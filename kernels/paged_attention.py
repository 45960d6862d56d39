"""Paged decode attention: one query row per sequence over its cached K/V, GQA, with the output gate
(`out * sigmoid(gate)`) fused."""

from __future__ import annotations

import torch

from mtpfactory.ops import Op


def _paged_decode_attention_native(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                                   block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float,
                                   gate: torch.Tensor | None = None) -> torch.Tensor:
    """q, gate: [B, q_heads, D]; k_cache, v_cache: [blocks, block_size, kv_heads, D];
    block_tables: [B, max_blocks] int (a row's slots in order); context_lens: [B] int (slots to attend).

    Softmax in fp32; returns [B, q_heads, D] in q's dtype."""
    b, hq, d = q.shape
    bs, hkv = k_cache.shape[1], k_cache.shape[2]
    out = torch.empty_like(q)
    for i in range(b):
        n = int(context_lens[i])
        blocks = block_tables[i, : (n + bs - 1) // bs].long()
        k = k_cache[blocks].reshape(-1, hkv, d)[:n].float()  # [n, kv_heads, D]
        v = v_cache[blocks].reshape(-1, hkv, d)[:n].float()
        k = k.repeat_interleave(hq // hkv, dim=1)  # [n, q_heads, D]
        v = v.repeat_interleave(hq // hkv, dim=1)
        scores = torch.einsum("hd,nhd->hn", q[i].float(), k) * scale  # [q_heads, n]
        out[i] = torch.einsum("hn,nhd->hd", scores.softmax(dim=-1), v).to(q.dtype)
    if gate is not None:
        out = out * torch.sigmoid(gate)
    return out


paged_decode_attention = Op("paged_decode_attention", _paged_decode_attention_native)
