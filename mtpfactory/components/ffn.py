"""FFN components: dense SwiGLU, and the MoE of Qwen3-Next (softmax top-k over the routed experts, plus a
shared expert blended in through a sigmoid gate), with its experts stored unquantized or NVFP4."""

from __future__ import annotations

import logging

import torch
from torch import nn

from mtpfactory import kernels as K
from mtpfactory.components.linear import Linear, Projections, nvfp4_k_refusal
from mtpfactory.quant import dequantize_nvfp4

log = logging.getLogger(__name__)
PROGRESS_EVERY = 128


class SwiGLU(nn.Module):
    """down(silu(gate(x)) * up(x)); gate and up one GEMV where stored alike (`Projections`)."""

    def __init__(self, gate_up: Projections, down: Linear) -> None:
        super().__init__()
        self.gate_up, self.down = gate_up, down  # gate_up: (gate_proj, up_proj)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [N, H] -> [N, H]
        return self.down(K.silu_mul(*self.gate_up(x)))


class Experts(nn.Module):
    """Routed SwiGLU experts stacked unquantized: gate_up [E, 2I, H] (gate rows first), down [E, H, I]."""

    fmt = "unq"

    def __init__(self, w_gate_up: torch.Tensor, w_down: torch.Tensor) -> None:
        super().__init__()
        self.w_gate_up = nn.Parameter(w_gate_up, requires_grad=False)
        self.w_down = nn.Parameter(w_down, requires_grad=False)

    @property
    def num_experts(self) -> int:
        return self.w_gate_up.shape[0]

    def dequantize(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.w_gate_up.data, self.w_down.data

    def forward(self, x, weights, ids, shared_out, shared_gate):
        return K.fused_moe(x, self.w_gate_up, self.w_down, weights, ids, shared_out=shared_out,
                           shared_gate=shared_gate)


class ExpertsNVFP4(nn.Module):
    """Routed experts stored NVFP4 (W4A16), gate and up quantized as separate tensors as in ModelOpt
    checkpoints: gu_* over [E, 2I, H] with gu_global [E, 2] (gate, up), dn_* over [E, H, I], dn_global [E]."""

    fmt = "nvfp4"

    def __init__(self, gu_weight, gu_scale, gu_global, dn_weight, dn_scale, dn_global) -> None:
        super().__init__()
        for name, t in (("gu_weight", gu_weight), ("gu_scale", gu_scale), ("gu_global", gu_global),
                        ("dn_weight", dn_weight), ("dn_scale", dn_scale), ("dn_global", dn_global)):
            setattr(self, name, nn.Parameter(t, requires_grad=False))

    @property
    def num_experts(self) -> int:
        return self.gu_weight.shape[0]

    @classmethod
    def quantize(cls, w_gate_up: torch.Tensor, w_down: torch.Tensor, prefix: str) -> ExpertsNVFP4:
        """Quantize stacked experts one projection at a time, reporting progress every 128 experts."""
        e, inter = w_gate_up.shape[0], w_gate_up.shape[1] // 2
        for name, k in (("gate_proj", w_gate_up.shape[2]), ("down_proj", w_down.shape[2])):  # K: hidden, inter
            if err := nvfp4_k_refusal(f"{prefix}0.{name}.weight.shape[1]", k,
                                      "keep the experts unquantized: levers.experts_nvfp4=false"):
                raise err
        parts: list[list[tuple[torch.Tensor, ...]]] = [[], [], []]
        for i in range(e):
            for j, (w, name) in enumerate(((w_gate_up[i, :inter], "gate_proj"), (w_gate_up[i, inter:], "up_proj"),
                                           (w_down[i], "down_proj"))):
                parts[j].append(K.quantize_nvfp4(w, name=f"{prefix}{i}.{name}.weight"))
            if (i + 1) % PROGRESS_EVERY == 0:
                log.info("  MTP experts quantized: %d/%d", i + 1, e)
        gate, up, down = ([torch.stack(t) for t in zip(*p)] for p in parts)  # each (weights, scales, globals)
        return cls(torch.cat([gate[0], up[0]], dim=1), torch.cat([gate[1], up[1]], dim=1),
                   torch.stack([gate[2], up[2]], dim=1), *down)

    def dequantize(self) -> tuple[torch.Tensor, torch.Tensor]:
        inter = self.gu_weight.shape[1] // 2
        gu = [torch.cat([dequantize_nvfp4(self.gu_weight[i, :inter], self.gu_scale[i, :inter], self.gu_global[i, 0]),
                         dequantize_nvfp4(self.gu_weight[i, inter:], self.gu_scale[i, inter:], self.gu_global[i, 1])])
              for i in range(self.num_experts)]
        dn = [dequantize_nvfp4(self.dn_weight[i], self.dn_scale[i], self.dn_global[i]) for i in range(self.num_experts)]
        return torch.stack(gu), torch.stack(dn)

    def forward(self, x, weights, ids, shared_out, shared_gate):
        return K.fused_moe_nvfp4(x, self.gu_weight, self.gu_scale, self.gu_global, self.dn_weight, self.dn_scale,
                                 self.dn_global, weights, ids, shared_out=shared_out, shared_gate=shared_gate)


class MoE(nn.Module):
    """sum over the top-k experts of renorm(softmax(router(x))) * expert(x) + sigmoid(shared_gate(x)) * shared(x),
    shared(x) = shared_down(silu(shared_gate_proj(x)) * shared_up(x)). The four projections of x (router,
    the shared expert's gate and up, its blend gate) are one GEMV where stored alike (`Projections`)."""

    def __init__(self, x_proj: Projections, experts: nn.Module, shared_down: Linear, top_k: int,
                 renormalize: bool) -> None:
        super().__init__()
        self.x_proj, self.experts, self.shared_down = x_proj, experts, shared_down
        self.top_k, self.renormalize = top_k, renormalize

    @property
    def num_experts(self) -> int:
        return self.experts.num_experts

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [N, H] -> [N, H]
        logits, gate, up, shared_gate = self.x_proj(x)  # [N, E], [N, I_s] twice, [N, 1]
        weights, ids = K.moe_route_softmax(logits, self.top_k, self.renormalize)  # [N, k] each
        shared = self.shared_down(K.silu_mul(gate, up))
        return self.experts(x, weights, ids, shared, shared_gate)


def build_swiglu(ctx, prefix: str) -> SwiGLU:
    m = ctx.model
    h, inter = m.hidden_size, m.intermediate_size
    return SwiGLU(Projections([ctx.linear(prefix + "gate_proj", inter, h, "ffn"),
                               ctx.linear(prefix + "up_proj", inter, h, "ffn")]),
                  ctx.linear(prefix + "down_proj", h, inter, "ffn"))


def build_moe(ctx, prefix: str) -> MoE:
    """The Qwen3-Next MoE; its experts are stored as the `experts` role says (unq or nvfp4)."""
    m = ctx.model
    w_gate_up, w_down = ctx.weights.take_experts(prefix + "experts.", m.num_experts, m.moe_intermediate_size,
                                                 m.hidden_size, ctx.dtype, ctx.device)
    experts = (ExpertsNVFP4.quantize(w_gate_up, w_down, prefix + "experts.") if ctx.fmt("experts") == "nvfp4"
               else Experts(w_gate_up, w_down))
    h, shared, inter = m.hidden_size, prefix + "shared_expert.", m.shared_expert_intermediate_size
    x_proj = Projections([ctx.linear(prefix + "gate", m.num_experts, h, "router"),
                          ctx.linear(shared + "gate_proj", inter, h, "shared_expert"),
                          ctx.linear(shared + "up_proj", inter, h, "shared_expert"),
                          ctx.linear(prefix + "shared_expert_gate", 1, h, "router")])
    return MoE(x_proj, experts, ctx.linear(shared + "down_proj", h, inter, "shared_expert"), m.num_experts_per_tok,
               m.norm_topk_prob)
