"""Projections `y = x @ W^T` over a stored weight: unquantized, FP8 per row (W8A16) or NVFP4 (W4A16).

Each keeps the checkpoint name it was built from, and can give back the weight it computes with
(`dequantize()`), so a quantized head can be checked against an unquantized head on those weights.
"""

from __future__ import annotations

import torch
from torch import nn

from mtpfactory import kernels as K
from mtpfactory.components.norms import fusable
from mtpfactory.errors import WeightsError
from mtpfactory.quant import NVFP4_BLOCK, dequantize_fp8, dequantize_nvfp4

FORMATS = ("unq", "fp8", "nvfp4")


class Linear(nn.Module):
    fmt = "unq"

    def __init__(self, weight: torch.Tensor, name: str = "", split_work: bool = True) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)  # [out, in], runtime dtype
        self.name, self.split_work = name, split_work

    @property
    def out_features(self) -> int:
        return self.weight.shape[0]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.parameters())

    def dequantize(self) -> torch.Tensor:
        return self.weight.data

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [M, in] -> [M, out]
        return K.linear(x, self.weight, split_work=self.split_work)

    def after_norm(self, norm: nn.Module, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(self(y), y) for y = norm(x + residual): the projection after a head's final norm (its LM head)."""
        y, _ = norm(x, residual=residual)
        return self(y), y


class LinearFP8(Linear):
    """W8A16: float8_e4m3fn weight [out, in] with an fp32 scale per row."""

    fmt = "fp8"

    def __init__(self, weight: torch.Tensor, weight_scale: torch.Tensor, name: str = "",
                 split_work: bool = True) -> None:
        super().__init__(weight, name, split_work)
        self.weight_scale = nn.Parameter(weight_scale, requires_grad=False)  # [out] fp32

    def dequantize(self) -> torch.Tensor:
        return dequantize_fp8(self.weight.data, self.weight_scale.data)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return K.linear_fp8(x, self.weight, self.weight_scale, split_work=self.split_work)


class LinearNVFP4(Linear):
    """W4A16: NVFP4 weight in the ModelOpt layout (packed [out, in/2], e4m3 scales [out, in/16], fp32 global)."""

    fmt = "nvfp4"

    def __init__(self, weight: torch.Tensor, weight_scale: torch.Tensor, weight_scale_2: torch.Tensor,
                 name: str = "", split_work: bool = True) -> None:
        super().__init__(weight, name, split_work)
        self.weight_scale = nn.Parameter(weight_scale, requires_grad=False)
        self.weight_scale_2 = nn.Parameter(weight_scale_2, requires_grad=False)

    def dequantize(self) -> torch.Tensor:
        return dequantize_nvfp4(self.weight.data, self.weight_scale.data, self.weight_scale_2.data)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return K.linear_nvfp4(x, self.weight, self.weight_scale, self.weight_scale_2,
                              split_work=self.split_work)

    def after_norm(self, norm: nn.Module, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """As `Linear.after_norm`, in one op (`rms_norm_linear_nvfp4`) where the norm is the built-in one: on the
        Triton path the norm makes the GEMV's x pass. A norm of another kind runs itself first."""
        if not fusable(norm):
            return super().after_norm(norm, x, residual)
        logits, y, _ = K.rms_norm_linear_nvfp4(x, norm.weight, norm.eps, norm.zero_centred, self.weight,
                                               self.weight_scale, self.weight_scale_2, residual=residual,
                                               split_work=self.split_work)
        return logits, y


class Projections(nn.Module):
    """Projections of one input, `x @ W_i^T` for each part, by one GEMV where their storage allows: parts stored
    alike unquantized, or alike FP8 (a scale a row, so the stacked weight is each part's exactly), are stacked
    row-wise into one weight; NVFP4 parts (a global scale each) or parts stored otherwise run apart. `forward`
    returns each part's output in order, views of the one output's columns where stacked. Each part keeps its
    checkpoint name (`dequantize()` gives its weight back by that name); a stacked projection is named by its
    parts' names joined with "+"."""

    def __init__(self, parts: list[Linear]) -> None:
        super().__init__()
        self.names = [p.name for p in parts]
        self.sizes = [p.out_features for p in parts]
        fmts = {p.fmt for p in parts}
        self.stacked = (len(parts) > 1 and len(fmts) == 1 and fmts <= {"unq", "fp8"}
                        and len({p.split_work for p in parts}) == 1)
        self.parts = nn.ModuleList([_stack(parts)] if self.stacked else parts)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:  # [M, in] -> ([M, out_i], ...)
        if self.stacked:
            return self.parts[0](x).split(self.sizes, dim=-1)
        return tuple(p(x) for p in self.parts)

    def dequantize(self) -> dict[str, torch.Tensor]:
        """Each part's weight [out_i, in] as the head computes with it, by its checkpoint name (without
        `.weight`)."""
        if self.stacked:
            return dict(zip(self.names, self.parts[0].dequantize().split(self.sizes)))
        return {p.name: p.dequantize() for p in self.parts}


def _stack(parts: list[Linear]) -> Linear:
    """One projection of the parts' rows in order, stored as they are (unquantized, or FP8 with their row scales)."""
    weight = torch.cat([p.weight.data for p in parts])
    name, split_work = "+".join(p.name for p in parts), parts[0].split_work
    if parts[0].fmt == "fp8":
        return LinearFP8(weight, torch.cat([p.weight_scale.data for p in parts]), name, split_work)
    return Linear(weight, name, split_work)


def nvfp4_k_refusal(field: str, k: int, fix: str) -> WeightsError | None:
    """Why a weight of `k` columns cannot be stored NVFP4, naming the setting that stores it otherwise, or None."""
    if k % NVFP4_BLOCK:
        return WeightsError(field, k, f"NVFP4 stores blocks of {NVFP4_BLOCK} along K, so K must be a multiple of "
                            f"{NVFP4_BLOCK}", fix)
    return None


def make_linear(weight: torch.Tensor, fmt: str, dtype: torch.dtype, name: str = "",
                split_work: bool = True) -> Linear:
    """Store `weight` ([out, in], as loaded) in `fmt`: unquantized in `dtype`, or quantized from it."""
    tensor = f"{name}.weight" if name else "weight"
    if fmt == "fp8":
        return LinearFP8(*K.quantize_fp8(weight, tensor), name=name, split_work=split_work)
    if fmt == "nvfp4":
        if err := nvfp4_k_refusal(f"{tensor}.shape[1]", weight.shape[1], "store this projection otherwise: quant=fp8 "
                                  "or bf16 (for the LM head, quant.lm_head=fp8 or bf16)"):
            raise err
        return LinearNVFP4(*K.quantize_nvfp4(weight, tensor), name=name, split_work=split_work)
    return Linear(weight.to(dtype), name, split_work)
