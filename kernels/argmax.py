"""Batched argmax over the vocab, ties to the lowest index."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mtpfactory.errors import InputError
from mtpfactory.ops import Op, cdiv, next_power_of_2, out_or_empty, out_refusal, overlap_refusal, write_out


def _argmax_shape_refusal(logits: torch.Tensor) -> InputError | None:
    """Why no provider can take the argmax of these rows, or None: bool or complex logits (no order torch.argmax
    takes), or a row of V = 0 logits, which has no index."""
    if logits.dtype == torch.bool or logits.dtype.is_complex:
        return InputError("logits", f"{logits.dtype} {list(logits.shape)}", "real numbers (floating point or "
                          "integers): bool and complex have no order to take the maximum of",
                          "pass the logits themselves (a mask: logits.float())")
    if logits.dim() > 0 and logits.shape[-1] == 0:
        return InputError("logits", f"{logits.dtype} {list(logits.shape)}",
                          "at least one logit a row (V >= 1): an empty row has no argmax",
                          "pass the rows of the vocabulary's logits")
    return None


def _argmax_native(logits: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """logits: [B, V], V >= 1. Returns int64 [B]: the first index of each row's maximum (written into `out`
    when given)."""
    if err := _contract(logits, out):
        raise err
    return write_out(out, torch.argmax(logits, dim=-1))


def _contract(logits: torch.Tensor, out: torch.Tensor | None = None) -> InputError | None:
    """What the reference refuses before anything runs (every provider refuses the same)."""
    return (_argmax_shape_refusal(logits)
            or out_refusal(out, logits.shape[:-1], torch.int64, logits.device))    # torch.argmax(dim=-1)'s


argmax = Op("argmax", _argmax_native, _contract)


# --- Triton ---------------------------------------------------------------------------------------------------
# Two stages: each (row, chunk of V) program reduces its chunk to (max, index) partials; one program per row
# then reduces the partials. A row that fits one chunk skips the second stage.

@triton.jit
def first_max(x, idx, mask, V):
    """(max, index of its first occurrence) of x's `mask` lanes, where NaN beats every number (the first NaN
    wins), as torch.argmax has it. Three plain reductions rather than one over (value, index) pairs: the
    same on the GPU, and fast under the interpreter, whose custom-combine reduce runs in Python."""
    isnan = (x != x) & mask
    nan_idx = tl.min(tl.where(isnan, idx, V), axis=0)
    m = tl.max(tl.where(mask & ~isnan, x, float("-inf")), axis=0)
    max_idx = tl.min(tl.where(mask & (x == m), idx, V), axis=0)
    has_nan = nan_idx < V
    return tl.where(has_nan, float("nan"), m), tl.where(has_nan, nan_idx, max_idx)


@triton.jit
def _argmax_chunk_kernel(logits_ptr, stride_b, V, part_val_ptr, part_idx_ptr, out_ptr, stride_o, n_chunks,
                         CHUNK: tl.constexpr, SINGLE: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    idx = chunk * CHUNK + tl.arange(0, CHUNK)  # [CHUNK] int32 (V <= 2**30)
    mask = idx < V
    x = tl.load(logits_ptr + b * stride_b + idx, mask=mask, other=float("-inf")).to(tl.float32)
    val, i = first_max(x, idx, mask, V)
    if SINGLE:
        tl.store(out_ptr + b * stride_o, i.to(tl.int64))
    else:
        tl.store(part_val_ptr + b * n_chunks + chunk, val)
        tl.store(part_idx_ptr + b * n_chunks + chunk, i)


@triton.jit
def _argmax_partials_kernel(part_val_ptr, part_idx_ptr, out_ptr, stride_o, n_chunks, V, BLOCK: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    c = tl.arange(0, BLOCK)
    mask = c < n_chunks
    val = tl.load(part_val_ptr + b * n_chunks + c, mask=mask, other=float("-inf"))
    idx = tl.load(part_idx_ptr + b * n_chunks + c, mask=mask, other=V)
    _, i = first_max(val, idx, mask, V)
    tl.store(out_ptr + b * stride_o, i.to(tl.int64))


_FLOATS = (torch.float32, torch.bfloat16, torch.float16)
_CHUNK = 2048  # elements per first-stage program: V = 152k gives 75 programs a row
_MAX_V = 2**30  # indices are int32 in the kernel
_MAX_ROWS = 2**31 - 1  # grid axis 0 (rows)
_MAX_CHUNKS = 65535  # grid axis 1 (chunks of a row)


def _chunk_for(V: int, chunk: int | None) -> int:
    """The launch's chunk: `chunk` capped at V; None: `_CHUNK`, or, for V past 65535 * 2048, the least power of
    two that cuts V into at most 65535 chunks."""
    if chunk is None:
        chunk = max(_CHUNK, next_power_of_2(cdiv(V, _MAX_CHUNKS)))
    return min(chunk, next_power_of_2(V))


def argmax_refusal(logits: torch.Tensor, chunk: int | None = None) -> InputError | None:
    """Why `argmax_triton` cannot take these logits in chunks of `chunk`, as the error it raises (the op's
    predicate says no to the same logits, with chunk None), or None: logits a 2-D bf16, fp16 or fp32 [B, V],
    1 <= V <= 2^30 (int32 indices), B < 2^31 (the grid), unit stride along V (rows at any stride); a given
    chunk a power of two, of at most 2^20 elements (one tl.arange) once capped at V, that cuts V into at most
    65535 chunks (the grid)."""
    if logits.dim() != 2 or logits.dtype not in _FLOATS:
        return InputError("logits", f"{logits.dtype} {list(logits.shape)}", "a 2-D bf16, fp16 or fp32 [B, V] tensor",
                          "call the op (`argmax`) under runtime.backend=auto: it runs the reference for others")
    if err := _argmax_shape_refusal(logits):
        return err
    B, V = logits.shape
    if V > _MAX_V or B > _MAX_ROWS:
        return InputError("logits", f"[B, V] = {[B, V]}", f"V <= {_MAX_V} (int32 indices) and B <= {_MAX_ROWS} "
                          "(the grid's first dimension)",
                          "call the op (`argmax`) under runtime.backend=auto: it runs the reference for others")
    if V > 1 and logits.stride(1) != 1:
        return InputError("logits", f"strides {logits.stride()} of {[B, V]}",
                          "unit stride along V (the kernel reads a row's logits in a row; rows at any stride)",
                          "pass logits.contiguous()")
    if chunk is None:
        return None
    if chunk < 1 or chunk & (chunk - 1) or _chunk_for(V, chunk) > tl.TRITON_MAX_TENSOR_NUMEL:
        return InputError("chunk", chunk, f"a power of two, at most {tl.TRITON_MAX_TENSOR_NUMEL} once capped at V "
                          f"= {V} (one tl.arange)", "leave chunk=None (the op's)")
    if cdiv(V, _chunk_for(V, chunk)) > _MAX_CHUNKS:
        return InputError("chunk", chunk, f"at most {_MAX_CHUNKS} chunks of V = {V} (the grid's second dimension)",
                          f"use chunk >= {next_power_of_2(cdiv(V, _MAX_CHUNKS))}")
    return None


def argmax_triton(logits: torch.Tensor, out: torch.Tensor | None = None, chunk: int | None = None) -> torch.Tensor:
    """The reference's contract; `out` (optional, any stride): int64 [B]; `chunk`: V elements per first-stage
    program (a power of two; None: the op's, `_chunk_for`). Operands as `argmax_refusal` says."""
    if err := argmax_refusal(logits, chunk) or _out_overlap_refusal(logits, out):
        raise err
    return argmax_launch(logits, out, chunk)


def argmax_launch(logits: torch.Tensor, out: torch.Tensor | None = None, chunk: int | None = None) -> torch.Tensor:
    """`argmax_triton` on operands `argmax_refusal` passed (the op's predicate checked them: one check a call)."""
    B, V = logits.shape
    y = out_or_empty(out, (B,), torch.int64, logits.device)
    if B == 0:
        return y
    chunk = _chunk_for(V, chunk)
    n_chunks = cdiv(V, chunk)
    if n_chunks == 1:
        _argmax_chunk_kernel[(B, 1)](logits, logits.stride(0), V, y, y, y, y.stride(0), 1, CHUNK=chunk,
                                     SINGLE=True)
        return y
    part_val = torch.empty(B, n_chunks, dtype=torch.float32, device=logits.device)
    part_idx = torch.empty(B, n_chunks, dtype=torch.int32, device=logits.device)
    _argmax_chunk_kernel[(B, n_chunks)](logits, logits.stride(0), V, part_val, part_idx, y, y.stride(0),
                                        n_chunks, CHUNK=chunk, SINGLE=False)
    _argmax_partials_kernel[(B,)](part_val, part_idx, y, y.stride(0), n_chunks, V,
                                  BLOCK=next_power_of_2(n_chunks))
    return y


def _out_overlap_refusal(logits: torch.Tensor, out: torch.Tensor | None) -> InputError | None:
    """An `out` sharing memory with the logits (a view of their bytes: out is int64, never the logits themselves)
    is refused: where a row fits one chunk, program b writes out[b] while other programs still read their rows."""
    return overlap_refusal("out", out, logits=logits)


def _argmax_call_refusal(logits, out=None):
    """Through the op, `chunk` (the provider's tuning argument) is not taken: the reference has none, so a call
    means the same under every backend. Tests and sweeps pass it to `argmax_triton` itself."""
    return argmax_refusal(logits) or _out_overlap_refusal(logits, out)


argmax.register_provider("triton", argmax_launch, _argmax_call_refusal)
