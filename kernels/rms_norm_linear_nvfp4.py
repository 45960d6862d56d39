"""The final RMSNorm and the NVFP4 projection after it (the LM head), as one op:
`y = rms_norm(x [+ residual])`, `logits = y @ dequantize_nvfp4(weight, ...)^T`; returns (logits, y) or, with
`residual`, (logits, y, x + residual).

The reference is the two references in turn. The Triton provider runs the two Triton providers in turn,
but where the GEMV's plan runs x's pass (16-bit x, several rows or a weight of 2^26
elements or more, the LM heads) the norm makes that pass's pairs and exponents from the row it holds in
registers (`rms_norm_triton(x_pairs=...)`) and the GEMV reads them: one launch fewer, and no reload of x.
The call is planned once for this weight (`planned`), for the pairs (`x_pairs_for`) and the GEMV, so the pairs
are in the order of the kernel the GEMV runs on it (not the wgmma kernel's where its TMA cannot read the weight).
The GEMV is then a programmatic dependent launch after the norm (`linear.x_pass_pdl`). Its results equal
the two providers' in turn bit for bit.
"""

from __future__ import annotations

import torch

from mtpfactory.kernels.linear import x_pass_pdl
from mtpfactory.kernels.linear_nvfp4 import (
    _linear_nvfp4_native,
    _run_planned,
    nvfp4_contract,
    operand_refusal,
    planned,
    x_pairs_for,
)
from mtpfactory.kernels.rms_norm import _rms_norm_native, norm_contract, rms_norm_launch, rms_norm_refusal
from mtpfactory.ops import Op, number_refusal


def _rms_norm_linear_nvfp4_native(x: torch.Tensor, norm_weight: torch.Tensor, eps: float, zero_centred: bool,
                                  weight: torch.Tensor, weight_scale: torch.Tensor, weight_scale_2: torch.Tensor,
                                  residual: torch.Tensor | None = None, split_work: bool = True):
    """x, residual [M, H]; norm_weight [H]; the NVFP4 weight [N, H/2] as `linear_nvfp4`'s (`_contract`)."""
    if err := _contract(x, norm_weight, eps, zero_centred, weight, weight_scale, weight_scale_2, residual):
        raise err
    normed = _rms_norm_native(x, norm_weight, eps, zero_centred, residual)
    y = normed if residual is None else normed[0]
    logits = _linear_nvfp4_native(y, weight, weight_scale, weight_scale_2)
    return (logits, y) if residual is None else (logits, *normed)


def _contract(x, norm_weight, eps, zero_centred, weight, weight_scale, weight_scale_2, residual=None,
              split_work=True):
    """What the reference refuses before anything runs (every provider refuses the same): the norm's operands
    (`norm_contract`, its weight named norm_weight), then the projection's (`nvfp4_contract`)."""
    return (norm_contract(x, norm_weight, residual, weight_field="norm_weight")
            or nvfp4_contract(x, weight, weight_scale, weight_scale_2))


rms_norm_linear_nvfp4 = Op("rms_norm_linear_nvfp4", _rms_norm_linear_nvfp4_native, _contract)


def rms_norm_linear_nvfp4_triton(x: torch.Tensor, norm_weight: torch.Tensor, eps: float, zero_centred: bool,
                                 weight: torch.Tensor, weight_scale: torch.Tensor, weight_scale_2: torch.Tensor,
                                 residual: torch.Tensor | None = None, split_work: bool = True):
    """The Triton provider; the norm's operands (`rms_norm_refusal`) and the NVFP4 ones (`operand_refusal`)
    refused before anything is launched, as the op's predicate refuses them."""
    if err := (rms_norm_refusal(x, norm_weight, residual, "norm_weight") or number_refusal("eps", eps)
               or operand_refusal(x, weight, weight_scale, weight_scale_2)):
        raise err
    return _rms_norm_linear_nvfp4(x, norm_weight, eps, zero_centred, weight, weight_scale, weight_scale_2, residual,
                                  split_work)


def _rms_norm_linear_nvfp4(x: torch.Tensor, norm_weight: torch.Tensor, eps: float, zero_centred: bool,
                           weight: torch.Tensor, weight_scale: torch.Tensor, weight_scale_2: torch.Tensor,
                           residual: torch.Tensor | None = None, split_work: bool = True):
    """`rms_norm_linear_nvfp4_triton` on NVFP4 operands already checked (the op's predicate did, on x, which has
    the norm's shape and dtype)."""
    m, k = x.shape
    n = weight.shape[0]
    plan = planned(x, n, k, split_work, weight, weight_scale)[0] if m and n else None   # once: pairs and GEMV
    x_pairs = None if plan is None else x_pairs_for(x, n, k, plan)
    pdl = x_pairs is not None and x_pass_pdl(x)
    normed = rms_norm_launch(x, norm_weight, eps, zero_centred, residual, x_pairs=x_pairs, pdl=pdl)
    y = normed if residual is None else normed[0]
    logits = _run_planned(y, weight, weight_scale, weight_scale_2, None, plan, x_pairs)
    return (logits, y) if residual is None else (logits, *normed)


def _rms_norm_linear_nvfp4_refusal(x, norm_weight, eps, zero_centred, weight, weight_scale, weight_scale_2,
                                   residual=None, split_work=True):
    return (rms_norm_refusal(x, norm_weight, residual, "norm_weight") or number_refusal("eps", eps)
            or operand_refusal(x, weight, weight_scale, weight_scale_2))


rms_norm_linear_nvfp4.register_provider("triton", _rms_norm_linear_nvfp4, _rms_norm_linear_nvfp4_refusal)
