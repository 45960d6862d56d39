"""Synthetic checkpoints: the tensors a real Qwen-style MTP checkpoint carries, under the same names, at a
realistic scale (linear weights ~ N(0, 1/fan_in), norm weights near zero for the zero-centred norms),
generated in BF16 from a seed. They load through the same path as a checkpoint."""

from __future__ import annotations

import torch
from omegaconf import DictConfig

MTP = "mtp."
LAYER = "mtp.layers.0."


def qwen_mtp_weights(model: DictConfig, ffn_form: str, seed: int, *,
                     fused_experts: bool = False) -> dict[str, torch.Tensor]:
    """Checkpoint-named BF16 tensors for a Qwen-style MTP head with a `dense` or `moe` FFN."""
    g = torch.Generator().manual_seed(seed)
    h, nq, nkv, hd = model.hidden_size, model.num_attention_heads, model.num_key_value_heads, model.head_dim

    def lin(n: int, k: int, *lead: int) -> torch.Tensor:
        return (torch.randn(*lead, n, k, generator=g) * k ** -0.5).to(torch.bfloat16)

    def norm(n: int) -> torch.Tensor:
        return (torch.randn(n, generator=g) * 0.1).to(torch.bfloat16)

    w = {
        "model.embed_tokens.weight": (torch.randn(model.vocab_size, h, generator=g) * 0.02).to(torch.bfloat16),
        MTP + "fc.weight": lin(h, 2 * h),
        MTP + "pre_fc_norm_embedding.weight": norm(h),
        MTP + "pre_fc_norm_hidden.weight": norm(h),
        MTP + "norm.weight": norm(h),
        LAYER + "input_layernorm.weight": norm(h),
        LAYER + "post_attention_layernorm.weight": norm(h),
        LAYER + "self_attn.q_proj.weight": lin(nq * hd * 2, h),
        LAYER + "self_attn.k_proj.weight": lin(nkv * hd, h),
        LAYER + "self_attn.v_proj.weight": lin(nkv * hd, h),
        LAYER + "self_attn.o_proj.weight": lin(h, nq * hd),
        LAYER + "self_attn.q_norm.weight": norm(hd),
        LAYER + "self_attn.k_norm.weight": norm(hd),
    }
    if not model.tie_word_embeddings:
        w["lm_head.weight"] = lin(model.vocab_size, h)
    mlp = LAYER + "mlp."
    if ffn_form == "dense":
        i = model.intermediate_size
        w |= {mlp + "gate_proj.weight": lin(i, h), mlp + "up_proj.weight": lin(i, h),
              mlp + "down_proj.weight": lin(h, i)}
        return w
    e, i, si = model.num_experts, model.moe_intermediate_size, model.shared_expert_intermediate_size
    w[mlp + "gate.weight"] = lin(e, h)
    w[mlp + "shared_expert_gate.weight"] = lin(1, h)
    w |= {mlp + "shared_expert.gate_proj.weight": lin(si, h), mlp + "shared_expert.up_proj.weight": lin(si, h),
          mlp + "shared_expert.down_proj.weight": lin(h, si)}
    if fused_experts:
        w[mlp + "experts.gate_up_proj"] = lin(2 * i, h, e)
        w[mlp + "experts.down_proj"] = lin(h, i, e)
    else:
        for x in range(e):
            p = f"{mlp}experts.{x}."
            w |= {p + "gate_proj.weight": lin(i, h), p + "up_proj.weight": lin(i, h), p + "down_proj.weight": lin(h, i)}
    return w
