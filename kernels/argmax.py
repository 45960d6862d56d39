"""Batched argmax over the vocab, ties to the lowest index."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mtpfactory.errors import InputError
from mtpfactory.ops import FLOATS, Op, cdiv, next_power_of_2, out_or_empty, out_refusal, overlap_refusal, write_out


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
# Two stages: each (row, chunk of V) program reduces its chunk to its top `ordered_keys` key; one program per row
# then reduces those. A row that fits one chunk skips the second stage.

@triton.jit
def ordered_keys(x, idx):
    """int64 keys of x (fp32) at indices idx (int32, 0 <= idx < 2^31) ordered as torch.argmax and a stable
    descending sort order them: the high word an int32 in the order of the floats (every NaN above +inf, -0.0
    taken as +0.0), the low word 2^31 - 1 - idx (of equal values the lower index is larger). One max over the
    keys then gives both the maximum and its first index (`key_index`, `key_value`): where comparing values,
    then indices, and finding NaN took three reductions."""
    bits = tl.where(x == 0.0, 0, x.to(tl.int32, bitcast=True))
    key = tl.where(x != x, 0x7FFFFFFF, tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF))
    return (key.to(tl.int64) << 32) | (0x7FFFFFFF - idx).to(tl.int64)


@triton.jit
def key_index(key):
    """The index an `ordered_keys` key holds (int64)."""
    return 0x7FFFFFFF - (key & 0xFFFFFFFF)


@triton.jit
def key_value(key):
    """The value an `ordered_keys` key holds (fp32; NaN for a NaN, +0.0 for either zero)."""
    k32 = (key >> 32).to(tl.int32)
    return tl.where(k32 >= 0, k32, k32 ^ 0x7FFFFFFF).to(tl.float32, bitcast=True)


# The key of no element: below every `ordered_keys` key
NO_KEY = tl.constexpr(-(2**63))


@triton.jit
def _argmax_chunk_kernel(logits_ptr, stride_b, V, part_ptr, out_ptr, stride_o, n_chunks, CHUNK: tl.constexpr,
                         SINGLE: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    idx = chunk * CHUNK + tl.arange(0, CHUNK)  # [CHUNK] int32 (V <= 2**30)
    mask = idx < V
    x = tl.load(logits_ptr + b * stride_b + idx, mask=mask, other=float("-inf")).to(tl.float32)
    top = tl.max(tl.where(mask, ordered_keys(x, idx), NO_KEY), axis=0)
    if SINGLE:
        tl.store(out_ptr + b * stride_o, key_index(top))
    else:
        tl.store(part_ptr + b * n_chunks + chunk, top)


@triton.jit
def _argmax_partials_kernel(part_ptr, out_ptr, stride_o, n_chunks, BLOCK: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    c = tl.arange(0, BLOCK)
    top = tl.max(tl.load(part_ptr + b * n_chunks + c, mask=c < n_chunks, other=NO_KEY), axis=0)
    tl.store(out_ptr + b * stride_o, key_index(top))


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
    if logits.dim() != 2 or logits.dtype not in FLOATS:
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
        _argmax_chunk_kernel[(B, 1)](logits, logits.stride(0), V, y, y, y.stride(0), 1, CHUNK=chunk, SINGLE=True)
        return y
    part = torch.empty(B, n_chunks, dtype=torch.int64, device=logits.device)     # each chunk's top key
    _argmax_chunk_kernel[(B, n_chunks)](logits, logits.stride(0), V, part, y, y.stride(0), n_chunks, CHUNK=chunk,
                                        SINGLE=False)
    _argmax_partials_kernel[(B,)](part, y, y.stride(0), n_chunks, BLOCK=next_power_of_2(n_chunks))
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
