"""What the GEMV tests share (test_linear*.py, test_rms_norm_linear_nvfp4.py): the tolerance, the poisoned
output, the tile plans, the check of a kernel launched beside x's pass, NVFP4 inputs and x's pass's
reference."""

from __future__ import annotations

import importlib

import pytest
import torch

from mtpfactory.kernels.linear import make_plan
from mtpfactory.quant import quantize_nvfp4

# |out - ref| <= OUT_RTOL * |ref| + SUM_RTOL * sum|x||w|: the second term covers fp32 partial sums taken in
# another order; the first, the final rounding landing on a neighbouring value of the output dtype. A
# dropped or doubled K tile misses by the order of sum|x||w| and fails.
OUT_RTOL = {torch.float32: 1e-5, torch.float16: 2.0**-10, torch.bfloat16: 2.0**-7}
SUM_RTOL = 1e-5
# The NVFP4 GEMVs that sum each half-block of 8 products in fp16 (`linear_nvfp4.uses_f16_gemv`): 8 roundings to
# 11 bits, at most 2^-8 of the block's sum |x||w| (test_linear_nvfp4.py says why)
F16_SUM_RTOL = 2.0**-8
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
SHAPES = [(1, 16), (7, 48), (33, 80), (130, 48)]   # (N, K): N and K off the tile sizes
MS = [1, 3, 17, 32]                                   # FMA path (M <= 8) and tl.dot path (BLOCK_M 32)


def assert_matches(out: torch.Tensor, ref: torch.Tensor, abs_sum: torch.Tensor, sum_rtol: float = SUM_RTOL) -> None:
    """|out - ref| <= OUT_RTOL[dtype] * |ref| + sum_rtol * abs_sum elementwise; a NaN left by the poisoned
    output (an element the kernel never wrote) fails."""
    assert out.shape == ref.shape and out.dtype == ref.dtype
    assert torch.isfinite(out).all(), f"{int((~torch.isfinite(out)).sum())} elements not written"
    o, r = out.double(), ref.double()
    bound = OUT_RTOL[out.dtype] * r.abs() + sum_rtol * abs_sum.double()
    bad = (o - r).abs() > bound
    assert not bad.any(), (f"{int(bad.sum())}/{bad.numel()} elements off, worst {(o - r).abs().max().item():.3g} "
                           f"at {tuple(bad.nonzero()[0].tolist())}")


def poisoned(m: int, n: int, dtype: torch.dtype, device: str = "cpu") -> torch.Tensor:
    return torch.full((m, n), float("nan"), dtype=dtype, device=device)


def explicit_plans(m: int, n: int, k: int, first_block_k: int = 16, fma_m: bool = True) -> list:
    """Tiles smaller than the shapes tested (several N tiles and K chunks, the last of each partial) on
    every path: tl.dot, tl.dot with swapped operands, CUDA-core FMAs (M <= 8: a GEMV for M = 1, and with
    `fma_m` an FMA tile of 2, 4 or 8 rows for M > 1), unsplit and split-K over 2 or 3 slices (the last one
    shorter)."""
    bm_dot = 16 if m <= 16 else 32
    plans = [make_plan(m, n, k, block_n=16, block_k=first_block_k, block_m=bm_dot),
             make_plan(m, n, k, block_n=32, block_k=32, splits=3, block_m=bm_dot),
             make_plan(m, n, k, block_n=16, block_k=32, splits=2, block_m=bm_dot, swap_ab=True)]
    if m == 1 or (m <= 8 and fma_m):
        bm_fma = 1 << (m - 1).bit_length()
        plans += [make_plan(m, n, k, block_n=8, block_k=16, block_m=bm_fma),
                  make_plan(m, n, k, block_n=16, block_k=32, splits=3, block_m=bm_fma)]
    return plans


def assert_pdl_reads_its_own_x(call, xs: list[torch.Tensor], monkeypatch) -> None:
    """`call(x, out=...)` runs x's pass and then a kernel launched beside it (`x_pass_pdl`): captured back to
    back for every x of `xs` in one CUDA graph (whose pool hands each call's pass the buffer the last call's
    kernel read), each output equals the same call launched after the pass, bit for bit, in three replays."""
    linear_module = importlib.import_module("mtpfactory.kernels.linear")   # the package exports the Op
    monkeypatch.setattr(linear_module, "X_PASS_PDL", True)
    if not linear_module.x_pass_pdl(xs[0]):
        pytest.skip("this GPU has no programmatic dependent launch (sm_90 and later)")
    monkeypatch.setattr(linear_module, "X_PASS_PDL", False)
    expected = [call(x) for x in xs]
    monkeypatch.setattr(linear_module, "X_PASS_PDL", True)
    outs = [torch.empty_like(e) for e in expected]
    for x, out in zip(xs, outs):      # compiled outside the capture
        call(x, out=out)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for x, out in zip(xs, outs):
            call(x, out=out)
    for _ in range(3):
        for out in outs:
            out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        for i, (out, e) in enumerate(zip(outs, expected)):
            assert torch.equal(out, e), i


def nvfp4_inputs(m: int, n: int, k: int, dtype: torch.dtype, seed: int = 0, device: str = "cpu"):
    """The NVFP4 tests' inputs: x [M, K] in `dtype`; a Gaussian weight [N, K] whose 16-blocks span 2^12 in
    magnitude (some E4M3 scales subnormal), about one block in eight all zero, quantized to NVFP4."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=gen).to(dtype)
    w = torch.randn(n, k // 16, 16, generator=gen)
    w = w * torch.exp2(-12 * torch.rand(n, k // 16, 1, generator=gen))
    w = (w * (torch.rand(n, k // 16, 1, generator=gen) > 0.125)).view(n, k)
    return (x.to(device), *(t.to(device) for t in quantize_nvfp4(w)))


def x_pass_reference(x: torch.Tensor, k_per_split: int) -> tuple[torch.Tensor, torch.Tensor]:
    """What `_x_f16_pairs_kernel` writes for x [K]: each slice's exponent e (its largest |x| times 2^e in
    [2^11, 2^12), e at most 127) and x * 2^e in fp16, word j's pairs (0, 2), (4, 6), (1, 3), (5, 7) as int32
    (the first element in the low half)."""
    xf = x.float()
    exps = []
    scaled = torch.empty_like(xf)
    for s in range(0, x.numel(), k_per_split):
        amax = xf[s:s + k_per_split].abs().max()
        e = 127 if amax == 0 else min(11 - int(torch.floor(torch.log2(amax))), 127)
        exps.append(e)
        scaled[s:s + k_per_split] = xf[s:s + k_per_split] * 2.0**e
    words = scaled.to(torch.float16).view(-1, 8)[:, [0, 2, 4, 6, 1, 3, 5, 7]].contiguous()   # (lo, hi) pairs
    return torch.tensor(exps, dtype=torch.int32), words.view(torch.int32).view(-1)
