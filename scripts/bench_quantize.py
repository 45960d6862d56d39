"""Time the NVFP4 and FP8 quantize ops (Triton provider vs the PyTorch reference) on the GPU.

    python scripts/bench_quantize.py [--n 151936] [--k 2048]

Prints ms per call and the bandwidth the Triton provider reaches counting one read of the input and
one write of the outputs (the ideal traffic), so a second pass over the input shows up as lost GB/s.
"""

from __future__ import annotations

import argparse

import torch
from triton.testing import do_bench

from mtpfactory import ops
from mtpfactory.kernels.quantize_fp8 import divides_by_reciprocal, quantize_fp8
from mtpfactory.kernels.quantize_nvfp4 import quantize_nvfp4


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=151936)
    ap.add_argument("--k", type=int, default=2048)
    args = ap.parse_args()
    n, k = args.n, args.k
    print(f"{torch.cuda.get_device_name()}; torch divides by a Python float via the reciprocal on cuda: "
          f"{divides_by_reciprocal('cuda')}")
    for dtype in (torch.bfloat16, torch.float32):
        w = torch.randn(n, k, device="cuda", dtype=dtype) * 0.02
        for name, op, out_bytes in (("nvfp4", quantize_nvfp4, n * k // 2 + n * k // 16 + 4),
                                    ("fp8", quantize_fp8, n * k + 4 * n)):
            ideal = w.numel() * w.element_size() + out_bytes
            for backend in ("triton", "native"):
                with ops.use_backend(backend):
                    ms = do_bench(lambda: op(w), warmup=5, rep=50)
                print(f"{name:6s} {str(dtype).removeprefix('torch.'):9s} [{n}, {k}] {backend:7s} {ms:8.3f} ms"
                      f"  {ideal / ms / 1e6:7.0f} GB/s (ideal traffic)")


if __name__ == "__main__":
    main()
