"""MoE routing (softmax top-k, optionally renormalized) and the MoE over only the selected experts: SwiGLU
experts stored unquantized (`fused_moe`) or NVFP4 (`fused_moe_nvfp4`, W4A16), the weighted sum over the
top-k and the shared-expert blend `sigmoid(shared_gate) * shared_out`.

Triton providers (DESIGN 4):
- `moe_route_softmax`: one program per row; softmax over E in fp32, and k rounds of one max over the logits
  packed with their ids into int64 keys ordered as the reference's stable descending sort (`argmax`'s
  `ordered_keys`: NaN above every number, -0.0 equal to +0.0, of equal logits the lower id first).
- `fused_moe`, `fused_moe_nvfp4`: the rows in groups of BM (16 or 32; a `tl.dot` needs 16). A group's
  candidates are its (row, slot) pairs, or all expert ids when E is smaller; a program owns a candidate
  expert when a row of the group chose it and (by pairs) no earlier pair did, so each selected expert is
  read once per group and no unselected one is read. Nothing syncs with the host.
  1. gate_up: one program per (group, candidate, tile of BI intermediate columns). An owner reads the
     expert's gate and up tiles once for all the group's rows (rows that did not choose it masked to
     zero) and writes silu(gate) * up, rounded to x's dtype, into the workspace [N * k, I] at (row, slot).
  2. down: one program per (group, split, tile of BHO output columns); split s walks candidates s,
     s + SPLIT, ... and for each owned expert reads its down tile once, rounds each row's expert output
     to x's dtype (as the reference does), weights it in fp32 and accumulates it into the rows that chose
     it only (the others read zeros for h, and 0 * a non-finite weight would be NaN). With one split it adds
     sigmoid(shared_gate) * shared_out in fp32 and stores [N, H] once; with several (chosen so the grid
     has a few programs per SM: a decode step has few rows and tiles) each stores fp32 partials and
     `_moe_blend_kernel` sums them in split order and blends. No atomics: deterministic.
  Expert ids outside [0, E) are invalid (the reference refuses them); checking them here would need a host
  sync, so the kernels skip them (they contribute nothing) and never index outside the weights. An id
  repeated within a row counts once with its weights summed, which is the reference's result.
  NVFP4 tiles are decoded in the kernel, W4A16, as the NVFP4 GEMM's dot kernel decodes them
  (`linear_nvfp4.decoded_tile`): the codes read as int32 words of 8, each word's 8 values E2M1 * block scale
  * 2^-8 made by a few bit operations and one bf16x2 multiply a pair (inline PTX on the GPU), exact in x's 16
  bits, K permuted within each word and x's tile permuted to match (`permuted_x`); the dot sums in fp32 and
  the expert's global scale (with the 2^8) multiplies the sum once. The reference instead rounds each
  dequantized weight, value * scale * global, to x's dtype before its matmul: the two differ by that rounding
  (at most half an ulp of x's dtype a weight). `tl.dot_scaled` is not used: its e2m1 path does not compile for
  Hopper under Triton 3.6.
- `fused_moe_nvfp4` at N <= `GEMV_MAX_ROWS` rows (a decode step): GEMVs over the (row, slot) pairs instead,
  one program per (pair, tile of weight rows), owners only (`_pair_owner`), tiles by the grid
  (`_gemv_tiles`). For 16-bit x each 16-element block is summed in fp16 pairs as the LM head's W4A16 GEMV
  sums it (`nvfp4_f16_block_sums`), x (or h) first scaled by 2^e from a scan of its row, each K step's x
  read in one 2-D load (`x_f16_pairs_step`) and the weights a step ahead; fp32 x takes the fp32 step. The
  down GEMV writes each pair's output to its slot's fp32 partial and `_moe_blend_kernel` sums the slots in
  order and blends.
On sm_90, at a decode step's rows, the down kernel (dot or GEMV) and the blend are programmatic dependent
launches (`moe_pdl`): the down kernel's programs read their routing (the GEMV's, its first weights too) while
gate_up still runs.

What each provider takes is one rule, its predicate and the error its `*_triton` entry point raises when called
directly (`moe_route_softmax_refusal`, `fused_moe_refusal`, `fused_moe_nvfp4_refusal`): each names the argument at
fault. The references refuse by the same names the shapes they cannot compute with, and serve the rest.

Under Triton's interpreter (CPU tests) bf16 arithmetic is not available: loads are widened to fp32 right
after they happen, the dots run in fp32 on values already rounded to x's dtype, and rounding to bf16 is
done in integer math (the interpreter's own fp32 -> bf16 cast truncates); on the GPU the same kernels use
x's dtype for the dot operands and the native casts.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from mtpfactory.errors import InputError
from mtpfactory.kernels.argmax import NO_KEY, key_index, key_value, ordered_keys
from mtpfactory.kernels.fp_bits import pow2, times_pow2
from mtpfactory.kernels.linear import dot_acc, has_pdl, lowp_dot, x_exponent, x_scan_block
from mtpfactory.kernels.linear_nvfp4 import (decoded_tile, gemv_nvfp4_step, nvfp4_f16_block_sums, nvfp4_words,
                                             permuted_x, words_refusal, x_f16_pairs_step)
from mtpfactory.ops import (Op, broadcasts_to, cdiv, next_power_of_2, out_refusal, outs_overlap_refusal,
                            outs_refusal, overlap_refusal, sm_count, write_outs)
from mtpfactory.quant import NVFP4_BLOCK, dequantize_nvfp4

ACT_DTYPES = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}
MAX_ROUTED_EXPERTS = 8192  # one program holds a row of router logits
MAX_ROUTED_TOP_K = 64      # the routing kernel unrolls its top-k picks (models route to 8-10)
MAX_SPLIT = 16  # programs that share one (row group, output tile) of the down projection
# NVFP4 experts at this many rows or fewer run as GEMVs over the (row, slot) pairs, more rows through the dot
# kernels (a decode step's rows share few experts; a prefill chunk's share more)
GEMV_MAX_ROWS = 32
GEMV_K_TILE = 256   # the GEMVs' K step, in elements (whole words of 8 and blocks of 16)


# --- references ------------------------------------------------------------------------------------------

def _moe_route_softmax_native(router_logits: torch.Tensor, top_k: int, renormalize: bool, *,
                              out: tuple[torch.Tensor, torch.Tensor] | None = None):
    """router_logits: [N, E]. Returns (weights fp32 [N, top_k], expert ids int64 [N, top_k]), written into
    `out` (that pair, contiguous) when given.

    Softmax over all experts in fp32; the top_k experts by fp32 logit (the same order as by probability),
    ties to the lower id (a stable sort: `torch.topk` does not promise which of two equal values comes
    first); their probabilities, divided by their sum when `renormalize`. Logits of another rank, or a
    top_k outside [1, E], are refused (`_route_shape_refusal`)."""
    if err := _route_contract(router_logits, top_k, renormalize, out=out):
        raise err
    logits = router_logits.float()                                       # [N, E]
    probs = torch.softmax(logits, dim=-1)
    ids = torch.sort(logits, dim=-1, descending=True, stable=True).indices[:, :top_k]  # [N, k]
    weights = probs.gather(1, ids)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return write_outs(out, (weights, ids), _ROUTE_OUT_NAMES, "contiguous")


def _moe_native(x: torch.Tensor, num_experts: int, expert: Callable[[int], tuple[torch.Tensor, torch.Tensor]],
                topk_weights: torch.Tensor, topk_ids: torch.Tensor, shared_out: torch.Tensor | None,
                shared_gate: torch.Tensor | None, out: torch.Tensor | None) -> torch.Tensor:
    """The MoE maths shared by both references; `expert(e)` gives (w_gate_up [2I, H], w_down [H, I]) in x's dtype.

    Rounding order: the gate_up projection, silu, the product and the down projection each run in x's
    dtype (so each expert's output is rounded to x's dtype); the output is weighted by its fp32 routing
    weight and accumulated in fp32; sigmoid(shared_gate) * shared_out is added in fp32; one final
    rounding to x's dtype."""
    chosen = torch.unique(topk_ids).tolist()                             # ascending
    if chosen and not 0 <= chosen[0] <= chosen[-1] < num_experts:
        raise InputError("topk_ids", chosen[0] if chosen[0] < 0 else chosen[-1],
                         f"expert ids lie in [0, {num_experts}) for these {num_experts} experts",
                         "route over these experts' logits (moe_route_softmax)")
    acc = torch.zeros(x.shape, dtype=torch.float32, device=x.device)    # [N, H]
    for e in chosen:
        rows, slot = torch.nonzero(topk_ids == e, as_tuple=True)
        w_gate_up, w_down = expert(e)
        inter = w_down.shape[-1]
        gate_up = torch.nn.functional.linear(x[rows], w_gate_up)          # [n, 2I]
        h = torch.nn.functional.silu(gate_up[:, :inter]) * gate_up[:, inter:]
        y = torch.nn.functional.linear(h, w_down)                         # [n, H]
        acc.index_add_(0, rows, y.float() * topk_weights[rows, slot, None].float())
    if shared_out is not None:
        acc += torch.sigmoid(shared_gate.float()) * shared_out.float()   # [N, 1] * [N, H]
    return acc.to(x.dtype) if out is None else out.copy_(acc)


def _fused_moe_native(x: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor,
                      topk_weights: torch.Tensor, topk_ids: torch.Tensor, shared_out: torch.Tensor | None = None,
                      shared_gate: torch.Tensor | None = None, *, out: torch.Tensor | None = None,
                      workspace: torch.Tensor | None = None) -> torch.Tensor:
    """x: [N, H]; w_gate_up: [E, 2I, H] (gate rows first); w_down: [E, H, I], both in x's dtype;
    topk_weights (fp32), topk_ids: [N, k], ids in [0, E) (others refused); shared_out [N, H] and shared_gate
    [N, 1] (logits) in x's dtype, optional together. `out` [N, H] (rows contiguous, their stride free)
    receives the result when given; `workspace` [N * k, I] contiguous is scratch for the fast providers
    (checked, unused here). Both in x's dtype. Shapes it cannot compute with are refused by name
    (`_moe_shape_refusal`, `_experts_shape_refusal`) before anything runs.

    Returns sum_j w_j * down_j(silu(gate_j x) * up_j x) + sigmoid(shared_gate) * shared_out, [N, H] in
    x's dtype, reading only the selected experts (rounding order: see `_moe_native`)."""
    if err := _fused_moe_contract(x, w_gate_up, w_down, topk_weights, topk_ids, shared_out, shared_gate, out=out,
                                  workspace=workspace):
        raise err
    return _moe_native(x, w_gate_up.shape[0], lambda e: (w_gate_up[e], w_down[e]), topk_weights, topk_ids,
                       shared_out, shared_gate, out)


def _fused_moe_nvfp4_native(x: torch.Tensor, gu_weight: torch.Tensor, gu_scale: torch.Tensor,
                            gu_global: torch.Tensor, dn_weight: torch.Tensor, dn_scale: torch.Tensor,
                            dn_global: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                            shared_out: torch.Tensor | None = None, shared_gate: torch.Tensor | None = None, *,
                            out: torch.Tensor | None = None, workspace: torch.Tensor | None = None) -> torch.Tensor:
    """`fused_moe` with NVFP4 experts (DESIGN 3), gate and up quantized as separate tensors:
    gu_weight uint8 [E, 2I, H/2], gu_scale float8_e4m3fn [E, 2I, H/16], gu_global fp32 [E, 2] (gate, up);
    dn_weight uint8 [E, H, I/2], dn_scale [E, H, I/16], dn_global fp32 [E].

    Each selected expert is dequantized to x's dtype with `dequantize_nvfp4` (which refuses a malformed
    expert's tensors by name) and run through the `fused_moe` reference maths; shapes that do not agree
    between the stacks and x are refused first (`_nvfp4_shape_refusal`)."""
    if err := _fused_moe_nvfp4_contract(x, gu_weight, gu_scale, gu_global, dn_weight, dn_scale, dn_global,
                                        topk_weights, topk_ids, shared_out, shared_gate, out=out, workspace=workspace):
        raise err
    inter = gu_weight.shape[1] // 2

    def expert(e: int) -> tuple[torch.Tensor, torch.Tensor]:
        gate = dequantize_nvfp4(gu_weight[e, :inter], gu_scale[e, :inter], gu_global[e, 0], x.dtype,
                                f"experts.{e}.gate_proj.weight")
        up = dequantize_nvfp4(gu_weight[e, inter:], gu_scale[e, inter:], gu_global[e, 1], x.dtype,
                              f"experts.{e}.up_proj.weight")
        down = dequantize_nvfp4(dn_weight[e], dn_scale[e], dn_global[e], x.dtype, f"experts.{e}.down_proj.weight")
        return torch.cat([gate, up]), down                                # [2I, H], [H, I]

    return _moe_native(x, gu_weight.shape[0], expert, topk_weights, topk_ids, shared_out, shared_gate, out)


# Checks both providers make before they write anything, so that a call means the same under either.

_ROUTE_OUT_NAMES = ("weights", "ids")


def _route_out_refusal(out, n: int, top_k: int, device: torch.device) -> InputError | None:
    return outs_refusal(out, (((n, top_k), torch.float32), ((n, top_k), torch.int64)), _ROUTE_OUT_NAMES, device,
                        "contiguous")


def _moe_args_refusal(x, top_k, inter, shared_out, shared_gate, out, workspace) -> InputError | None:
    """The shared-expert pair, `out` and `workspace`, as every backend takes them."""
    if (shared_out is None) != (shared_gate is None):
        given = "shared_out" if shared_gate is None else "shared_gate"
        return InputError("shared_out, shared_gate", f"only {given} given",
                          "the shared-expert blend takes both together, or neither",
                          "pass the shared expert's output with its gate logits, or drop both")
    # the kernels step between out's rows by its stride
    if err := (out_refusal(out, x.shape, x.dtype, x.device, layout="rows")
               or out_refusal(workspace, (x.shape[0] * top_k, inter), x.dtype, x.device, "workspace", "contiguous")):
        return err
    # the kernels write it while they read x and shared_out and write out: shared memory gave wrong results
    return overlap_refusal("workspace", workspace, fix="pass a workspace of its own, or none (the provider "
                           "allocates one)", x=x, out=out, shared_out=shared_out, shared_gate=shared_gate)


# The shape rules. The references check what they index and broadcast (`_route_shape_refusal`,
# `_moe_shape_refusal`, `_experts_shape_refusal`, `_nvfp4_shape_refusal`) before anything runs, so a call
# that does not fit is refused by name rather than failing inside torch; each Triton provider's rule
# (`*_refusal` below the launchers) is those and what its kernels need on top.

def _desc(t: torch.Tensor, strides: bool = False) -> str:
    text = f"{_dtype(t.dtype)} {list(t.shape)}"
    return f"{text}, strides {t.stride()}" if strides else text


def _dtype(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _route_shape_refusal(router_logits: torch.Tensor, top_k: int) -> InputError | None:
    """Why the routing cannot take these logits and top_k, or None: logits [N, E], top_k a Python int,
    1 <= top_k <= E."""
    if router_logits.dim() != 2:
        return InputError("router_logits", _desc(router_logits), "a 2-D [N, E] tensor: a row of expert logits a "
                          "token", "flatten the leading dimensions into N")
    if isinstance(top_k, bool) or not isinstance(top_k, int):
        return InputError("top_k", f"{type(top_k).__name__} {top_k!r}"[:120], "a Python int (the kernel is built "
                          "for it)", "pass int(top_k)")
    if not 1 <= top_k <= router_logits.shape[1]:
        return InputError("top_k", top_k, f"from 1 to the {router_logits.shape[1]} experts the logits score",
                          "route to at most as many experts as there are")
    return None


def _moe_shape_refusal(x, topk_weights, topk_ids, shared_out, shared_gate) -> InputError | None:
    """Why the MoE references cannot index the activations and routing, or None: x [N, H]; integer topk_ids
    [N', k] with N' <= N (a row past x's has no token); topk_weights holding [N', k]; shared_out and a 2-D
    shared_gate broadcasting to [N, H]. The kernels take only the exact shapes (`_moe_kernel_refusal`)."""
    if x.dim() != 2:
        return InputError("x", _desc(x), "a 2-D [N, H] tensor: a row of activations a token",
                          "flatten the leading dimensions into N")
    n, h = x.shape
    integer = not (topk_ids.is_floating_point() or topk_ids.is_complex() or topk_ids.dtype == torch.bool)
    if topk_ids.dim() != 2 or topk_ids.shape[0] > n or not integer:
        return InputError("topk_ids", _desc(topk_ids), f"integer expert ids [N, k], N = {n} (x's rows)",
                          "pass the ids moe_route_softmax chose for x's rows")
    if topk_weights.dim() != 2 or any(w < i for w, i in zip(topk_weights.shape, topk_ids.shape)):
        return InputError("topk_weights", _desc(topk_weights), f"[N, k] = {list(topk_ids.shape)}: a routing "
                          "weight for each of topk_ids", "pass the weights moe_route_softmax returned with these ids")
    for name, t, shape in (("shared_out", shared_out, f"[N, H] = [{n}, {h}]"),
                           ("shared_gate", shared_gate, f"[N, 1] = [{n}, 1], a gate logit a row")):
        if t is not None and not broadcasts_to(t.shape, x.shape):
            return InputError(name, _desc(t), f"{shape} (x is {_desc(x)})",
                              f"pass the shared expert's {name.removeprefix('shared_')} for x's rows")
    if shared_gate is not None and shared_gate.dim() != 2:
        return InputError("shared_gate", _desc(shared_gate), f"a 2-D gate, [N, 1] = [{n}, 1] (a gate logit a row): a "
                          "1-D one broadcasts along H, a gate a column (a [N] gate where N = H would silently gate "
                          "column j by row j's logit)", "pass shared_gate[:, None]")
    return None


def _experts_shape_refusal(x, w_gate_up, w_down) -> InputError | None:
    """Why the `fused_moe` reference cannot multiply x by these experts, or None: w_gate_up [E, 2I, H] with x's
    H, and w_down [E' >= E, H, I], both in x's dtype (x 2-D: `_moe_shape_refusal`)."""
    h, dt = x.shape[1], _dtype(x.dtype)
    if w_gate_up.dim() != 3 or w_gate_up.shape[1] % 2 or w_gate_up.shape[2] != h or w_gate_up.dtype != x.dtype:
        return InputError("w_gate_up", _desc(w_gate_up), f"the experts' gate and up rows, a {dt} [E, 2I, H = {h}] "
                          f"tensor (x is {_desc(x)})", "pass the stacked experts' gate_up weights, gate rows "
                          "first, in x's dtype")
    e, i = w_gate_up.shape[0], w_gate_up.shape[1] // 2
    if w_down.dim() != 3 or w_down.shape[0] < e or tuple(w_down.shape[1:]) != (h, i) or w_down.dtype != x.dtype:
        return InputError("w_down", _desc(w_down), f"the experts' down rows, a {dt} [E, H, I] = [{e}, {h}, {i}] "
                          "tensor (E and 2I from w_gate_up)", "pass the same experts' down weights, in x's dtype")
    return None


def _nvfp4_shape_refusal(x, gu_weight, gu_scale, gu_global, dn_weight, dn_scale, dn_global) -> InputError | None:
    """Why the `fused_moe_nvfp4` reference cannot index these experts or multiply x by them, or None: gu_weight
    [E, 2I, H/2] with x's H; dn_weight [E' >= E, H, I/2]; gu_global [E' >= E, 2] (gate, up); gu_scale,
    dn_scale and dn_global hold at least E experts along dim 0 (`dequantize_nvfp4` checks each expert's)."""
    h = x.shape[1]
    if gu_weight.dim() != 3 or gu_weight.shape[1] % 2 or 2 * gu_weight.shape[2] != h:
        return InputError("gu_weight", _desc(gu_weight), f"NVFP4 gate and up rows, two codes a byte: [E, 2I, H/2] "
                          f"for x's H = {h}", "pass the packed gate_up codes of experts of x's H")
    e, i = gu_weight.shape[0], gu_weight.shape[1] // 2
    if dn_weight.dim() != 3 or dn_weight.shape[0] < e or dn_weight.shape[1] != h or 2 * dn_weight.shape[2] != i:
        return InputError("dn_weight", _desc(dn_weight), f"NVFP4 down rows, two codes a byte: [E, H, I/2] = "
                          f"[{e}, {h}, {i / 2:g}] (E and 2I from gu_weight)",
                          "pass the same experts' packed down codes")
    for name, t in (("gu_weight", gu_weight), ("dn_weight", dn_weight)):
        if t.dtype != torch.uint8:
            return InputError(name, _desc(t), "uint8 codes, two a byte (the checkpoint's packed weight)",
                              f"pass {name} as stored (raw bytes of another dtype: .view(torch.uint8))")
    if gu_global.dim() != 2 or gu_global.shape[0] < e or gu_global.shape[1] < 2 or not gu_global.is_floating_point():
        return InputError("gu_global", _desc(gu_global), f"a float [E, 2] = [{e}, 2] tensor: each expert's gate and "
                          "up global scales", "pass the gate and up weight_scale_2 of each expert, stacked")
    if dn_global.dim() != 1 or dn_global.shape[0] < e or not dn_global.is_floating_point():
        return InputError("dn_global", _desc(dn_global), f"a float [E] = [{e}] tensor: each expert's down global scale",
                          "pass the down weight_scale_2 of each expert, stacked")
    for name, t, rows, k in (("gu_scale", gu_scale, 2 * i, h), ("dn_scale", dn_scale, h, i)):
        if (t.dim() != 3 or t.shape[0] < e or tuple(t.shape[1:]) != (rows, k // NVFP4_BLOCK)
                or not t.is_floating_point()):
            return InputError(name, _desc(t), f"each expert's E4M3 block scales, [E, {rows}, {k}/16] = "
                              f"[{e}, {rows}, {k // NVFP4_BLOCK}] (float8_e4m3fn as stored, or any float dtype)",
                              f"pass the {name} of the same experts as stored")
    return None


def _fused_moe_contract(x, w_gate_up, w_down, topk_weights, topk_ids, shared_out=None, shared_gate=None, *,
                        out=None, workspace=None) -> InputError | None:
    """What the `fused_moe` reference refuses before anything runs (every provider refuses the same)."""
    return (_moe_shape_refusal(x, topk_weights, topk_ids, shared_out, shared_gate)
            or _experts_shape_refusal(x, w_gate_up, w_down)
            or _moe_args_refusal(x, topk_ids.shape[1], w_down.shape[-1], shared_out, shared_gate, out, workspace))


def _fused_moe_nvfp4_contract(x, gu_weight, gu_scale, gu_global, dn_weight, dn_scale, dn_global, topk_weights,
                              topk_ids, shared_out=None, shared_gate=None, *, out=None,
                              workspace=None) -> InputError | None:
    """What the `fused_moe_nvfp4` reference refuses before anything runs (every provider refuses the same)."""
    return (_moe_shape_refusal(x, topk_weights, topk_ids, shared_out, shared_gate)
            or _nvfp4_shape_refusal(x, gu_weight, gu_scale, gu_global, dn_weight, dn_scale, dn_global)
            or _moe_args_refusal(x, topk_ids.shape[1], gu_weight.shape[1] // 2, shared_out, shared_gate, out,
                                 workspace))


def _route_contract(router_logits, top_k, renormalize, *, out=None) -> InputError | None:
    """What the `moe_route_softmax` reference refuses before anything runs (every provider refuses the same)."""
    return (_route_shape_refusal(router_logits, top_k)
            or _route_out_refusal(out, router_logits.shape[0], top_k, router_logits.device))


moe_route_softmax = Op("moe_route_softmax", _moe_route_softmax_native, _route_contract)
fused_moe = Op("fused_moe", _fused_moe_native, _fused_moe_contract)
fused_moe_nvfp4 = Op("fused_moe_nvfp4", _fused_moe_nvfp4_native, _fused_moe_nvfp4_contract)


# --- Triton helpers --------------------------------------------------------------------------------------

@triton.jit
def _load_act(ptrs, mask, INTERP: tl.constexpr):
    """A load of activations or unquantized weights (values already in x's dtype, ready for a dot);
    widened to fp32 at once under the interpreter."""
    v = tl.load(ptrs, mask=mask, other=0.0)
    if INTERP:
        v = v.to(tl.float32)
    return v


@triton.jit
def _round_act(v, ACT: tl.constexpr, INTERP: tl.constexpr, AS_FP32: tl.constexpr):
    """fp32 `v` rounded to x's dtype ACT: as ACT, or as fp32 holding the rounded value when AS_FP32 or
    under the interpreter (which has no bf16 arithmetic, and whose fp32 -> bf16 cast truncates: there the
    rounding to nearest even is done in integer math)."""
    if INTERP and ACT == tl.bfloat16:
        b = v.to(tl.int32, bitcast=True)
        return ((b + 0x7FFF + ((b >> 16) & 1)) & -65536).to(tl.float32, bitcast=True)
    elif INTERP or AS_FP32:
        return v.to(ACT).to(tl.float32)
    else:
        return v.to(ACT)


@triton.jit
def _act_tile(a_rows, a_ok, k0, K, BK: tl.constexpr):
    """The K tile from element k0 on of activation rows `a_rows` [BM, 1] (unit stride along K): [BM, BK], zero
    past K and off the rows where a_ok."""
    cols = k0 + tl.arange(0, BK)
    return tl.load(a_rows + cols[None, :], mask=a_ok[:, None] & (cols < K)[None, :], other=0.0)


@triton.jit
def _nvfp4_dot(acc, x, wv, sb, BR: tl.constexpr, BK: tl.constexpr, ACT: tl.constexpr, LOWP_DOT: tl.constexpr,
               USE_ASM: tl.constexpr):
    """acc [BM, BR] + x @ w^T over one K tile: x already in `permuted_x`'s order, w's words and scale bytes
    (`nvfp4_words`) decoded to E2M1 * scale * 2^-8 (`decoded_tile`: exact in 16 bits, so the dot rounds nothing
    before its fp32 sum; the caller multiplies by 2^8 and the global scale)."""
    return dot_acc(x, decoded_tile(wv, sb, BR, BK, USE_ASM), acc, ACT, LOWP_DOT, False)


@triton.jit
def _group_pairs(ids_ptr, N, TOP_K: tl.constexpr, KP: tl.constexpr, BM: tl.constexpr, group):
    """The row group's rows (int64: rows times a row stride, or times k * I in the workspace, pass 2^31) and
    expert ids [BM, KP] (-1 where no pair), and each pair's index within the group."""
    rows = (group * BM + tl.arange(0, BM)).to(tl.int64)
    slots = tl.arange(0, KP)
    ok = (rows < N)[:, None] & (slots < TOP_K)[None, :]
    ids = tl.load(ids_ptr + rows[:, None] * TOP_K + slots[None, :], mask=ok, other=-1)
    local = tl.arange(0, BM)[:, None] * TOP_K + slots[None, :]
    return rows, ids, local


@triton.jit
def _candidate(ids_ptr, ids, local, first, c, n_pairs, E, BY_EXPERT: tl.constexpr):
    """Candidate c of a row group whose pairs start at `first`: expert c (BY_EXPERT, c < E), or the expert of
    the group's pair c. Returns (expert id int64, owned): owned when a row of the group chose that expert,
    it lies in [0, E) and, by pairs, no earlier pair of the group chose it, so each selected expert is read
    once per group and no id reads outside the weights."""
    if BY_EXPERT:
        e = tl.max(tl.where(ids == c, ids, -1), axis=None)
        owned = e >= 0
    else:
        e = tl.load(ids_ptr + first + c, mask=first + c < n_pairs, other=-1)
        owned = (e >= 0) & (e < E) & (tl.sum(((ids == e) & (local < c)).to(tl.int32), axis=None) == 0)
    return e, owned


@triton.jit
def _expert_rows(ids, e, KP: tl.constexpr):
    """The group's pairs that chose expert e [BM, KP], the rows that did [BM], and each such row's first
    slot holding e: a row that repeats e keeps one h row (no write lands outside its k slots) and counts
    once with its weights summed, which is the reference's result."""
    hit = ids == e
    has = tl.max(hit.to(tl.int32), axis=1) > 0
    slot = tl.min(tl.where(hit, tl.arange(0, KP)[None, :], KP), axis=1)
    return hit, has, slot


@triton.jit
def _blend_store(acc, rows, row_ok, oo, o_ok, so_ptr, sg_ptr, out_ptr, stride_som, stride_sgm, stride_om,
                 HAS_SHARED: tl.constexpr, ACT: tl.constexpr, INTERP: tl.constexpr):
    """out[rows, oo] = acc + sigmoid(shared_gate[rows]) * shared_out[rows, oo], in fp32, rounded once."""
    if HAS_SHARED:
        gate = _load_act(sg_ptr + rows * stride_sgm, row_ok, INTERP).to(tl.float32)        # [R]
        so = _load_act(so_ptr + rows[:, None] * stride_som + oo[None, :], row_ok[:, None] & o_ok[None, :],
                       INTERP).to(tl.float32)
        acc += tl.sigmoid(gate)[:, None] * so
    tl.store(out_ptr + rows[:, None] * stride_om + oo[None, :], _round_act(acc, ACT, INTERP, False),
             mask=row_ok[:, None] & o_ok[None, :])


# --- kernels ---------------------------------------------------------------------------------------------

@triton.jit
def _moe_route_softmax_kernel(logits_ptr, weights_ptr, ids_ptr, E, stride_lm,
                              TOP_K: tl.constexpr, KP: tl.constexpr, BE: tl.constexpr, RENORM: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)                   # times the row stride: past 2^31 at large N or strides
    offs = tl.arange(0, BE)
    valid = offs < E
    logit = tl.load(logits_ptr + row * stride_lm + offs, mask=valid, other=0.0).to(tl.float32)
    logit = tl.where(valid, logit, float("-inf"))                                          # [BE]
    gmax = tl.max(logit, axis=0)
    denom = tl.sum(tl.where(valid, tl.exp(logit - gmax), 0.0), axis=0)
    # One max a round over the logits' keys (`ordered_keys`: the reference's stable descending sort) finds the
    # next expert; taken and padding lanes hold NO_KEY.
    keys = tl.where(valid, ordered_keys(logit, offs), NO_KEY)
    ks = tl.arange(0, KP)
    w = tl.zeros((KP,), tl.float32)
    ids = tl.zeros((KP,), tl.int64)
    for j in tl.static_range(TOP_K):
        top = tl.max(keys, axis=0)
        best = key_index(top)
        w = tl.where(ks == j, tl.exp(key_value(top) - gmax) / denom, w)     # the softmax's probability of `best`
        ids = tl.where(ks == j, best, ids)
        keys = tl.where(offs == best, NO_KEY, keys)
    if RENORM:
        w = w / tl.sum(w, axis=0)
    tl.store(weights_ptr + row * TOP_K + ks, w, mask=ks < TOP_K)
    tl.store(ids_ptr + row * TOP_K + ks, ids, mask=ks < TOP_K)


@triton.jit
def _moe_gate_up_kernel(x_ptr, ids_ptr, w_ptr, s_ptr, g_ptr, h_ptr,
                        N, H, I, E, stride_xm, stride_we, stride_wn, stride_se, stride_sn,
                        C, TOP_K: tl.constexpr, KP: tl.constexpr, BM: tl.constexpr, BI: tl.constexpr,
                        BH: tl.constexpr, BY_EXPERT: tl.constexpr, NVFP4: tl.constexpr, ACT: tl.constexpr,
                        INTERP: tl.constexpr, LOWP_DOT: tl.constexpr, USE_ASM: tl.constexpr, PDL: tl.constexpr):
    """h[n * k + j, i] = silu(gate_e x_n)_i * (up_e x_n)_i for e = ids[n, j], over one tile of I; one
    program per (row group, candidate c < C). PDL: the down kernel may launch at once (`moe_pdl`)."""
    if PDL:
        gdc_launch_dependents()
    group = tl.program_id(0) // C
    rows, ids, local = _group_pairs(ids_ptr, N, TOP_K, KP, BM, group)
    e, owned = _candidate(ids_ptr, ids, local, group * BM * TOP_K, tl.program_id(0) % C,
                          N * TOP_K, E, BY_EXPERT)
    if owned:
        hit, has, slot = _expert_rows(ids, e, KP)                                          # [BM, KP], [BM]
        ii = tl.program_id(1) * BI + tl.arange(0, BI)
        i_ok = ii < I
        e64 = e.to(tl.int64)                               # a large stride_we times e needs 64 bits
        acc_g = tl.zeros((BM, BI), tl.float32)
        acc_u = tl.zeros((BM, BI), tl.float32)
        if NVFP4:                                          # w_ptr: the codes as int32 words [E, 2I, H/8]
            g_rows = w_ptr + e64 * stride_we + ii[:, None].to(tl.int64) * stride_wn                  # [BI, 1]
            gs_rows = s_ptr + e64 * stride_se + ii[:, None].to(tl.int64) * stride_sn
            u_rows, us_rows = g_rows + I * stride_wn, gs_rows + I * stride_sn
            x_rows = x_ptr + rows[:, None] * stride_xm                                              # [BM, 1]
            for k0 in range(0, H, BH):
                x = permuted_x(_act_tile(x_rows, has, k0, H, BH), BM, BH)                           # [BM, BH]
                gw, gs = nvfp4_words(g_rows, gs_rows, i_ok, k0, H, BH)
                uw, us = nvfp4_words(u_rows, us_rows, i_ok, k0, H, BH)
                acc_g = _nvfp4_dot(acc_g, x, gw, gs, BI, BH, ACT, LOWP_DOT, USE_ASM)
                acc_u = _nvfp4_dot(acc_u, x, uw, us, BI, BH, ACT, LOWP_DOT, USE_ASM)
            acc_g *= 256.0 * tl.load(g_ptr + e64 * 2)
            acc_u *= 256.0 * tl.load(g_ptr + e64 * 2 + 1)
        else:
            for h0 in range(0, H, BH):
                hh = h0 + tl.arange(0, BH)
                h_ok = hh < H
                xt = _load_act(x_ptr + rows[:, None] * stride_xm + hh[None, :], has[:, None] & h_ok[None, :],
                               INTERP)                                                     # [BM, BH]
                wp = w_ptr + e64 * stride_we + ii[:, None] * stride_wn + hh[None, :]
                wm = i_ok[:, None] & h_ok[None, :]
                wg = _load_act(wp, wm, INTERP)                                             # [BI, BH]
                wu = _load_act(wp + I * stride_wn, wm, INTERP)
                acc_g += tl.dot(xt, tl.trans(wg), input_precision="ieee")
                acc_u += tl.dot(xt, tl.trans(wu), input_precision="ieee")
        act = acc_g * tl.sigmoid(acc_g) * acc_u                                            # [BM, BI]
        tl.store(h_ptr + (rows * TOP_K + slot)[:, None] * I + ii[None, :], _round_act(act, ACT, INTERP, False),
                 mask=has[:, None] & i_ok[None, :])


@triton.jit
def _moe_down_kernel(h_ptr, ids_ptr, tw_ptr, w_ptr, s_ptr, g_ptr, so_ptr, sg_ptr, out_ptr, part_ptr,
                     N, H, I, E, stride_we, stride_wn, stride_se, stride_sn, stride_som, stride_sgm,
                     stride_om, C, SPLIT, TOP_K: tl.constexpr, KP: tl.constexpr, BM: tl.constexpr, BHO: tl.constexpr,
                     BI: tl.constexpr, BY_EXPERT: tl.constexpr, NVFP4: tl.constexpr, HAS_SHARED: tl.constexpr,
                     PARTIAL: tl.constexpr, ACT: tl.constexpr, INTERP: tl.constexpr, LOWP_DOT: tl.constexpr,
                     USE_ASM: tl.constexpr, PDL: tl.constexpr):
    """out[n, o] = sum_j tw[n, j] * round(down_e h[n * k + j])_o + sigmoid(sg[n]) * so[n, o], over one tile
    of H. One program per (row group, split, tile); split s takes candidates s, s + SPLIT, ... With
    PARTIAL (SPLIT > 1) it stores its fp32 sum in part[s, n, o] for `_moe_blend_kernel`. PDL (`moe_pdl`):
    launched while gate_up runs, it reads its group's routing, then waits for gate_up to end; and lets the
    blend launch at once."""
    if PDL:
        gdc_launch_dependents()
    group = tl.program_id(0) // SPLIT
    split = tl.program_id(0) % SPLIT
    rows, ids, local = _group_pairs(ids_ptr, N, TOP_K, KP, BM, group)
    row_ok = rows < N
    slots = tl.arange(0, KP)
    tw = tl.load(tw_ptr + rows[:, None] * TOP_K + slots[None, :],
                 mask=row_ok[:, None] & (slots < TOP_K)[None, :], other=0.0).to(tl.float32)  # [BM, KP]
    if PDL:
        gdc_wait()                                          # h is gate_up's
    oo = tl.program_id(1) * BHO + tl.arange(0, BHO)
    o_ok = oo < H
    acc = tl.zeros((BM, BHO), tl.float32)
    first = group * BM * TOP_K
    for c in range(split, C, SPLIT):
        e, owned = _candidate(ids_ptr, ids, local, first, c, N * TOP_K, E, BY_EXPERT)
        if owned:
            hit, has, slot = _expert_rows(ids, e, KP)                                      # [BM, KP], [BM]
            weight = tl.sum(tl.where(hit, tw, 0.0), axis=1)                                # [BM], 0 off e
            hrow = h_ptr + (rows * TOP_K + slot)[:, None] * I                              # [BM, 1]
            e64 = e.to(tl.int64)
            y = tl.zeros((BM, BHO), tl.float32)
            if NVFP4:                                      # w_ptr: the codes as int32 words [E, H, I/8]
                d_rows = w_ptr + e64 * stride_we + oo[:, None].to(tl.int64) * stride_wn             # [BHO, 1]
                ds_rows = s_ptr + e64 * stride_se + oo[:, None].to(tl.int64) * stride_sn
                for k0 in range(0, I, BI):
                    dw, ds = nvfp4_words(d_rows, ds_rows, o_ok, k0, I, BI)
                    y = _nvfp4_dot(y, permuted_x(_act_tile(hrow, has, k0, I, BI), BM, BI), dw, ds, BHO, BI, ACT,
                                   LOWP_DOT, USE_ASM)
                y *= 256.0 * tl.load(g_ptr + e64)
            else:
                for i0 in range(0, I, BI):
                    ii = i0 + tl.arange(0, BI)
                    i_ok = ii < I
                    ht = _load_act(hrow + ii[None, :], has[:, None] & i_ok[None, :], INTERP)
                    wd = _load_act(w_ptr + e64 * stride_we + oo[:, None] * stride_wn + ii[None, :],
                                   o_ok[:, None] & i_ok[None, :], INTERP)                  # [BHO, BI]
                    y += tl.dot(ht, tl.trans(wd), input_precision="ieee")
            # Only the rows that chose e: the others loaded zeros for h, and 0 * an Inf weight is NaN.
            acc += tl.where(has[:, None], weight[:, None] * _round_act(y, ACT, INTERP, True), 0.0)
    if PARTIAL:
        tl.store(part_ptr + (split * N + rows)[:, None] * H + oo[None, :], acc, mask=row_ok[:, None] & o_ok[None, :])
    else:
        _blend_store(acc, rows, row_ok, oo, o_ok, so_ptr, sg_ptr, out_ptr, stride_som, stride_sgm, stride_om,
                     HAS_SHARED, ACT, INTERP)


@triton.jit
def _pair_owner(ids_ptr, pair, E, TOP_K: tl.constexpr, KP: tl.constexpr):
    """(row, slot, expert id int64, owned, the row's ids [KP]) of a (row, slot) pair: owned when its id lies in
    [0, E) and no earlier slot of its row holds it (as `_expert_rows`: a row that repeats an expert counts it
    once)."""
    n = pair // TOP_K
    j = pair % TOP_K
    slots = tl.arange(0, KP)
    row_ids = tl.load(ids_ptr + n * TOP_K + slots, mask=slots < TOP_K, other=-1)                 # [KP]
    e = tl.load(ids_ptr + pair)
    first = tl.min(tl.where(row_ids == e, slots, KP), axis=0)
    return n, j, e, (e >= 0) & (e < E) & (first == j), row_ids


@triton.jit
def _moe_gate_up_gemv_kernel(x_ptr, ids_ptr, w_ptr, s_ptr, g_ptr, h_ptr, H, I, E, stride_xm, stride_we, stride_wn,
                             stride_se, stride_sn, TOP_K: tl.constexpr, KP: tl.constexpr, BI: tl.constexpr,
                             BH: tl.constexpr, F16: tl.constexpr, EVEN_K: tl.constexpr, XBLOCK: tl.constexpr,
                             ACT: tl.constexpr, INTERP: tl.constexpr, USE_ASM: tl.constexpr, PDL: tl.constexpr):
    """NVFP4 experts, few rows (`GEMV_MAX_ROWS`): h[pair, i] = silu(gate_e x_n)_i * (up_e x_n)_i for the pair's
    expert e, one program per ((row n, slot) pair, tile of BI intermediate columns), owners only
    (`_pair_owner`), as GEMVs: at a decode step's few rows most experts serve one row, and the dot kernel's 16
    rows a group would be mostly padding. F16 (16-bit x): x's row times 2^e (`x_exponent`, exact in fp16)
    summed against each block in fp16 pairs (`nvfp4_f16_block_sums`, as the LM head's GEMV); fp32 x: the fp32
    step (`gemv_nvfp4_step`). PDL: the down kernel may launch at once (`moe_pdl`)."""
    if PDL:
        gdc_launch_dependents()
    pair = tl.program_id(0)
    n, j, e, owned, _ = _pair_owner(ids_ptr, pair, E, TOP_K, KP)
    if owned:
        e64 = e.to(tl.int64)
        ii = tl.program_id(1) * BI + tl.arange(0, BI)
        i_ok = ii < I
        g_rows = w_ptr + e64 * stride_we + ii[:, None].to(tl.int64) * stride_wn                      # [BI, 1]
        gs_rows = s_ptr + e64 * stride_se + ii[:, None].to(tl.int64) * stride_sn
        u_rows, us_rows = g_rows + I * stride_wn, gs_rows + I * stride_sn
        x_row = x_ptr + n.to(tl.int64) * stride_xm
        acc_g = tl.zeros([BI, BH // 16], tl.float32)
        acc_u = tl.zeros([BI, BH // 16], tl.float32)
        if F16:
            gw, gs = nvfp4_words(g_rows, gs_rows, i_ok, 0, H, BH)          # step 0 in flight during x's scan
            uw, us = nvfp4_words(u_rows, us_rows, i_ok, 0, H, BH)
            e_x = x_exponent(x_row, 0, H, 1, XBLOCK)
            x_scale = pow2(e_x)
            # Two K steps an iteration, each step's words loaded one step ahead into the other step's registers:
            # with one step an iteration, the copy of the next step's words into this one's waited for their
            # load (the thirtieth run's profile); past H the loads are masked and the sums add zeros.
            for k0 in range(0, H, 2 * BH):
                gw1, gs1 = nvfp4_words(g_rows, gs_rows, i_ok, k0 + BH, H, BH)
                uw1, us1 = nvfp4_words(u_rows, us_rows, i_ok, k0 + BH, H, BH)
                p = x_f16_pairs_step(x_row, k0, H, x_scale, BH, EVEN_K, USE_ASM)
                acc_g = nvfp4_f16_block_sums(acc_g, gw, gs, p, BI, BH // 16, USE_ASM)
                acc_u = nvfp4_f16_block_sums(acc_u, uw, us, p, BI, BH // 16, USE_ASM)
                gw, gs = nvfp4_words(g_rows, gs_rows, i_ok, k0 + 2 * BH, H, BH)
                uw, us = nvfp4_words(u_rows, us_rows, i_ok, k0 + 2 * BH, H, BH)
                p = x_f16_pairs_step(x_row, k0 + BH, H, x_scale, BH, EVEN_K, USE_ASM)
                acc_g = nvfp4_f16_block_sums(acc_g, gw1, gs1, p, BI, BH // 16, USE_ASM)
                acc_u = nvfp4_f16_block_sums(acc_u, uw1, us1, p, BI, BH // 16, USE_ASM)
            gate = times_pow2(tl.sum(acc_g, axis=1), 6 - e_x) * tl.load(g_ptr + e64 * 2)          # [BI]
            up = times_pow2(tl.sum(acc_u, axis=1), 6 - e_x) * tl.load(g_ptr + e64 * 2 + 1)
        else:
            for k0 in range(0, H, BH):
                acc_g = gemv_nvfp4_step(acc_g, x_row, 1, g_rows, gs_rows, i_ok, k0, H, BI, BH, USE_ASM)
                acc_u = gemv_nvfp4_step(acc_u, x_row, 1, u_rows, us_rows, i_ok, k0, H, BI, BH, USE_ASM)
            gate = tl.sum(acc_g, axis=1) * (64.0 * tl.load(g_ptr + e64 * 2))                       # [BI]
            up = tl.sum(acc_u, axis=1) * (64.0 * tl.load(g_ptr + e64 * 2 + 1))
        tl.store(h_ptr + pair.to(tl.int64) * I + ii, _round_act(gate * tl.sigmoid(gate) * up, ACT, INTERP, False),
                 mask=i_ok)


@triton.jit
def _moe_down_gemv_kernel(h_ptr, ids_ptr, tw_ptr, w_ptr, s_ptr, g_ptr, part_ptr, N, H, I, E, stride_we, stride_wn,
                          stride_se, stride_sn, TOP_K: tl.constexpr, KP: tl.constexpr, BHO: tl.constexpr,
                          BI: tl.constexpr, F16: tl.constexpr, EVEN_K: tl.constexpr, XBLOCK: tl.constexpr,
                          ACT: tl.constexpr, INTERP: tl.constexpr, USE_ASM: tl.constexpr, PDL: tl.constexpr):
    """NVFP4 experts, few rows: part[slot, n, o] = w * round(down_e h[pair])_o for each (row n, slot) pair, w the
    row's weights of expert e summed; zero where the pair is not its expert's owner (`_pair_owner`). One program
    per (pair, tile of BHO output columns); `_moe_blend_kernel` sums the slots in order and blends. F16: h's row
    as the gate_up kernel takes x's. PDL (`moe_pdl`): launched while gate_up runs, each program reads its
    pair's routing and the weights of its first K step, then waits for gate_up to end before it reads h; and
    lets the blend launch at once."""
    if PDL:
        gdc_launch_dependents()
    pair = tl.program_id(0)
    n, j, e, owned, row_ids = _pair_owner(ids_ptr, pair, E, TOP_K, KP)
    oo = tl.program_id(1) * BHO + tl.arange(0, BHO)
    o_ok = oo < H
    e64 = tl.where(owned, e, 0).to(tl.int64)                # e past E (or -1) is never read: owners only
    d_rows = w_ptr + e64 * stride_we + oo[:, None].to(tl.int64) * stride_wn                         # [BHO, 1]
    ds_rows = s_ptr + e64 * stride_se + oo[:, None].to(tl.int64) * stride_sn
    if F16:
        dw, ds = nvfp4_words(d_rows, ds_rows, o_ok & owned, 0, I, BI)  # step 0 in flight during h's scan
    slots = tl.arange(0, KP)
    tw = tl.load(tw_ptr + n * TOP_K + slots, mask=slots < TOP_K, other=0.0)
    if PDL:
        gdc_wait()                                          # every program: this grid ends after gate_up's
    val = tl.zeros([BHO], tl.float32)
    if owned:
        weight = tl.sum(tl.where(row_ids == e, tw, 0.0), axis=0)
        h_row = h_ptr + pair.to(tl.int64) * I
        acc = tl.zeros([BHO, BI // 16], tl.float32)
        if F16:
            e_h = x_exponent(h_row, 0, I, 1, XBLOCK)
            h_scale = pow2(e_h)
            for k0 in range(0, I, 2 * BI):                  # two K steps an iteration, as gate_up's
                dw1, ds1 = nvfp4_words(d_rows, ds_rows, o_ok, k0 + BI, I, BI)
                p = x_f16_pairs_step(h_row, k0, I, h_scale, BI, EVEN_K, USE_ASM)
                acc = nvfp4_f16_block_sums(acc, dw, ds, p, BHO, BI // 16, USE_ASM)
                dw, ds = nvfp4_words(d_rows, ds_rows, o_ok, k0 + 2 * BI, I, BI)
                p = x_f16_pairs_step(h_row, k0 + BI, I, h_scale, BI, EVEN_K, USE_ASM)
                acc = nvfp4_f16_block_sums(acc, dw1, ds1, p, BHO, BI // 16, USE_ASM)
            y = times_pow2(tl.sum(acc, axis=1), 6 - e_h) * tl.load(g_ptr + e64)
        else:
            for k0 in range(0, I, BI):
                acc = gemv_nvfp4_step(acc, h_row, 1, d_rows, ds_rows, o_ok, k0, I, BHO, BI, USE_ASM)
            y = tl.sum(acc, axis=1) * (64.0 * tl.load(g_ptr + e64))
        val = weight * _round_act(y, ACT, INTERP, True)
    tl.store(part_ptr + (j * N + n).to(tl.int64) * H + oo, val, mask=o_ok)


@triton.jit
def _moe_blend_kernel(part_ptr, so_ptr, sg_ptr, out_ptr, N, H, SPLIT, stride_ps, stride_som, stride_sgm, stride_om,
                      BM: tl.constexpr, BHO: tl.constexpr, HAS_SHARED: tl.constexpr, ACT: tl.constexpr,
                      INTERP: tl.constexpr, PDL: tl.constexpr):
    """out = sum over the splits of part[s] (in split order: deterministic) + the shared blend. PDL: launched
    while the down kernel runs (`moe_pdl`), it waits for it to end."""
    if PDL:
        gdc_wait()
    rows = (tl.program_id(0) * BM + tl.arange(0, BM)).to(tl.int64)      # times H or a row stride: past 2^31
    oo = tl.program_id(1) * BHO + tl.arange(0, BHO)
    row_ok, o_ok = rows < N, oo < H
    acc = tl.zeros((BM, BHO), tl.float32)
    parts = part_ptr + rows[:, None] * H + oo[None, :]                                  # split 0's [BM, BHO]
    for s in range(0, SPLIT):
        acc += tl.load(parts, mask=row_ok[:, None] & o_ok[None, :], other=0.0)
        parts += stride_ps                          # the next split's (N * H: Triton passes it as i64 past 2^31)
    _blend_store(acc, rows, row_ok, oo, o_ok, so_ptr, sg_ptr, out_ptr, stride_som, stride_sgm, stride_om,
                 HAS_SHARED, ACT, INTERP)


# --- launchers, rules and registration -----------------------------------------------------------------

def moe_route_softmax_triton(router_logits: torch.Tensor, top_k: int, renormalize: bool, *,
                             out: tuple[torch.Tensor, torch.Tensor] | None = None):
    """The reference's contract for the calls `moe_route_softmax_refusal` passes; the others are refused by name
    before anything is written."""
    if err := _route_call_refusal(router_logits, top_k, renormalize, out=out):
        raise err
    return _route_launch(router_logits, top_k, renormalize, out=out)


def _route_launch(router_logits: torch.Tensor, top_k: int, renormalize: bool, *,
                  out: tuple[torch.Tensor, torch.Tensor] | None = None):
    """`moe_route_softmax_triton` on a call `moe_route_softmax_refusal` passed (the op's predicate checked it:
    one check a call)."""
    n, e = router_logits.shape
    if err := _route_out_refusal(out, n, top_k, router_logits.device):
        raise err
    logits = router_logits if router_logits.stride(-1) == 1 else router_logits.contiguous()
    weights, ids = out if out is not None else (
        torch.empty(n, top_k, dtype=torch.float32, device=logits.device),
        torch.empty(n, top_k, dtype=torch.int64, device=logits.device))
    if n:
        _moe_route_softmax_kernel[(n,)](logits, weights, ids, e, logits.stride(0), TOP_K=top_k,
                                        KP=next_power_of_2(top_k), BE=next_power_of_2(e),
                                        RENORM=bool(renormalize))
    return weights, ids


def moe_route_softmax_refusal(router_logits: torch.Tensor, top_k: int) -> InputError | None:
    """Why `moe_route_softmax_triton` cannot take a call, as the error it raises (the op's predicate says no to
    the same calls), or None: the reference's shapes (`_route_shape_refusal`), logits in bf16, fp16 or fp32
    (any strides) and at most MAX_ROUTED_EXPERTS experts (one program holds a row); top_k at most
    MAX_ROUTED_TOP_K (the kernel unrolls its picks: a compile that grows with top_k)."""
    if err := _route_shape_refusal(router_logits, top_k):
        return err
    if top_k > MAX_ROUTED_TOP_K:
        return InputError("top_k", top_k, f"at most {MAX_ROUTED_TOP_K} (the kernel unrolls its picks)",
                          "call the op (`moe_route_softmax`) under runtime.backend=auto: it runs the reference for "
                          "more")
    if router_logits.dtype not in ACT_DTYPES or router_logits.shape[1] > MAX_ROUTED_EXPERTS:
        return InputError("router_logits", _desc(router_logits), f"bf16, fp16 or fp32 [N, E] logits, E up to "
                          f"{MAX_ROUTED_EXPERTS} (a row in one program)", "call the op (`moe_route_softmax`) under "
                          "runtime.backend=auto: it runs the reference for the others")
    return None


def _route_call_refusal(router_logits, top_k, renormalize, *, out=None) -> InputError | None:
    """`moe_route_softmax_refusal`, and an `out` sharing memory with the logits but for the weights being the
    logits themselves (fp32, top_k = E): program n reads its whole row of logits before it writes that row of
    the weights and ids, and no other program reads the row. Any other overlap (the ids are int64, never the
    logits) is refused: a program would write into a row that another has yet to read."""
    return (moe_route_softmax_refusal(router_logits, top_k)
            or outs_overlap_refusal(out, _ROUTE_OUT_NAMES, in_place=("router_logits",), router_logits=router_logits))


def _tiles(hidden: int, inter: int, nvfp4: bool) -> dict:
    """Tile sizes: BI gate and up rows per gate_up program, BHO down rows per down program; the K chunks
    (BH over H, BI_K over I) at least 32 wide (a dot needs 16), and for NVFP4 whole words of 8 codes and
    16-element blocks: K tiles of up to 256, as the NVFP4 GEMM's dot kernel takes."""
    widest = 256 if nvfp4 else 128
    return dict(BI=32, BHO=64, BH=min(widest, max(32, next_power_of_2(hidden))),
                BI_K=min(widest, max(32, next_power_of_2(inter))), warps=4)


def _launch_moe(x, tensors, inter, topk_weights, topk_ids, shared_out, shared_gate, out, workspace, nvfp4):
    """Both MoE providers, on a call their rule passed. tensors = (gate_up weight, its scale, its global, down
    weight, its scale, its global); the scale and global entries are ignored (pass anything) for unquantized
    weights. Checks `out` and `workspace` (as the references do) before it writes anything."""
    w_gu, s_gu, g_gu, w_dn, s_dn, g_dn = tensors
    n, hidden = x.shape
    top_k = topk_ids.shape[1]
    if err := _moe_args_refusal(x, top_k, inter, shared_out, shared_gate, out, workspace):
        raise err
    x = x if x.stride(-1) == 1 else x.contiguous()
    out = torch.empty(n, hidden, dtype=x.dtype, device=x.device) if out is None else out
    if n == 0:
        return out
    ids = topk_ids.to(torch.int64).contiguous()
    tw = topk_weights.to(torch.float32).contiguous()
    h = workspace if workspace is not None else torch.empty(n * top_k, inter, dtype=x.dtype, device=x.device)
    has_shared = shared_out is not None
    so = shared_out if has_shared else x
    sg = shared_gate if has_shared else x
    if nvfp4 and n <= GEMV_MAX_ROWS:
        return _launch_moe_gemv(x, tensors, inter, top_k, ids, tw, h, so, sg, out, has_shared)
    bm = min(32, max(16, next_power_of_2(n)))      # rows per group; a dot needs 16
    groups = cdiv(n, bm)
    # A group's candidates: its (row, slot) pairs, or every expert id when there are fewer experts.
    cand = min(n, bm) * top_k
    by_expert = w_gu.shape[0] < cand
    cand = w_gu.shape[0] if by_expert else cand
    pdl = moe_pdl(x)
    consts = dict(C=cand, TOP_K=top_k, KP=next_power_of_2(top_k), BM=bm, BY_EXPERT=by_expert, NVFP4=nvfp4,
                  ACT=ACT_DTYPES[x.dtype], INTERP=x.device.type == "cpu", LOWP_DOT=lowp_dot(x), USE_ASM=x.is_cuda,
                  PDL=pdl)
    t = _tiles(hidden, inter, nvfp4)
    s_strides = (s_gu.stride(0), s_gu.stride(1)) if nvfp4 else (0, 0)
    _moe_gate_up_kernel[(groups * cand, cdiv(inter, t["BI"]))](
        x, ids, w_gu, s_gu, g_gu, h, n, hidden, inter, w_gu.shape[0], x.stride(0), w_gu.stride(0), w_gu.stride(1),
        *s_strides, BI=t["BI"], BH=t["BH"], num_warps=t["warps"], **consts)
    # The down kernel walks a group's candidates one after another; split them over programs until the
    # grid has a few programs per SM, then sum the fp32 partials in a fixed order.
    tiles = cdiv(hidden, t["BHO"])
    # (the interpreter, which runs programs one by one, weighed as 8 SMs: a few splits, each path run)
    split = max(1, min(cand, MAX_SPLIT, (4 * (sm_count(x.device) or 8)) // (groups * tiles)))
    part = torch.empty(split, n, hidden, dtype=torch.float32, device=x.device) if split > 1 else out
    strides = (so.stride(0), sg.stride(0), out.stride(0))
    s_strides = (s_dn.stride(0), s_dn.stride(1)) if nvfp4 else (0, 0)
    _moe_down_kernel[(groups * split, tiles)](
        h, ids, tw, w_dn, s_dn, g_dn, so, sg, out, part, n, hidden, inter, w_dn.shape[0], w_dn.stride(0),
        w_dn.stride(1), *s_strides, *strides, SPLIT=split, BHO=t["BHO"], BI=t["BI_K"], HAS_SHARED=has_shared,
        PARTIAL=split > 1, num_warps=t["warps"], launch_pdl=pdl, **consts)
    if split > 1:
        _moe_blend_kernel[(n, cdiv(hidden, 128))](
            part, so, sg, out, n, hidden, split, part.stride(0), *strides, BM=1, BHO=128, HAS_SHARED=has_shared,
            ACT=consts["ACT"], INTERP=consts["INTERP"], PDL=pdl, launch_pdl=pdl)
    return out


# On the GPU, at up to GEMV_MAX_ROWS rows, the down kernel and the blend are programmatic dependent launches
# (`moe_pdl`). H100, graph replays, Qwen3-Next's experts (BENCHMARKS.md, thirtieth run), without -> with:
# - NVFP4 GEMVs at N = 1 / 8 / 32: 17.58 / 67.62 / 210.14 us -> 15.19 / 65.80 / 210.47;
# - BF16 dots at N = 1 / 8 / 32: 31.27 / 166.05 / 551.62 -> 29.81 / 165.22 / 551.71;
# - at N = 64, no gain: BF16 1022.20 -> 1024.74, NVFP4 1428.52 -> 1428.37 (gate_up runs several waves there,
#   and the down programs launched early hold SM slots while they wait).
MOE_PDL = True


def moe_pdl(x: torch.Tensor) -> bool:
    """Whether the experts' down kernel (GEMV or dot) and the blend after it are programmatic dependent launches
    (`launch_pdl`): while `MOE_PDL` is set, for up to GEMV_MAX_ROWS rows of x (a decode step), on a GPU that has
    it (sm_90 on). The down kernel's programs then start while gate_up's run, read their routing (the GEMV: and
    its first weights), and wait (`gdc_wait`, every program) before reading h; the blend waits before reading
    the down kernel's partials. (The interpreter drops the launch option.) gate_up itself stays an ordinary
    launch: the routing the down kernel reads before its wait is then complete (were gate_up launched early
    too, the routing kernel before it might still be writing the ids)."""
    return x.is_cuda and MOE_PDL and x.shape[0] <= GEMV_MAX_ROWS and has_pdl(x.device)


@functools.lru_cache(maxsize=256)
def _gemv_tiles(pairs: int, hidden: int, inter: int, sms: int) -> tuple[tuple[int, int], tuple[int, int]]:
    """The GEMVs' tiles, ((BI, BH) of gate_up, (BHO, BI_K) of down): weight rows a program and its K step
    (GEMV_K_TILE). Each takes the most rows whose grid of (pair, tile) programs still gives every SM 4 or more
    (8 to 32 rows of gate and up, 32 or 64 of down): at a decode step's single row the programs are few and
    each waits on its loads in turn, so more of them read more at once; with more rows, bigger tiles read x
    and h fewer times."""
    def most_rows(choices: tuple[int, ...], n: int) -> int:
        return next((r for r in reversed(choices) if pairs * cdiv(n, r) >= 4 * sms), choices[0])
    return (most_rows((8, 16, 32), inter), GEMV_K_TILE), (most_rows((32, 64), hidden), GEMV_K_TILE)


def _launch_moe_gemv(x, tensors, inter, top_k, ids, tw, h, so, sg, out, has_shared):
    """NVFP4 experts at N <= GEMV_MAX_ROWS rows: the GEMV kernels over the (row, slot) pairs, then the blend
    of each row's slots in order (deterministic)."""
    w_gu, s_gu, g_gu, w_dn, s_dn, g_dn = tensors
    n, hidden = x.shape
    pdl = moe_pdl(x)
    consts = dict(TOP_K=top_k, KP=next_power_of_2(top_k), F16=x.dtype != torch.float32, ACT=ACT_DTYPES[x.dtype],
                  INTERP=x.device.type == "cpu", USE_ASM=x.is_cuda, PDL=pdl)
    # the interpreter runs the programs one by one, each step vectorized over its tile: the fewest, largest there
    (bi, bk), (bho, bk_down) = _gemv_tiles(n * top_k, hidden, inter, sm_count(x.device) or 1)
    _moe_gate_up_gemv_kernel[(n * top_k, cdiv(inter, bi))](
        x, ids, w_gu, s_gu, g_gu, h, hidden, inter, w_gu.shape[0], x.stride(0), w_gu.stride(0), w_gu.stride(1),
        s_gu.stride(0), s_gu.stride(1), BI=bi, BH=bk, EVEN_K=hidden % (2 * bk) == 0,      # two steps an iteration
        XBLOCK=x_scan_block(hidden), num_warps=4, **consts)
    part = torch.empty(top_k, n, hidden, dtype=torch.float32, device=x.device)
    _moe_down_gemv_kernel[(n * top_k, cdiv(hidden, bho))](
        h, ids, tw, w_dn, s_dn, g_dn, part, n, hidden, inter, w_dn.shape[0], w_dn.stride(0), w_dn.stride(1),
        s_dn.stride(0), s_dn.stride(1), BHO=bho, BI=bk_down, EVEN_K=inter % (2 * bk_down) == 0,
        XBLOCK=x_scan_block(inter), num_warps=4, launch_pdl=pdl, **consts)
    _moe_blend_kernel[(n, cdiv(hidden, 128))](
        part, so, sg, out, n, hidden, top_k, part.stride(0), so.stride(0), sg.stride(0), out.stride(0), BM=1, BHO=128,
        HAS_SHARED=has_shared, ACT=consts["ACT"], INTERP=consts["INTERP"], PDL=pdl, launch_pdl=pdl)
    return out


def fused_moe_triton(x, w_gate_up, w_down, topk_weights, topk_ids, shared_out=None, shared_gate=None, *,
                     out=None, workspace=None) -> torch.Tensor:
    """The `fused_moe` reference's contract for the calls `fused_moe_refusal` passes; the others are refused by
    name before anything is written."""
    if err := _fused_moe_call_refusal(x, w_gate_up, w_down, topk_weights, topk_ids, shared_out, shared_gate, out=out):
        raise err
    return _fused_moe_launch(x, w_gate_up, w_down, topk_weights, topk_ids, shared_out, shared_gate, out=out,
                             workspace=workspace)


def _fused_moe_launch(x, w_gate_up, w_down, topk_weights, topk_ids, shared_out=None, shared_gate=None, *,
                      out=None, workspace=None) -> torch.Tensor:
    """`fused_moe_triton` on a call `fused_moe_refusal` passed (the op's predicate checked it: one check a call)."""
    return _launch_moe(x, (w_gate_up, w_gate_up, w_gate_up, w_down, w_down, w_down), w_down.shape[2],
                       topk_weights, topk_ids, shared_out, shared_gate, out, workspace, nvfp4=False)


def fused_moe_nvfp4_triton(x, gu_weight, gu_scale, gu_global, dn_weight, dn_scale, dn_global, topk_weights,
                           topk_ids, shared_out=None, shared_gate=None, *, out=None, workspace=None) -> torch.Tensor:
    """The `fused_moe_nvfp4` reference's contract for the calls `fused_moe_nvfp4_refusal` passes; the others are
    refused by name before anything is written."""
    if err := _fused_moe_nvfp4_call_refusal(x, gu_weight, gu_scale, gu_global, dn_weight, dn_scale, dn_global,
                                            topk_weights, topk_ids, shared_out, shared_gate, out=out):
        raise err
    return _fused_moe_nvfp4_launch(x, gu_weight, gu_scale, gu_global, dn_weight, dn_scale, dn_global, topk_weights,
                                   topk_ids, shared_out, shared_gate, out=out, workspace=workspace)


def _fused_moe_nvfp4_launch(x, gu_weight, gu_scale, gu_global, dn_weight, dn_scale, dn_global, topk_weights,
                            topk_ids, shared_out=None, shared_gate=None, *, out=None, workspace=None) -> torch.Tensor:
    """`fused_moe_nvfp4_triton` on a call `fused_moe_nvfp4_refusal` passed (the op's predicate checked it: one
    check a call); the codes go to the kernels as int32 words of 8, the e4m3 scales as their uint8 bits."""
    tensors = (gu_weight.view(torch.int32), gu_scale.view(torch.uint8), gu_global.float().contiguous(),
               dn_weight.view(torch.int32), dn_scale.view(torch.uint8), dn_global.float().contiguous())
    return _launch_moe(x, tensors, gu_weight.shape[1] // 2, topk_weights, topk_ids, shared_out, shared_gate,
                       out, workspace, nvfp4=True)


def _unit_last(t: torch.Tensor) -> bool:
    """Unit stride along the last dim (the kernels step along it by 1), or a last dim of one element."""
    return t.shape[-1] <= 1 or t.stride(-1) == 1


def _moe_kernel_refusal(x, topk_weights, topk_ids, shared_out, shared_gate, op: str) -> InputError | None:
    """What both MoE kernels need of the activations and routing beyond `_moe_shape_refusal` (which passed),
    or None: x bf16, fp16 or fp32 with H >= 1 (any strides: rows not contiguous are copied); int32 or int64
    topk_ids [N, k], k >= 1, and floating topk_weights of that shape (any strides: both are copied);
    shared_out [N, H] with unit stride along H and shared_gate [N, 1] (rows at any stride), in x's dtype."""
    n, h = x.shape
    dt = _dtype(x.dtype)
    if x.dtype not in ACT_DTYPES or h == 0:
        return InputError("x", _desc(x), "a bf16, fp16 or fp32 [N, H] tensor, H >= 1",
                          f"call the op (`{op}`) under runtime.backend=auto: it runs the reference for the others")
    k = topk_ids.shape[1]
    if topk_ids.dtype not in (torch.int32, torch.int64) or topk_ids.shape[0] != n or k == 0:
        return InputError("topk_ids", _desc(topk_ids), f"int32 or int64 [N, k] with N = {n} (x's rows) and k >= 1",
                          "pass the ids moe_route_softmax chose for x's rows")
    if not topk_weights.is_floating_point() or topk_weights.shape != topk_ids.shape:
        return InputError("topk_weights", _desc(topk_weights), f"floating [N, k] = [{n}, {k}], topk_ids' shape",
                          "pass the weights moe_route_softmax returned with these ids")
    if shared_out is not None and (shared_out.dtype != x.dtype or shared_out.shape != x.shape
                                   or not _unit_last(shared_out)):
        return InputError("shared_out", _desc(shared_out, strides=True), f"a {dt} [N, H] = [{n}, {h}] tensor (x's "
                          "dtype and shape) with unit stride along H", "pass shared_out.to(x.dtype).contiguous()")
    if shared_gate is not None and (shared_gate.dtype != x.dtype or tuple(shared_gate.shape) != (n, 1)):
        return InputError("shared_gate", _desc(shared_gate), f"a {dt} [N, 1] = [{n}, 1] tensor: a gate logit a "
                          "row, in x's dtype", "pass the shared expert gate's [N, 1] logits in x's dtype")
    return None


def fused_moe_refusal(x, w_gate_up, w_down, topk_weights, topk_ids, shared_out=None,
                      shared_gate=None) -> InputError | None:
    """Why `fused_moe_triton` cannot take a call, as the error it raises (the op's predicate says no to the same
    calls), or None: the reference's shapes (`_moe_shape_refusal`, `_experts_shape_refusal`), exactly
    (`_moe_kernel_refusal`); E and I at least 1; w_down of w_gate_up's E; both weights with unit stride along
    their last dim (any other strides: the kernels step by them, in int64 between experts)."""
    if err := (_moe_shape_refusal(x, topk_weights, topk_ids, shared_out, shared_gate)
               or _experts_shape_refusal(x, w_gate_up, w_down)
               or _moe_kernel_refusal(x, topk_weights, topk_ids, shared_out, shared_gate, "fused_moe")):
        return err
    h = x.shape[1]
    e, i = w_gate_up.shape[0], w_gate_up.shape[1] // 2
    if e == 0 or i == 0 or not _unit_last(w_gate_up):
        return InputError("w_gate_up", _desc(w_gate_up, strides=True), "[E, 2I, H] with E >= 1, I >= 1 and unit "
                          "stride along H", "pass the gate_up weights of at least one expert, w_gate_up.contiguous()")
    if w_down.shape[0] != e or not _unit_last(w_down):
        return InputError("w_down", _desc(w_down, strides=True), f"[E, H, I] = [{e}, {h}, {i}] (w_gate_up's E) with "
                          "unit stride along I", "pass the down weights of w_gate_up's experts, w_down.contiguous()")
    return None


def fused_moe_nvfp4_refusal(x, gu_weight, gu_scale, gu_global, dn_weight, dn_scale, dn_global, topk_weights,
                            topk_ids, shared_out=None, shared_gate=None) -> InputError | None:
    """Why `fused_moe_nvfp4_triton` cannot take a call, as the error it raises (the op's predicate says no to
    the same calls), or None: the reference's shapes (`_moe_shape_refusal`, `_nvfp4_shape_refusal`), exactly
    (`_moe_kernel_refusal`); H and I positive multiples of 16 (whole NVFP4 blocks); codes uint8, block scales
    float8_e4m3fn, codes and scales with unit stride along their last dim; globals floating (any strides)."""
    if err := (_moe_shape_refusal(x, topk_weights, topk_ids, shared_out, shared_gate)
               or _nvfp4_shape_refusal(x, gu_weight, gu_scale, gu_global, dn_weight, dn_scale, dn_global)
               or _moe_kernel_refusal(x, topk_weights, topk_ids, shared_out, shared_gate, "fused_moe_nvfp4")):
        return err
    h = x.shape[1]
    if h % 16:
        return InputError("x", _desc(x), "H a multiple of 16 with NVFP4 experts (whole 16-element blocks along H)",
                          "call the op (`fused_moe_nvfp4`) under runtime.backend=auto: it runs the reference for "
                          "the others")
    e, i = gu_weight.shape[0], gu_weight.shape[1] // 2
    if gu_weight.dtype != torch.uint8 or e == 0 or i == 0 or i % 16 or not _unit_last(gu_weight):
        return InputError("gu_weight", _desc(gu_weight, strides=True), "uint8 [E, 2I, H/2] with E >= 1, I a "
                          "positive multiple of 16 (whole NVFP4 blocks along I) and unit stride along H",
                          "pass the packed NVFP4 gate_up codes (quantize_nvfp4) of at least one expert, contiguous")
    if err := words_refusal("gu_weight", gu_weight, InputError):
        return err
    wants = (("gu_scale", gu_scale, torch.float8_e4m3fn, (e, 2 * i, h // 16)), ("gu_global", gu_global, None, (e, 2)),
             ("dn_weight", dn_weight, torch.uint8, (e, h, i // 2)),
             ("dn_scale", dn_scale, torch.float8_e4m3fn, (e, h, i // 16)), ("dn_global", dn_global, None, (e,)))
    for name, t, dtype, shape in wants:
        if (not t.is_floating_point() if dtype is None else t.dtype != dtype) or tuple(t.shape) != shape:
            return InputError(name, _desc(t), f"a {'floating' if dtype is None else _dtype(dtype)} {list(shape)} "
                              f"tensor (E = {e}, H = {h}, I = {i})", f"pass the {name} quantize_nvfp4 made with "
                              "these experts' codes")
        if dtype is not None and not _unit_last(t):
            return InputError(name, _desc(t, strides=True), "unit stride along the last dim",
                              f"pass {name}.contiguous()")
    return words_refusal("dn_weight", dn_weight, InputError)


def _moe_out_overlap_refusal(out, topk_weights, topk_ids, shared_out, shared_gate, **down) -> InputError | None:
    """An `out` sharing memory with what the kernels still read while they write it: the routing and the down
    experts (`down`, by name), which the down kernel reads while it writes out where it runs as one split (a
    grid of many programs; with several splits `_moe_blend_kernel` writes out once it has ended, but how many
    run depends on the GPU); the shared gate, which every program of a row reads; the shared output but for out
    being it itself (each of its elements is read just before the same program writes that element of out).
    x and the gate_up experts are read only by the first launch, which ends before any launch writes out: out
    may overlap them anyhow (the MoE in place over its activations)."""
    return overlap_refusal("out", out, in_place=("shared_out",), topk_weights=topk_weights, topk_ids=topk_ids,
                           **down, shared_out=shared_out, shared_gate=shared_gate)


def _fused_moe_call_refusal(x, w_gate_up, w_down, topk_weights, topk_ids, shared_out=None, shared_gate=None, *,
                            out=None, workspace=None) -> InputError | None:
    """`fused_moe_refusal`, and `out` as `_moe_out_overlap_refusal` takes it (the contract checks `workspace`)."""
    return (fused_moe_refusal(x, w_gate_up, w_down, topk_weights, topk_ids, shared_out, shared_gate)
            or _moe_out_overlap_refusal(out, topk_weights, topk_ids, shared_out, shared_gate, w_down=w_down))


def _fused_moe_nvfp4_call_refusal(x, gu_weight, gu_scale, gu_global, dn_weight, dn_scale, dn_global, topk_weights,
                                  topk_ids, shared_out=None, shared_gate=None, *, out=None,
                                  workspace=None) -> InputError | None:
    """`fused_moe_nvfp4_refusal`, and `out` as `_moe_out_overlap_refusal` takes it (the contract checks
    `workspace`)."""
    return (fused_moe_nvfp4_refusal(x, gu_weight, gu_scale, gu_global, dn_weight, dn_scale, dn_global, topk_weights,
                                    topk_ids, shared_out, shared_gate)
            or _moe_out_overlap_refusal(out, topk_weights, topk_ids, shared_out, shared_gate, dn_weight=dn_weight,
                                        dn_scale=dn_scale, dn_global=dn_global))


moe_route_softmax.register_provider("triton", _route_launch, _route_call_refusal)
fused_moe.register_provider("triton", _fused_moe_launch, _fused_moe_call_refusal)
fused_moe_nvfp4.register_provider("triton", _fused_moe_nvfp4_launch, _fused_moe_nvfp4_call_refusal)
