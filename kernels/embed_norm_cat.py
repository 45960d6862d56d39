"""The MTP layer's fc input (DESIGN 2.1): `cat([rms_norm(embedding(ids, table), embed_weight), rms_norm(hidden,
hidden_weight)], -1)`, both norms of one kind (`zero_centred`) and one eps. The Triton provider gathers the
token's row, normalizes it and the hidden row, and writes both halves of the [N, 2H] row in one launch, where
the ops took four (the gather, two norms, torch's concatenation)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mtpfactory.errors import InputError
from mtpfactory.kernels.embedding import embedding
from mtpfactory.kernels.rms_norm import norm_contract, norm_row, rms_norm
from mtpfactory.ops import (Op, next_power_of_2, number_refusal, out_or_empty, out_refusal, overlap_refusal,
                            write_out)


def _contract(ids: torch.Tensor, table: torch.Tensor, embed_weight: torch.Tensor, hidden: torch.Tensor,
              hidden_weight: torch.Tensor, eps: float, zero_centred: bool, out: torch.Tensor | None = None
              ) -> InputError | None:
    """What the reference refuses before anything runs (every provider refuses the same): ids an int32 / int64
    [N] and table a [V, H] of hidden's dtype (the embedding op's rule, and the norms' dtypes); hidden a bf16,
    fp16 or fp32 [N, H]; each weight a [H] (`norm_contract`); `out` a [N, 2H] of hidden's dtype."""
    if err := embedding.contract(ids, table):
        return err
    if hidden.dim() != 2 or hidden.shape[0] != ids.numel():
        return InputError("hidden", f"{hidden.dtype} {list(hidden.shape)}", f"a [N, H] tensor, one row an id of "
                          f"ids {list(ids.shape)}", "pass the target's hidden rows, one a token")
    if table.dim() != 2 or table.shape[1] != hidden.shape[1] or table.dtype != hidden.dtype:
        return InputError("table", f"{table.dtype} {list(table.shape)}", f"a [V, H] = [V, {hidden.shape[1]}] tensor "
                          f"of hidden's dtype, {hidden.dtype} (the two halves of one row)",
                          "pass the embedding table of this model, in the run's dtype")
    n, h = hidden.shape
    return (norm_contract(hidden, hidden_weight, weight_field="hidden_weight")
            or norm_contract(hidden, embed_weight, weight_field="embed_weight")
            or out_refusal(out, (n, 2 * h), hidden.dtype, hidden.device))


def _embed_norm_cat_native(ids: torch.Tensor, table: torch.Tensor, embed_weight: torch.Tensor,
                           hidden: torch.Tensor, hidden_weight: torch.Tensor, eps: float, zero_centred: bool,
                           out: torch.Tensor | None = None) -> torch.Tensor:
    """ids [N]; table [V, H]; hidden [N, H]; the weights [H]. Returns [N, 2H] in hidden's dtype: the token's
    row normed, then the hidden row normed (written into `out` when given). An id outside [0, V) is refused."""
    if err := _contract(ids, table, embed_weight, hidden, hidden_weight, eps, zero_centred, out):
        raise err
    e = rms_norm.reference(embedding.reference(ids, table), embed_weight, eps, zero_centred)
    return write_out(out, torch.cat([e, rms_norm.reference(hidden, hidden_weight, eps, zero_centred)], dim=-1))


embed_norm_cat = Op("embed_norm_cat", _embed_norm_cat_native, _contract)


# --- Triton ---------------------------------------------------------------------------------------------------

@triton.jit
def _embed_norm_cat_kernel(ids_ptr, table_ptr, ew_ptr, hidden_ptr, hw_ptr, out_ptr, V, H, eps, stride_v,
                           stride_hn, stride_on, ZERO_CENTRED: tl.constexpr, BLOCK_H: tl.constexpr):
    """Program n: row n of out, [normed table[ids[n]], normed hidden[n]], each as `rms_norm`'s kernel norms a row.
    An id outside [0, V) reads nothing (a row of zeros, normed to zeros), as the embedding op's kernel."""
    n = tl.program_id(0).to(tl.int64)
    dtype = out_ptr.dtype.element_ty
    cols = tl.arange(0, BLOCK_H)
    mask = cols < H
    row = tl.load(ids_ptr + n).to(tl.int64)
    row_ok = (row >= 0) & (row < V)
    e = tl.load(table_ptr + row * stride_v + cols, mask=mask & row_ok, other=0.0).to(tl.float32)
    h = tl.load(hidden_ptr + n * stride_hn + cols, mask=mask, other=0.0).to(tl.float32)
    dst = out_ptr + n * stride_on + cols
    tl.store(dst, norm_row(e, ew_ptr, cols, mask, H, eps, dtype, ZERO_CENTRED), mask=mask)
    tl.store(dst + H, norm_row(h, hw_ptr, cols, mask, H, eps, dtype, ZERO_CENTRED), mask=mask)


_MAX_H = 16384            # two rows of a program in registers; wider ones run the reference
_MAX_TOKENS = 2**31 - 1   # the grid


def embed_norm_cat_refusal(ids: torch.Tensor, table: torch.Tensor, embed_weight: torch.Tensor,
                           hidden: torch.Tensor, hidden_weight: torch.Tensor, eps: float, zero_centred: bool,
                           out: torch.Tensor | None = None) -> InputError | None:
    """Why the Triton provider cannot take this call, or None: ids a 1-D int32 / int64 [N] (any stride), N <
    2^31; table, hidden and `out` with unit stride along their rows (rows at any stride), H <= 16384 (two rows
    of a program in registers); the weights contiguous; every tensor on one device; eps a Python number; `out`
    apart from every input (each program writes its own row of out, but ids, table and the weights are read by
    all; hidden's row n lies elsewhere than out's row n in any layout that shares them)."""
    if err := _contract(ids, table, embed_weight, hidden, hidden_weight, eps, zero_centred, out) or number_refusal(
            "eps", eps):
        return err
    if ids.dim() != 1 or ids.shape[0] > _MAX_TOKENS:
        return InputError("ids", f"{ids.dtype} {list(ids.shape)}", f"a 1-D [N] tensor, N <= {_MAX_TOKENS} (the "
                          "grid; the reference also takes a 0-D id)", "pass ids.view(-1), in parts of at most that")
    h = hidden.shape[1]
    if h > _MAX_H:
        return InputError("hidden", f"{hidden.dtype} {list(hidden.shape)}", f"rows of H <= {_MAX_H} (two rows of "
                          "a program in registers)", "call the op (`embed_norm_cat`) under runtime.backend=auto: it "
                          "runs the reference for others")
    for name, t in (("table", table), ("hidden", hidden), ("out", out)):
        if t is not None and h > 1 and t.stride(1) != 1:
            return InputError(name, f"strides {t.stride()} of {list(t.shape)}", "unit stride along a row (rows at "
                              "any stride)", f"pass {name}.contiguous()")
    for name, t in (("embed_weight", embed_weight), ("hidden_weight", hidden_weight)):
        if not t.is_contiguous():
            return InputError(name, f"{t.dtype} {list(t.shape)}, strides {t.stride()}", f"a contiguous [H] = [{h}] "
                              "tensor (read with unit stride)", f"pass {name}.contiguous()")
    for name, t in (("ids", ids), ("table", table), ("embed_weight", embed_weight), ("hidden_weight", hidden_weight)):
        if t.device != hidden.device:
            return InputError(name, f"on {t.device}", f"on hidden's device, {hidden.device} (the kernel reads it "
                              "there)", f"pass {name}.to(hidden.device)")
    return overlap_refusal("out", out, ids=ids, table=table, embed_weight=embed_weight, hidden=hidden,
                           hidden_weight=hidden_weight)


def embed_norm_cat_launch(ids: torch.Tensor, table: torch.Tensor, embed_weight: torch.Tensor,
                          hidden: torch.Tensor, hidden_weight: torch.Tensor, eps: float, zero_centred: bool,
                          out: torch.Tensor | None = None) -> torch.Tensor:
    """The op on operands `embed_norm_cat_refusal` passed (the op's predicate checked them: one check a call), but
    for an id outside [0, V): the reference refuses it, which takes a sync; this writes the normed zero row
    (zeros) for it."""
    n, h = hidden.shape
    y = out_or_empty(out, (n, 2 * h), hidden.dtype, hidden.device)
    if n == 0 or h == 0:
        return y
    block = next_power_of_2(h)
    _embed_norm_cat_kernel[(n,)](ids.contiguous(), table, embed_weight, hidden, hidden_weight, y, table.shape[0],
                                 h, eps, table.stride(0), hidden.stride(0), y.stride(0),
                                 ZERO_CENTRED=bool(zero_centred), BLOCK_H=block,
                                 num_warps=4 if block < 2048 else 8 if block < 8192 else 16)
    return y


embed_norm_cat.register_provider("triton", embed_norm_cat_launch, embed_norm_cat_refusal)
