"""Embedding gather: rows of the token table."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mtpfactory.errors import InputError
from mtpfactory.ops import Op, cdiv, check_indices, next_power_of_2, out_or_empty, overlap_refusal, write_out

_ID_DTYPES = (torch.int32, torch.int64)


def _embedding_index_refusal(ids: torch.Tensor, table: torch.Tensor) -> InputError | None:
    """Why no provider can gather these rows, or None: ids an int32 or int64 [N] (the reference also takes one
    0-D id, as index_select does); table [V, ...]."""
    if ids.dim() > 1 or ids.dtype not in _ID_DTYPES:
        return InputError("ids", f"{ids.dtype} {list(ids.shape)}", "an int32 or int64 [N] tensor of token ids",
                          "pass the ids as one row (ids.flatten()) of int64 (ids.long())")
    if table.dim() == 0:
        return InputError("table", f"{table.dtype} {list(table.shape)}", "a [V, H] tensor, one row a token",
                          "pass the model's embedding table")
    return None


def _embedding_native(ids: torch.Tensor, table: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """ids: [N] int in [0, V); table: [V, H]. Returns [N, H] in table's dtype (written into `out` when given).
    Shapes and id dtypes as `_embedding_index_refusal` says."""
    if err := _embedding_index_refusal(ids, table):
        raise err
    check_indices("ids", ids, 0, table.shape[0], f"token ids of this {table.shape[0]}-row table",
                  "pass ids below the vocabulary size (check the tokenizer against the model's config)")
    return write_out(out, table.index_select(0, ids))


embedding = Op("embedding", _embedding_native, lambda ids, table, out=None: _embedding_index_refusal(ids, table))


# --- Triton ---------------------------------------------------------------------------------------------------

@triton.jit
def _embedding_kernel(ids_ptr, table_ptr, out_ptr, V, H, stride_v, stride_on, stride_oh, BLOCK_H: tl.constexpr):
    """Program (token n, block of H): copies bits (the launcher views both tables as same-width ints), so the
    copy is exact for every dtype and no value passes through the interpreter's bf16 / fp8 handling. An id
    outside [0, V) reads nothing and writes a row of zeros."""
    n = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    mask = cols < H
    row = tl.load(ids_ptr + n).to(tl.int64)
    row_ok = (row >= 0) & (row < V)
    bits = tl.load(table_ptr + row * stride_v + cols, mask=mask & row_ok, other=0)
    # out's column offsets in int64: out= may be a transposed view where they pass 2^31
    tl.store(out_ptr + n * stride_on + cols.to(tl.int64) * stride_oh, bits, mask=mask)


_INT_OF_SIZE = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_MAX_TOKENS = 2**31 - 1     # grid axis 0 (ids)
_MAX_ROW_PROGRAMS = 65535   # grid axis 1 (blocks of a row)


def _row_block(table: torch.Tensor) -> int:
    """BLOCK_H: 4 KiB of a row a program, or the whole row where it is shorter."""
    return min(next_power_of_2(table.shape[1]), 4096 // table.element_size())


def embedding_refusal(ids: torch.Tensor, table: torch.Tensor) -> InputError | None:
    """Why `embedding_triton` cannot take these operands, as the error it raises (its predicate says no to the
    same calls), or None: ids a 1-D int32 or int64 [N] (any stride), N < 2^31 (the grid), on table's device;
    table a 2-D [V, H] of 1, 2, 4 or 8-byte elements (copied as same-width ints), unit stride along H (rows at
    any stride), its row in at most 65535 programs of 4 KiB (the grid)."""
    if err := _embedding_index_refusal(ids, table):
        return err
    if ids.dim() != 1:
        return InputError("ids", f"{ids.dtype} {list(ids.shape)}", "a 1-D [N] tensor (the reference also takes a "
                          "0-D id)", "pass ids.view(1)")
    if table.dim() != 2 or table.element_size() not in _INT_OF_SIZE:
        return InputError("table", f"{table.dtype} {list(table.shape)}",
                          "a 2-D [V, H] tensor of 1, 2, 4 or 8-byte elements (the kernel copies them as ints)",
                          "call the op (`embedding`) under runtime.backend=auto: it runs the reference for others")
    if table.shape[1] > 1 and table.stride(1) != 1:
        return InputError("table", f"strides {table.stride()} of {list(table.shape)}",
                          "unit stride along H (the kernel reads a row's elements in a row; rows at any stride)",
                          "pass table.contiguous()")
    if ids.device != table.device:
        return InputError("ids", f"on {ids.device}", f"on table's device, {table.device} (the kernel reads them "
                          "there)", "pass ids.to(table.device)")
    if ids.shape[0] > _MAX_TOKENS:
        return InputError("ids", f"{ids.shape[0]} ids", f"at most {_MAX_TOKENS} (the grid's first dimension)",
                          "gather them in parts")
    if cdiv(table.shape[1], _row_block(table)) > _MAX_ROW_PROGRAMS:
        return InputError("table", f"{table.dtype} {list(table.shape)}",
                          f"rows in at most {_MAX_ROW_PROGRAMS} programs of {_row_block(table)} elements (the "
                          "grid's second dimension)",
                          "call the op (`embedding`) under runtime.backend=auto: it runs the reference for others")
    return None


def embedding_triton(ids: torch.Tensor, table: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """The reference's contract, except for an id outside [0, V): the reference refuses it, which takes a sync;
    this provider writes a row of zeros for it. `out` (optional, any strides): [N, H] in table's dtype.
    Operands as `embedding_refusal` says."""
    if err := _embedding_call_refusal(ids, table, out):
        raise err
    return embedding_launch(ids, table, out)


def embedding_launch(ids: torch.Tensor, table: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """`embedding_triton` on operands `embedding_refusal` passed (the op's predicate checked them: one check a
    call)."""
    N, H = ids.shape[0], table.shape[1]
    y = out_or_empty(out, (N, H), table.dtype, table.device)
    if N == 0 or H == 0:
        return y
    bits = _INT_OF_SIZE[table.element_size()]
    block = _row_block(table)
    _embedding_kernel[(N, cdiv(H, block))](ids.contiguous(), table.view(bits), y.view(bits), table.shape[0],
                                           H, table.stride(0), y.stride(0), y.stride(1), BLOCK_H=block,
                                           num_warps=4)
    return y


def _embedding_call_refusal(ids, table, out=None):
    """`embedding_refusal`, and an `out` sharing memory with the table or the ids (even `out` the table itself):
    a program overwrites rows that other programs still gather from."""
    return embedding_refusal(ids, table) or overlap_refusal("out", out, table=table, ids=ids)


embedding.register_provider("triton", embedding_launch, _embedding_call_refusal)
