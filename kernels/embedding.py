"""Embedding gather: rows of the token table."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mtpfactory.ops import Op, check_indices, out_or_empty, triton_can_run, write_out


def _embedding_native(ids: torch.Tensor, table: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """ids: [N] int in [0, V); table: [V, H]. Returns [N, H] in table's dtype (written into `out` when given)."""
    check_indices("ids", ids, 0, table.shape[0], f"token ids of this {table.shape[0]}-row table",
                  "pass ids below the vocabulary size (check the tokenizer against the model's config)")
    return write_out(out, table.index_select(0, ids))


embedding = Op("embedding", _embedding_native)


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
    tl.store(out_ptr + n * stride_on + cols * stride_oh, bits, mask=mask)


_INT_OF_SIZE = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _embedding_supports(ids, table, out=None) -> bool:
    tensors = [t for t in (ids, table, out) if t is not None]
    return (triton_can_run(*tensors) and ids.dim() == 1 and ids.dtype in (torch.int32, torch.int64)
            and table.dim() == 2 and table.stride(-1) == 1 and table.element_size() in _INT_OF_SIZE)


def embedding_triton(ids: torch.Tensor, table: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """The reference's contract, except for an id outside [0, V): the reference refuses it, which takes a sync;
    this provider writes a row of zeros for it. `out` (optional, any strides): [N, H] in table's dtype."""
    N, H = ids.shape[0], table.shape[1]
    y = out_or_empty(out, (N, H), table.dtype, table.device)
    if N == 0 or H == 0:
        return y
    bits = _INT_OF_SIZE[table.element_size()]
    block = min(triton.next_power_of_2(H), 4096 // table.element_size())  # 4 KiB of a row per program
    _embedding_kernel[(N, triton.cdiv(H, block))](ids.contiguous(), table.view(bits), y.view(bits), table.shape[0],
                                                  H, table.stride(0), y.stride(0), y.stride(1), BLOCK_H=block,
                                                  num_warps=4)
    return y


embedding.register_provider("triton", embedding_triton, _embedding_supports)
