"""Where paged decode attention's large groups go wrong on the GPU: the kernel (`paged_decode_attention_launch`,
past the provider's refusal of groups over 32 on 16-bit and FP8 caches) against the reference, for each group,
head dim, cache dtype, dot dtype, tile, pipeline depth and split count asked; one line a case with its largest
error relative to the reference's largest output, or the compile error. Correctness only, nothing is timed.

    python3 scripts/probe_attention_groups.py [--groups 32,64,128] [--dims 128,256,512] [--kv bf16,fp8]
        [--fast-dot 0,1] [--warps 4,8] [--block-n 16] [--stages 0] [--splits 1]
        (stages 0: the default, `_default_tuning`'s: Triton's 3, but for an FP8 cache 1 at these groups' tiles
        (not `_WAVE_TILES`); splits 0: the default)
"""

from __future__ import annotations

import argparse
import itertools

import torch
import triton

from mtpfactory.kernels.paged_attention import paged_decode_attention, paged_decode_attention_launch


def main() -> int:
    ap = argparse.ArgumentParser()
    ints = lambda v: [int(x) for x in v.split(",")]  # noqa: E731
    ap.add_argument("--groups", type=ints, default=ints("32,64,128"))
    ap.add_argument("--dims", type=ints, default=ints("128,256,512"))
    ap.add_argument("--kv", default="bf16,fp8")
    ap.add_argument("--fast-dot", type=ints, default=ints("0,1"))
    ap.add_argument("--warps", type=ints, default=ints("4,8"))
    ap.add_argument("--block-n", type=ints, default=ints("16"))
    ap.add_argument("--stages", type=ints, default=ints("0"))
    ap.add_argument("--splits", type=ints, default=ints("1"))
    ap.add_argument("--tol", type=float, default=2e-2, help="the error that marks a case BAD")
    args = ap.parse_args()
    kv_dtypes = {"bf16": torch.bfloat16, "fp8": torch.float8_e4m3fn}
    print(f"device {torch.cuda.get_device_name()}, triton {triton.__version__}, torch {torch.__version__}")
    bad = 0
    for group, d, kv in itertools.product(args.groups, args.dims, args.kv.split(",")):
        gen = torch.Generator(device="cuda").manual_seed(0)
        b, hkv, bs, ctx = 2, 1, 16, 300
        blocks = b * triton.cdiv(ctx, bs)
        q = torch.randn(b, group * hkv, d, device="cuda", generator=gen).bfloat16()
        k, v = (torch.randn(blocks, bs, hkv, d, device="cuda", generator=gen).to(kv_dtypes[kv]) for _ in range(2))
        tables = torch.arange(blocks, device="cuda", dtype=torch.int32).view(b, -1)
        lens = torch.full((b,), ctx, device="cuda", dtype=torch.int32)
        want = paged_decode_attention.reference(q, k, v, tables, lens, d ** -0.5).float()
        for fast, w, bn, st, sp in itertools.product(args.fast_dot, args.warps, args.block_n, args.stages,
                                                     args.splits):
            case = f"group {group:3d} D {d:3d} {kv:4s} fast_dot {fast} warps {w} block_n {bn:3d} stages {st or '-'} " \
                   f"splits {sp or 'default'}"
            out = torch.full_like(q, float("nan"))
            try:
                paged_decode_attention_launch(q, k, v, tables, lens, d ** -0.5, out=out, num_splits=sp or None,
                                              block_n=bn, num_warps=w, fast_dot=bool(fast),
                                              num_stages=st or None)
                torch.cuda.synchronize()
            except Exception as e:  # a compile or launch failure is a finding, not the end of the probe
                print(f"{case}: FAILED {type(e).__name__}: {str(e).splitlines()[0][:120]}", flush=True)
                continue
            err = ((out.float() - want).abs().max() / want.abs().max()).item()
            bad += not err <= args.tol
            print(f"{case}: err {err:.2e}{'' if err <= args.tol else '  BAD'}", flush=True)
    print(f"{bad} bad")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
