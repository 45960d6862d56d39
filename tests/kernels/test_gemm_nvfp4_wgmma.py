"""The Gluon wgmma kernel for W4A16 NVFP4 at up to 32 rows of 16-bit x (`gemm_nvfp4_wgmma.py`) and the x
order it reads (`dot_order`, x's pass with ORDER).

On the CPU: the order x's pass and the final norm write, against `dot_order` applied to x's pass's reference.
The kernel itself is Gluon, which the interpreter cannot run: it is tested on the GPU (`-m gpu`) against the
reference. Tolerance there as `test_linear_nvfp4.py`: each product E2M1 * 2^-6 * scale * x * 2^e is exact in
fp16 and fp32, summed in fp32 in another order than the reference's, so |out - ref| <= OUT_RTOL * |ref| +
1e-5 * sum|x||w|; a fragment on the wrong K position or row misses by O(sum|x||w|).
"""

from __future__ import annotations

import dataclasses
import importlib

import pytest
import torch

from mtpfactory import ops
from mtpfactory.kernels.gemm_nvfp4_wgmma import ORDER, TILES, WgmmaTile, block_m, dot_order
from mtpfactory.kernels.linear_nvfp4 import (
    WGMMA_MIN_M,
    XPairs,
    default_plan,
    linear_nvfp4_triton,
    planned_x_pairs,
    uses_f16_gemv,
)
from mtpfactory.kernels.rms_norm import rms_norm_triton
from mtpfactory.kernels.rms_norm_linear_nvfp4 import rms_norm_linear_nvfp4
from mtpfactory.quant import dequantize_nvfp4
from gemv_common import F16_SUM_RTOL, SUM_RTOL, assert_matches, nvfp4_inputs, x_pass_reference

linear_nvfp4 = importlib.import_module("mtpfactory.kernels.linear_nvfp4")   # the package exports the Op
_GEMV_ORDER = torch.tensor([0, 4, 1, 5, 2, 6, 3, 7])                        # element e of a word -> its pair slot


def natural_fp16(pairs: torch.Tensor) -> torch.Tensor:
    """x's pass's pairs in the GEMVs' order (int32 [K/2]) -> the scaled x as fp16 in K's own order."""
    words = pairs.view(torch.float16).view(-1, 8)
    return words[:, _GEMV_ORDER].reshape(-1)


@pytest.mark.parametrize("k,bk", [(128, 128), (384, 128), (512, 256), (4096, 256)])
def test_dot_order_permutes_each_k_tile(k, bk):
    perm = dot_order(k, bk)
    assert torch.equal(perm.view(-1, bk).sort(dim=1).values, torch.arange(k).view(-1, bk))
    # a pair of adjacent dot positions (the wgmma fragment's 32-bit register) is one decode register's pair
    assert torch.equal(perm[1::2] - perm[0::2], torch.full((k // 2,), 2))


@pytest.mark.parametrize("k,bk", [(384, 128), (512, 256)])
def test_x_pass_writes_dot_order(k, bk):
    m = 3
    x = torch.randn(m, k, dtype=torch.bfloat16) * torch.tensor([1.0, 2.0**-20, 2.0**9]).view(m, 1).to(torch.bfloat16)
    pairs = torch.full((m, k // 2), -1, dtype=torch.int32)
    exps = torch.full((m, 1), -1, dtype=torch.int32)
    linear_nvfp4._x_f16_pairs_kernel[(1, m)](x, pairs, exps, k, k, x.stride(0), x.stride(1),
                                             BLOCK=linear_nvfp4.x_scan_block(k), USE_ASM=False, PDL=False, ORDER=bk)
    perm = dot_order(k, bk)
    for row in range(m):
        e, ref = x_pass_reference(x[row], k)
        assert int(exps[row, 0]) == int(e[0])
        assert torch.equal(pairs[row].view(torch.float16), natural_fp16(ref)[perm])


def test_norm_writes_dot_order():
    m, k, bk = 2, 256, 128
    x = torch.randn(m, k, dtype=torch.bfloat16)
    w = torch.randn(k, dtype=torch.bfloat16)
    made = XPairs.empty(m, k, k, x.device, order=bk)
    made.pairs.fill_(-1)
    y = rms_norm_triton(x, w, 1e-6, False, x_pairs=made)
    for row in range(m):
        e, ref = x_pass_reference(y[row], k)
        assert int(made.exps[row, 0]) == int(e[0])
        assert torch.equal(made.pairs[row].view(torch.float16), natural_fp16(ref)[dot_order(k, bk)])


def test_pairs_of_another_order_are_refused():
    made = XPairs.empty(2, 256, 256, torch.device("cpu"), order=128)
    with pytest.raises(ValueError, match=r"order 128.*order 0"):
        made.check(2, 256, 256, torch.device("cpu"))
    bad = XPairs.empty(2, 384, 384, torch.device("cpu"), order=256)
    bad.pairs.fill_(7)
    y = torch.full((2, 384), 5.0, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"x_pairs: order 256 for rows of H = 384"):
        rms_norm_triton(torch.ones(2, 384, dtype=torch.bfloat16), torch.ones(384, dtype=torch.bfloat16), 1e-6, False,
                        out=y, x_pairs=bad)
    assert bool((bad.pairs == 7).all()) and bool((y == 5.0).all())


def test_tiles_it_cannot_run_are_refused():
    with pytest.raises(ValueError, match=r"bk a multiple of 256"):
        WgmmaTile(bk=128)
    with pytest.raises(ValueError, match=r"16 rows a warp"):
        WgmmaTile(bn=128, warps=4)
    with pytest.raises(ValueError, match=r"warps a multiple of 4"):
        WgmmaTile(bn=32, warps=2)
    with pytest.raises(ValueError, match=r"2 stages or more"):
        WgmmaTile(stages=1)
    with pytest.raises(ValueError, match=r"2 or 4 parts"):
        WgmmaTile(parts=1)
    with pytest.raises(ValueError, match=r"maxnreg a multiple of 8 from 24 up"):
        WgmmaTile(maxnreg=60)
    assert [(t.maxnreg, t.consumer_regs) for t in TILES.values()] == [(48, 72), (48, 72), (56, 72)]
    assert [block_m(m) for m in (1, 8, 9, 16, 17, 32)] == [8, 8, 16, 16, 32, 32]


def _sass_stats(*args: str) -> dict:
    """scripts/sass_stats.py nvfp4-wgmma ARGS --json, in a process of its own: Triton's interpreter, once it has
    run in a process, leaves a patched builder behind that breaks Gluon compiles there (cold cache only: it
    failed the old in-process version of the register test now and then)."""
    import json
    import os
    import pathlib
    import subprocess
    import sys
    script = pathlib.Path(__file__).resolve().parents[2] / "scripts" / "sass_stats.py"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, str(script), "nvfp4-wgmma", *args, "--json"],
                         capture_output=True, text=True, env=env, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout)


@pytest.mark.parametrize("bm", [8, 16, 32])
def test_planned_tiles_fit_their_registers_without_spilling_or_serializing(bm):
    """Each planned tile's registers are its choice (`WgmmaTile.maxnreg`: 3 programs of 12 warps an SM at 32 rows,
    5 of 8 at 8 and 16), and nothing in the source keeps the consumers inside the 72 that leaves them: a
    scheduler that hoisted a part's decode above the last part's wgmma would spill, or ptxas would wait on each
    wgmma on its own (at 72 registers the 32-row tile did both in two parts). So scripts/sass_stats.py compiles
    the tiles for sm_90 (Triton's own ptxas, no GPU). Checked: no local memory (the stack frame included, where
    this kernel's spills go), the launch and setmaxnreg counts the tile's, and one wgmma batch (an arrive and a
    wait) a part in the K loop."""
    t = TILES[bm]
    got = _sass_stats("--tile", f"{bm},{t.bn},{t.bk}")
    assert (got["registers"], got["local_bytes"], got["setmaxnreg"]) == (t.maxnreg, 0, [24, t.consumer_regs]), got
    assert got["loop"]["HGMMA"] == t.bk // 16 and got["loop"]["WARPGROUP"] == 2 * t.parts, got["loop"]


def test_register_check_sees_a_spill():
    """The check above can fail: the 32-row tile in two parts at the same 72 consumer registers spills and
    serializes its wgmmas. Its spill lands in the stack frame, which cuobjdump counts apart from LOCAL (LOCAL is
    0 here), so this also checks that sass_stats counts both."""
    got = _sass_stats("--tile", f"32,{TILES[32].bn},{TILES[32].bk}", "--parts", "2")
    assert got["local_bytes"] > 0 and got["loop"]["STL"] > 0, got
    assert got["loop"]["WARPGROUP"] > 2 * 2, got["loop"]


def test_wgmma_refuses_k_and_operands_its_tma_cannot_read():
    """K off the kernel's multiple, and x, words or scales TMA cannot read (a start off a 16-byte boundary, rows
    not 16-byte multiples apart): refused before the launch, naming the tensor and the fix; `out` untouched."""
    from mtpfactory.kernels.gemm_nvfp4_wgmma import gemm_nvfp4_wgmma
    x16, exps = torch.zeros(2, 512, dtype=torch.float16), torch.zeros(2, 1, dtype=torch.int32)
    words, scales = torch.zeros(4, 64, dtype=torch.int32), torch.zeros(4, 32, dtype=torch.uint8)
    out = torch.full((2, 4), 3.0)
    with pytest.raises(ValueError, match=r"K = 768.*a multiple of 512"):
        gemm_nvfp4_wgmma(torch.zeros(2, 768, dtype=torch.float16), exps, torch.zeros(4, 96, dtype=torch.int32),
                         torch.zeros(4, 48, dtype=torch.uint8), torch.ones(1), out, False)
    for off in (1, 4):                                                   # contiguous, `off` bytes past 16
        bad = torch.zeros(4 * 32 + 16, dtype=torch.uint8)[off:off + 4 * 32].view(4, 32)
        with pytest.raises(ValueError, match=rf"weight_scale starts {off} bytes past a 16-byte boundary.*"
                                             r"weight_scale.clone\(\)"):
            gemm_nvfp4_wgmma(x16, exps, words, bad, torch.ones(1), out, False)
    shifted_x = torch.zeros(2 * 512 + 8, dtype=torch.float16)[1:1 + 2 * 512].view(2, 512)   # 2 bytes past 16
    with pytest.raises(ValueError, match=r"x starts 2 bytes past a 16-byte boundary.*x.clone\(\)"):
        gemm_nvfp4_wgmma(shifted_x, exps, words, scales, torch.ones(1), out, False)
    wide = torch.zeros(4, 65, dtype=torch.int32)[:, :64]                # rows 260 bytes apart
    with pytest.raises(ValueError, match=r"weight starts 0 bytes .*\(rows 260 bytes apart\)"):
        gemm_nvfp4_wgmma(x16, exps, wide, scales, torch.ones(1), out, False)
    assert bool((out == 3.0).all())


def test_a_planned_wgmma_call_on_weights_tma_cannot_read_plans_again_without_it(monkeypatch):
    """A planned wgmma call (forced here: the planner gives it only on sm_90) on a weight 4 bytes past a
    16-byte boundary, which the Triton kernels read and TMA cannot, runs the plan made without it; unless
    x_pairs were made in the kernel's order, which is refused with the reason, writing nothing."""
    n, k, m = 64, 512, 4
    x, weight, scale, scale_2 = nvfp4_inputs(m, n, k, torch.bfloat16, seed=3)
    shifted = torch.empty(weight.numel() + 16, dtype=torch.uint8)[4:4 + weight.numel()].view_as(weight)
    shifted.copy_(weight)
    planner = linear_nvfp4.default_plan
    monkeypatch.setattr(linear_nvfp4, "default_plan", lambda x, n, k, split_k, wgmma=True: dataclasses.replace(
        planner(x, n, k, split_k), wgmma=wgmma))
    w = dequantize_nvfp4(weight, scale, scale_2)
    out = linear_nvfp4_triton(x, shifted, scale, scale_2)
    fallback = default_plan(x, n, k, False, wgmma=False)            # on the CPU the bf16 dot: its bound
    assert_matches(out, (x.float() @ w.T).to(x.dtype), x.float().abs() @ w.abs().T,
                   sum_rtol=F16_SUM_RTOL if uses_f16_gemv(x, fallback) else SUM_RTOL)
    made = XPairs.empty(m, k, k, x.device, ORDER)
    out = torch.full((m, n), 3.0, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"x_pairs: made in the wgmma kernel's order \(256\), which cannot run "
                                         r"here: weight starts 4 bytes past a 16-byte boundary"):
        linear_nvfp4_triton(x, shifted, scale, scale_2, out=out, x_pairs=made)
    assert bool((out == 3.0).all())


@pytest.mark.parametrize("m", [4, 8])
def test_the_fused_op_plans_its_pairs_for_a_weight_tma_cannot_read(m, monkeypatch):
    """The final norm's pairs (`rms_norm_linear_nvfp4`) are planned for the weight the GEMV then reads: on a
    forced wgmma plan and a weight 4 bytes past a 16-byte boundary, in the order of the Triton kernel that runs
    instead (the GEMV of several rows at M = 4 on an LM head's plan) or none (the bf16 dot at M = 8), not the
    wgmma kernel's, which the GEMV would refuse. The op's predicate accepts the call and it runs, equal to the
    two Triton providers in turn."""
    monkeypatch.setattr(linear_nvfp4, "LM_HEAD_MIN_ELEMENTS", 0)
    n, k = 64, 512
    x, weight, scale, scale_2 = nvfp4_inputs(m, n, k, torch.bfloat16, seed=m)
    shifted = torch.empty(weight.numel() + 16, dtype=torch.uint8)[4:4 + weight.numel()].view_as(weight)
    shifted.copy_(weight)
    planner = linear_nvfp4.default_plan
    monkeypatch.setattr(linear_nvfp4, "default_plan", lambda x, n, k, split_k, wgmma=True: dataclasses.replace(
        planner(x, n, k, split_k), wgmma=wgmma))
    assert planned_x_pairs(x, n, k, True).order == ORDER                 # a weight TMA can read
    made = planned_x_pairs(x, n, k, True, shifted, scale)
    assert (None if made is None else made.order) == (0 if m == 4 else None)
    norm_w = (0.5 * torch.randn(k, generator=torch.Generator().manual_seed(m))).to(torch.bfloat16)
    args = (x, norm_w, 1e-6, True, shifted, scale, scale_2)
    with ops.use_backend("triton"):
        assert rms_norm_linear_nvfp4.providers["triton"].supports(*args)
        logits, y = rms_norm_linear_nvfp4(*args)
        assert torch.equal(y, rms_norm_triton(x, norm_w, 1e-6, True))
        assert torch.equal(logits, linear_nvfp4_triton(y, shifted, scale, scale_2, split_k=True))


def test_planned_pairs_carry_the_order_of_the_kernel_that_reads_them(monkeypatch):
    """`planned_x_pairs` (what the final norm fills) takes the plan's K slices and the order of the kernel the
    call runs: the GEMVs' on the CPU, the wgmma kernel's K tile where it runs (forced here); none for fp32 x."""
    n, k = 151936, 2048
    x = torch.randn(32, k, dtype=torch.bfloat16)
    plan = default_plan(x, n, k, True)
    made = planned_x_pairs(x, n, k, True)
    assert (made.order, made.k_per_split) == (0, plan.k_per_split)
    assert planned_x_pairs(x.float(), n, k, True) is None
    monkeypatch.setattr(linear_nvfp4, "default_plan", lambda *args: dataclasses.replace(plan, wgmma=True))
    made = planned_x_pairs(x, n, k, True)
    assert (made.order, made.k_per_split) == (ORDER, plan.k_per_split)


def test_no_wgmma_off_the_gpu():
    x = torch.randn(32, 2048, dtype=torch.bfloat16)
    assert not default_plan(x, 151936, 2048, False).wgmma


def test_the_planner_gives_the_lm_heads_wgmma_from_its_first_row_count():
    """On sm_90 (given here), 16-bit x on the LM heads: the wgmma kernel from WGMMA_MIN_M to 32 rows, K a
    multiple of 512; the Triton kernels elsewhere."""
    n = 151936
    for m in range(1, 33):
        for k in (2048, 4096, 768):
            plan = linear_nvfp4._default_plan(m, n, k, True, True, True)
            assert plan.wgmma == (m >= WGMMA_MIN_M and k != 768), (m, k)
            assert not linear_nvfp4._default_plan(m, n, k, True, True, False).wgmma      # not sm_90, or WGMMA off


def test_a_wgmma_plan_off_the_gpu_is_refused_and_writes_nothing():
    n, k = 64, 512
    x = torch.randn(4, k, dtype=torch.bfloat16)
    weight, scale, scale_2 = (torch.zeros(n, k // 2, dtype=torch.uint8), torch.ones(n, k // 16).to(torch.float8_e4m3fn),
                              torch.ones(()))
    plan = dataclasses.replace(default_plan(x, n, k, False), wgmma=True)
    out = torch.full((4, n), 3.0, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"plan: wgmma = True, but x on cpu: the kernel needs an sm_90 GPU"):
        linear_nvfp4_triton(x, weight, scale, scale_2, out=out, plan=plan)
    assert bool((out == 3.0).all())


# --- GPU ---------------------------------------------------------------------------------------------------

def _sm90() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


def run_wgmma(x: torch.Tensor, weight, scale, scale_2, out_dtype, tile: WgmmaTile | None = None,
              out: torch.Tensor | None = None):
    """The wgmma kernel alone on x's pass of x, into `out` (of out_dtype) or a poisoned [M, N] of out_dtype."""
    from mtpfactory.kernels.gemm_nvfp4_wgmma import gemm_nvfp4_wgmma
    m, k = x.shape
    made = XPairs.empty(m, k, k, x.device, ORDER).fill(x)
    if out is None:
        out = torch.full((m, weight.shape[0]), float("nan"), dtype=out_dtype, device=x.device)
    gemm_nvfp4_wgmma(made.pairs.view(torch.float16), made.exps, weight.view(torch.int32), scale.view(torch.uint8),
                     scale_2.reshape(1), out, False, tile)
    return out


@pytest.mark.gpu
@pytest.mark.skipif(not _sm90(), reason="needs an sm_90 GPU (wgmma)")
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("m", [1, 9, 17, 32])
@pytest.mark.parametrize("n,k", [(1000, 1536), (130, 4096), (64, 512), (129, 2048)])
def test_gpu_wgmma_matches_reference(m, n, k, out_dtype):
    """N off the tile (and under it), M below it (8, 16 and 32 rows a program), K of 2 to 16 steps (the ring's
    refills past the end reload the last step), rows of x past M zero-filled."""
    x, weight, scale, scale_2 = nvfp4_inputs(m, n, k, torch.bfloat16, seed=m + n, device="cuda")
    out = run_wgmma(x, weight, scale, scale_2, out_dtype)
    w = dequantize_nvfp4(weight, scale, scale_2)
    assert_matches(out, (x.float() @ w.T).to(out_dtype), x.float().abs() @ w.abs().T, sum_rtol=SUM_RTOL)


@pytest.mark.gpu
@pytest.mark.skipif(not _sm90(), reason="needs an sm_90 GPU (wgmma)")
@pytest.mark.parametrize("m", [3, 9, 17])
def test_gpu_wgmma_writes_no_row_past_m(m):
    """out the first M rows of a poisoned [M + 1, N] buffer, M under the program's 8, 16 or 32 rows: the tile's
    row M (x's zero-filled row past M, which would store 0) is stored nowhere, so the buffer's last row stays
    NaN, and rows 0 .. M - 1 match the reference."""
    n, k = 129, 512
    x, weight, scale, scale_2 = nvfp4_inputs(m, n, k, torch.bfloat16, seed=m, device="cuda")
    buf = torch.full((m + 1, n), float("nan"), dtype=torch.float32, device="cuda")
    run_wgmma(x, weight, scale, scale_2, torch.float32, out=buf[:m])
    w = dequantize_nvfp4(weight, scale, scale_2)
    assert_matches(buf[:m], x.float() @ w.T, x.float().abs() @ w.abs().T, sum_rtol=SUM_RTOL)
    assert bool(buf[m].isnan().all())


_TILES = {"one-warpgroup-ring-of-4": WgmmaTile(bn=64, warps=4, stages=4, parts=2, maxnreg=48),
          "four-warpgroups": WgmmaTile(bn=256, warps=16, stages=2, parts=4, maxnreg=64),
          "ring-of-3": WgmmaTile(stages=3), "two-parts-80-registers": WgmmaTile(stages=2, parts=2, maxnreg=64),
          "four-parts-one-warpgroup": WgmmaTile(bn=64, warps=4, stages=2, parts=4, maxnreg=48)}


@pytest.mark.gpu
@pytest.mark.skipif(not _sm90(), reason="needs an sm_90 GPU (wgmma)")
@pytest.mark.parametrize("tile", list(_TILES))
@pytest.mark.parametrize("m", [5, 16, 32])
@pytest.mark.parametrize("n,k", [(1000, 1536), (129, 2048)])
def test_gpu_wgmma_tiles_match_reference(tile, m, n, k):
    """Tiles of one and four consumer warpgroups a program, rings deeper than the planner's (4, 3), and K steps
    in two parts and in four where the planner runs the other (two at 80 consumer registers), at 8, 16 and 32
    rows a program; fp32 out, poisoned."""
    x, weight, scale, scale_2 = nvfp4_inputs(m, n, k, torch.bfloat16, seed=m + n + 7, device="cuda")
    out = run_wgmma(x, weight, scale, scale_2, torch.float32, _TILES[tile])
    w = dequantize_nvfp4(weight, scale, scale_2)
    assert_matches(out, x.float() @ w.T, x.float().abs() @ w.abs().T, sum_rtol=SUM_RTOL)


@pytest.mark.gpu
@pytest.mark.skipif(not _sm90(), reason="needs an sm_90 GPU (wgmma)")
@pytest.mark.parametrize("m", [2, 4, 5, 16, 17, 32])
def test_gpu_linear_runs_wgmma_on_lm_head_plans(m, monkeypatch):
    """linear_nvfp4_triton runs the wgmma kernel on the LM heads' plans of 2 to 32 rows and matches the
    reference within 1e-5 * sum|x||w|, as the Triton kernels (the GEMV of several rows, the bf16 and the fp16
    dot) do with it switched off (WGMMA = False; the GEMV of several rows sums in fp16, its bound 2^-8)."""
    monkeypatch.setattr(linear_nvfp4, "LM_HEAD_MIN_ELEMENTS", 0)
    n, k = 4096, 2048
    x, weight, scale, scale_2 = nvfp4_inputs(m, n, k, torch.bfloat16, seed=m, device="cuda")
    assert default_plan(x, n, k, False).wgmma                   # one K slice (split_k=True would split it here)
    w = dequantize_nvfp4(weight, scale, scale_2)
    ref, abs_sum = (x.float() @ w.T).to(x.dtype), x.float().abs() @ w.abs().T
    for on in (True, False):
        monkeypatch.setattr(linear_nvfp4, "WGMMA", on)
        plan = default_plan(x, n, k, False)
        assert plan.wgmma == on
        out = torch.full((m, n), float("nan"), dtype=x.dtype, device="cuda")
        linear_nvfp4_triton(x, weight, scale, scale_2, out=out)
        assert_matches(out, ref, abs_sum, sum_rtol=F16_SUM_RTOL if uses_f16_gemv(x, plan) else SUM_RTOL)


@pytest.mark.gpu
@pytest.mark.skipif(not _sm90(), reason="needs an sm_90 GPU (wgmma)")
def test_gpu_a_weight_view_tma_cannot_read_runs_without_wgmma(monkeypatch):
    """A weight 4 bytes past a 16-byte boundary (valid for the Triton kernels, not for TMA) on an LM-head plan
    of 32 rows: the planned call runs without the wgmma kernel and matches; a forced wgmma plan is refused."""
    monkeypatch.setattr(linear_nvfp4, "LM_HEAD_MIN_ELEMENTS", 0)
    m, n, k = 32, 1024, 2048
    x, weight, scale, scale_2 = nvfp4_inputs(m, n, k, torch.bfloat16, seed=11, device="cuda")
    shifted = torch.empty(weight.numel() + 16, dtype=torch.uint8, device="cuda")[4:4 + weight.numel()].view_as(weight)
    shifted.copy_(weight)
    plan = default_plan(x, n, k, False)
    assert plan.wgmma
    w = dequantize_nvfp4(weight, scale, scale_2)
    out = torch.full((m, n), float("nan"), dtype=x.dtype, device="cuda")
    linear_nvfp4_triton(x, shifted, scale, scale_2, out=out)
    assert_matches(out, (x.float() @ w.T).to(x.dtype), x.float().abs() @ w.abs().T, sum_rtol=SUM_RTOL)
    with pytest.raises(ValueError, match=r"plan: wgmma = True, but weight starts 4 bytes past a 16-byte boundary"):
        linear_nvfp4_triton(x, shifted, scale, scale_2, plan=plan)
