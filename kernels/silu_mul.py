"""SwiGLU's activation: `silu(gate) * up`, rounded where torch's two eager ops round (the SiLU to the inputs'
dtype, then the product). The Triton provider reads gate and up at their row strides (columns of one stacked
gate|up output, `Projections`) and makes both in one launch, where torch took two."""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from mtpfactory.errors import InputError
from mtpfactory.kernels.fp_bits import cast_rne
from mtpfactory.ops import FLOATS, Op, cdiv, next_power_of_2, out_or_empty, out_refusal, overlap_refusal, write_out


def _contract(gate: torch.Tensor, up: torch.Tensor, out: torch.Tensor | None = None) -> InputError | None:
    """What the reference refuses before anything runs (every provider refuses the same): gate a bf16, fp16 or fp32
    [N, I]; up of its shape and dtype; `out` of that shape and dtype."""
    if gate.dim() != 2 or gate.dtype not in FLOATS:
        return InputError("gate", f"{gate.dtype} {list(gate.shape)}", "a bf16, fp16 or fp32 [N, I] tensor",
                          "pass the gate projection's rows")
    if up.shape != gate.shape or up.dtype != gate.dtype:
        return InputError("up", f"{up.dtype} {list(up.shape)}", f"gate's shape and dtype, {gate.dtype} "
                          f"{list(gate.shape)}", "pass the up projection's rows beside the gate's")
    return out_refusal(out, gate.shape, gate.dtype, gate.device)


def _silu_mul_native(gate: torch.Tensor, up: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """gate, up: [N, I]. Returns silu(gate) * up in their dtype (written into `out` when given)."""
    if err := _contract(gate, up, out):
        raise err
    return write_out(out, torch.nn.functional.silu(gate) * up)


silu_mul = Op("silu_mul", _silu_mul_native, _contract)


# --- Triton ---------------------------------------------------------------------------------------------------

@triton.jit
def _silu_mul_kernel(gate_ptr, up_ptr, out_ptr, I, stride_g, stride_u, stride_o, BLOCK: tl.constexpr,
                     LIBDEVICE_EXP: tl.constexpr):
    """Program (row n, block of I): the SiLU in fp32 as torch computes it (g / (1 + exp(-g))), rounded to the
    dtype, times up, rounded."""
    n = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < I
    dtype = out_ptr.dtype.element_ty
    g = tl.load(gate_ptr + n * stride_g + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(up_ptr + n * stride_u + cols, mask=mask, other=0.0).to(tl.float32)
    if LIBDEVICE_EXP:   # the GPU: __nv_expf, as torch's CUDA kernel (tl.exp is the approximate ex2)
        e = libdevice.exp(-g)
    else:               # the interpreter, which has no libdevice
        e = tl.exp(-g)
    s = cast_rne(g / (1.0 + e), dtype).to(tl.float32)
    tl.store(out_ptr + n * stride_o + cols, cast_rne(s * u, dtype), mask=mask)


_BLOCK = 1024
_MAX_ROWS = 2**31 - 1      # grid axis 0
_MAX_COL_PROGRAMS = 65535  # grid axis 1


def silu_mul_refusal(gate: torch.Tensor, up: torch.Tensor, out: torch.Tensor | None = None) -> InputError | None:
    """Why the Triton provider cannot take this call, or None: gate, up and `out` with unit stride along I (rows at
    any stride), on one device; N < 2^31 and I in at most 65535 programs of 1024 (the grid); `out` apart from
    gate and up, or one of them itself (each element is read before it is written, by its own program)."""
    if err := _contract(gate, up, out):
        return err
    n, i = gate.shape
    for name, t in (("gate", gate), ("up", up), ("out", out)):
        if t is not None and i > 1 and t.stride(1) != 1:
            return InputError(name, f"strides {t.stride()} of {list(t.shape)}", "unit stride along I (rows at any "
                              "stride)", f"pass {name}.contiguous()")
    if up.device != gate.device:
        return InputError("up", f"on {up.device}", f"on gate's device, {gate.device}", "pass up.to(gate.device)")
    if n > _MAX_ROWS or cdiv(i, _BLOCK) > _MAX_COL_PROGRAMS:
        return InputError("gate", f"{list(gate.shape)}", f"N <= {_MAX_ROWS} and I <= {_MAX_COL_PROGRAMS * _BLOCK} "
                          "(the grid)", "call the op (`silu_mul`) under runtime.backend=auto: it runs the reference "
                          "for others")
    return overlap_refusal("out", out, in_place=("gate", "up"), gate=gate, up=up)


def silu_mul_launch(gate: torch.Tensor, up: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """The op on operands `silu_mul_refusal` passed (the op's predicate checked them: one check a call)."""
    n, i = gate.shape
    y = out_or_empty(out, gate.shape, gate.dtype, gate.device)
    if n == 0 or i == 0:
        return y
    block = min(_BLOCK, next_power_of_2(i))
    _silu_mul_kernel[(n, cdiv(i, block))](gate, up, y, i, gate.stride(0), up.stride(0), y.stride(0), BLOCK=block,
                                          LIBDEVICE_EXP=gate.is_cuda, num_warps=4)
    return y


silu_mul.register_provider("triton", silu_mul_launch, silu_mul_refusal)
