"""A target for Nsight Compute: one NVFP4 linear call on an LM head, as the heads run it, repeated a few
times so that `ncu --launch-skip` can pass the warm-up and Triton's compiles. On the H200:

    ncu --clock-control none --kernel-name regex:_gemm_nvfp4 --launch-skip 2 --launch-count 1 --set full \
        python3 -P scripts/ncu_gemv.py --m 32

--clock-control none: the device notes say to leave the clocks alone. x is bf16, random, as in
`bench_kernels.py`; the weight is one random BF16 matrix of realistic scale quantized to NVFP4.
"""

from __future__ import annotations

import argparse

import torch

from mtpfactory.kernels.linear_nvfp4 import linear_nvfp4_triton
from mtpfactory.quant import quantize_nvfp4


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--m", type=int, default=32)
    ap.add_argument("--n", type=int, default=151936)
    ap.add_argument("--k", type=int, default=2048)
    ap.add_argument("--calls", type=int, default=4)
    args = ap.parse_args()
    w = quantize_nvfp4(torch.randn(args.n, args.k, device="cuda", dtype=torch.bfloat16) * args.k ** -0.5)
    x = torch.randn(args.m, args.k, device="cuda", dtype=torch.bfloat16)
    for _ in range(args.calls):
        linear_nvfp4_triton(x, *w)
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
