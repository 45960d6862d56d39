"""FFN components: dense SwiGLU, and the BF16 MoE of Qwen3-Next (softmax top-k, shared expert with a
sigmoid gate)."""

from __future__ import annotations

import logging

import torch
from torch import nn

from mtpfactory import kernels as K
from mtpfactory.components.linear import Linear

log = logging.getLogger(__name__)


class SwiGLU(nn.Module):
    """down(silu(gate(x)) * up(x))."""

    def __init__(self, gate: Linear, up: Linear, down: Linear) -> None:
        super().__init__()
        self.gate, self.up, self.down = gate, up, down

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [N, H] -> [N, H]
        return self.down(torch.nn.functional.silu(self.gate(x)) * self.up(x))


class MoE(nn.Module):
    """sum over the top-k experts of renorm(softmax(router(x))) * expert(x) + sigmoid(shared_gate(x)) * shared(x)."""

    def __init__(self, router: Linear, w_gate_up: torch.Tensor, w_down: torch.Tensor, shared: SwiGLU,
                 shared_gate: Linear, top_k: int, renormalize: bool) -> None:
        super().__init__()
        self.router, self.shared, self.shared_gate = router, shared, shared_gate
        self.w_gate_up = nn.Parameter(w_gate_up, requires_grad=False)  # [E, 2I, H], gate rows first
        self.w_down = nn.Parameter(w_down, requires_grad=False)  # [E, H, I]
        self.top_k, self.renormalize = top_k, renormalize

    @property
    def num_experts(self) -> int:
        return self.w_gate_up.shape[0]

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [N, H] -> [N, H]
        weights, ids = K.moe_route_softmax(self.router(x), self.top_k, self.renormalize)  # [N, k] each
        routed = K.fused_moe(x, self.w_gate_up, self.w_down, weights, ids)
        return routed + torch.sigmoid(self.shared_gate(x)) * self.shared(x)


def _swiglu(ctx, prefix: str, inter: int) -> SwiGLU:
    h = ctx.model.hidden_size
    return SwiGLU(ctx.linear(prefix + "gate_proj", inter, h), ctx.linear(prefix + "up_proj", inter, h),
                  ctx.linear(prefix + "down_proj", h, inter))


def build_swiglu(ctx, prefix: str) -> SwiGLU:
    return _swiglu(ctx, prefix, ctx.model.intermediate_size)


def build_bf16_moe(ctx, prefix: str) -> MoE:
    m = ctx.model
    w_gate_up, w_down = ctx.weights.take_experts(prefix + "experts.", m.num_experts, m.moe_intermediate_size,
                                                 m.hidden_size, ctx.dtype, ctx.device)
    return MoE(ctx.linear(prefix + "gate", m.num_experts, m.hidden_size), w_gate_up, w_down,
               _swiglu(ctx, prefix + "shared_expert.", m.shared_expert_intermediate_size),
               ctx.linear(prefix + "shared_expert_gate", 1, m.hidden_size), m.num_experts_per_tok,
               m.norm_topk_prob)
