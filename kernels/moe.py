"""MoE routing (softmax top-k, optionally renormalized) and the MoE over only the selected experts
(SwiGLU experts, weighted sum)."""

from __future__ import annotations

import torch

from mtpfactory.ops import Op


def _moe_route_softmax_native(router_logits: torch.Tensor, top_k: int, renormalize: bool):
    """router_logits: [N, E]. Returns (weights fp32 [N, top_k], expert ids int64 [N, top_k]).

    Softmax over all experts in fp32, the top_k largest (ties to the lower id), divided by their sum when
    `renormalize`."""
    probs = torch.softmax(router_logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


moe_route_softmax = Op("moe_route_softmax", _moe_route_softmax_native)


def _fused_moe_native(x: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor,
                      topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
    """x: [N, H]; w_gate_up: [E, 2I, H] (gate rows first); w_down: [E, H, I];
    topk_weights, topk_ids: [N, k]. Returns sum_j w_j * down_j(silu(gate_j x) * up_j x), [N, H] x's dtype.

    Only the selected experts are read; each expert's output is rounded to x's dtype before it is
    weighted (fp32 weight) and accumulated in fp32."""
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    inter = w_down.shape[-1]
    for e in torch.unique(topk_ids).tolist():
        rows, slot = torch.nonzero(topk_ids == e, as_tuple=True)
        gate_up = torch.nn.functional.linear(x[rows], w_gate_up[e])  # [n, 2I]
        h = torch.nn.functional.silu(gate_up[:, :inter]) * gate_up[:, inter:]
        y = torch.nn.functional.linear(h, w_down[e])  # [n, H]
        out.index_add_(0, rows, y.float() * topk_weights[rows, slot, None].float())
    return out.to(x.dtype)


fused_moe = Op("fused_moe", _fused_moe_native)
