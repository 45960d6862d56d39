"""Batched argmax over the vocab, ties to the lowest index."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mtpfactory.errors import InputError
from mtpfactory.ops import Op, out_or_empty, triton_can_run, write_out


def _argmax_native(logits: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """logits: [B, V]. Returns int64 [B]: the first index of each row's maximum (written into `out` when
    given)."""
    return write_out(out, torch.argmax(logits, dim=-1))


argmax = Op("argmax", _argmax_native)


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
_MAX_V = 2**30  # indices are int32 in the kernel; grid axis 1 (chunks) stops at 65535


def _argmax_supports(logits, out=None) -> bool:
    """Through the op, `chunk` (the provider's tuning argument) is not taken: the reference has none, so a call
    means the same under every backend. Tests and sweeps pass it to `argmax_triton` itself."""
    tensors = [t for t in (logits, out) if t is not None]
    return (triton_can_run(*tensors) and logits.dim() == 2 and logits.dtype in _FLOATS
            and logits.stride(-1) == 1 and 1 <= logits.shape[1] <= _MAX_V
            and triton.cdiv(logits.shape[1], _CHUNK) <= 65535)


def argmax_triton(logits: torch.Tensor, out: torch.Tensor | None = None, chunk: int = _CHUNK) -> torch.Tensor:
    """The reference's contract; `out` (optional, any stride): int64 [B]; `chunk`: V elements per first-stage
    program (a power of two)."""
    B, V = logits.shape
    y = out_or_empty(out, (B,), torch.int64, logits.device)
    if B == 0:
        return y
    chunk = min(chunk, triton.next_power_of_2(V))
    n_chunks = triton.cdiv(V, chunk)
    if n_chunks > 65535:
        raise InputError("chunk", chunk, f"at most 65535 chunks of V = {V} (the grid's second dimension)",
                         f"use chunk >= {triton.next_power_of_2(triton.cdiv(V, 65535))}")
    if n_chunks == 1:
        _argmax_chunk_kernel[(B, 1)](logits, logits.stride(0), V, y, y, y, y.stride(0), 1, CHUNK=chunk,
                                     SINGLE=True)
        return y
    part_val = torch.empty(B, n_chunks, dtype=torch.float32, device=logits.device)
    part_idx = torch.empty(B, n_chunks, dtype=torch.int32, device=logits.device)
    _argmax_chunk_kernel[(B, n_chunks)](logits, logits.stride(0), V, part_val, part_idx, y, y.stride(0),
                                        n_chunks, CHUNK=chunk, SINGLE=False)
    _argmax_partials_kernel[(B,)](part_val, part_idx, y, y.stride(0), n_chunks, V,
                                  BLOCK=triton.next_power_of_2(n_chunks))
    return y


argmax.register_provider("triton", argmax_triton, _argmax_supports)
