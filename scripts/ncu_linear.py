"""One GEMV / small-M GEMM call at a real shape, for Nsight Compute on the GPU machine: a warm-up call,
then the call to profile (ncu's --launch-skip counts the warm-up's kernels). Weights are random, in the
format's checkpoint layout; the planned tiles are used unless --tile overrides them.

On the device (after `GPU_TESTS=0 BENCH=0 bash scripts/device_run.sh` installed the package into /tmp/site):

    PYTHONPATH=/tmp/site ncu --clock-control none -k regex:_gemm_nvfp4 --launch-skip 1 --launch-count 1 \\
        --section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats \\
        --section SchedulerStats --section MemoryWorkloadAnalysis \\
        python3 -P scripts/ncu_linear.py --format nvfp4 --shape lm_head_qwen --m 32

--peer FILE profiles another version of the wgmma kernel's module instead (a scratch file, as
`sweep_wgmma.py --peer` times one), at its own tile for M, on x's pass made beforehand, launched as the planner
launches the kernel (`sweep_wgmma.wgmma_call`: a programmatic dependent launch where `x_pass_pdl` allows).
"""

from __future__ import annotations

import argparse
import sys

import torch

from mtpfactory.kernels.linear import linear_triton, make_plan
from mtpfactory.kernels.linear_fp8 import linear_fp8_triton
from mtpfactory.kernels.linear_nvfp4 import linear_nvfp4_triton

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from bench_kernels import SHAPES, formats  # noqa: E402
from sass_stats import load_peer  # noqa: E402
from sweep_wgmma import wgmma_call  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--format", choices=("bf16", "fp8", "nvfp4"), default="nvfp4")
    ap.add_argument("--shape", choices=sorted(SHAPES), default="lm_head_qwen")
    ap.add_argument("--m", type=int, default=32)
    ap.add_argument("--tile", default=None, help="BLOCK_M,BLOCK_N,BLOCK_K,num_stages (default: the planned tiles)")
    ap.add_argument("--peer", default=None, help="another version of the wgmma kernel's module (nvfp4, M >= 2)")
    args = ap.parse_args()
    if args.peer and (args.format != "nvfp4" or args.tile or args.m < 2):
        ap.error("--peer profiles the NVFP4 wgmma kernel's peer at its own tile: --format nvfp4, M >= 2, no --tile")
    n, k = SHAPES[args.shape]
    w = formats(n, k, rotate_bytes=0, min_copies=1)[args.format][0]
    x = torch.randn(args.m, k, device="cuda", dtype=torch.bfloat16)
    plan = None
    if args.tile:
        bm, bn, bk, st = (int(v) for v in args.tile.split(","))
        plan = make_plan(args.m, n, k, bn, bk, block_m=bm, num_stages=st, swap_ab=bm > 1 and bn >= 64)
    call = {"bf16": lambda: linear_triton(x, w, plan=plan),
            "fp8": lambda: linear_fp8_triton(x, *w, plan=plan),
            "nvfp4": lambda: linear_nvfp4_triton(x, *w, plan=plan)}[args.format]
    if args.peer:
        peer = load_peer(args.peer)
        out = torch.empty(args.m, n, device="cuda", dtype=torch.bfloat16)
        call = wgmma_call(x, w, peer.TILES[peer.block_m(args.m)], out, peer.gemm_nvfp4_wgmma)
    call()
    torch.cuda.synchronize()
    call()
    torch.cuda.synchronize()
    return 0


if __name__ == "__main__":
    sys.exit(main())
