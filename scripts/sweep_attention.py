"""Paged decode attention's tuning on the GPU: context splits, tokens a tile, warps, the dots' dtype and the pipeline's
depth (`paged_decode_attention_triton`'s num_splits, block_n, num_warps, fast_dot and num_stages) at bench_ops.py's
Qwen3-Next shapes (16 q / 2 KV heads x 256, context 4096, the output gate; BF16 KV, FP8 with unit and with
per-token scales), each call on its own blocks; each figure beside its floor (K and V of the contexts over the
copy bandwidth), the default tuning's (the op's) in the same rounds, and its error against the reference.

    python3 scripts/sweep_attention.py [--batches 1,8,32] [--splits 0,16,32,64,128] [--block-n 16,64]
        [--warps 4] [--fast-dot 0] [--stages 0] [--kv bf16,fp8,fp8_scaled] [--context 4096] [--rounds 3]
        (splits 0 and stages 0: the defaults, `_default_tuning`: Triton's 3 stages, or 1 for some FP8 grids;
        fast_dot's default is 1 for an FP8 cache, 0 otherwise; every combination is timed)
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_kernels import alternating, copy_bandwidth, graph_time_us, max_rel_err  # noqa: E402
from bench_ops import KV_FORMATS, attention_setups  # noqa: E402

from mtpfactory.kernels.paged_attention import paged_decode_attention, paged_decode_attention_triton  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--splits", default="0,16,32,64,128")
    ap.add_argument("--block-n", default="16,64")
    ap.add_argument("--warps", default="4")
    ap.add_argument("--fast-dot", default="0", help="0, 1 or 0,1: the dots in fp32 (tf32), or fast (_dot_dtype)")
    ap.add_argument("--stages", default="0", help="software pipeline depths; 0: the default (_default_tuning)")
    ap.add_argument("--kv", default=",".join(KV_FORMATS), help=f"KV formats, of {', '.join(KV_FORMATS)}")
    ap.add_argument("--context", type=int, default=None,
                    help="tokens a sequence, a multiple of 16 (default: bench_ops.py's 4096); 16 calls of B sequences "
                         "each hold their own blocks, so B 32 at 16384 is 8.6 GB of FP8 K and V")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    if args.context is not None and (args.context < 16 or args.context % 16):
        ap.error(f"--context {args.context}: a positive multiple of the 16-token block")
    kvs = tuple(args.kv.split(","))
    if unknown := set(kvs) - set(KV_FORMATS):
        ap.error(f"--kv {args.kv}: {', '.join(sorted(unknown))} unknown; the formats are {', '.join(KV_FORMATS)}")
    bw = copy_bandwidth()
    print(f"device {torch.cuda.get_device_name()}, copy bandwidth {bw / 1e12:.3f} TB/s (read + write)", flush=True)
    ints = lambda v: [int(x) for x in v.split(",")]  # noqa: E731
    variants = [(s or None, bn, w, bool(f), st or None) for s in ints(args.splits) for bn in ints(args.block_n)
                for w in ints(args.warps) for f in ints(args.fast_dot) for st in ints(args.stages)]
    batches = [int(v) for v in args.batches.split(",")]
    for name, b, floor_bytes, operands in attention_setups(batches, kvs, args.context):
        want = paged_decode_attention.reference(*operands[0])
        calls, errs = {}, {}
        for v in variants:
            s, bn, w, f, st = v
            calls[v] = [lambda a=a, s=s, bn=bn, w=w, f=f, st=st: paged_decode_attention_triton(
                *a, num_splits=s, block_n=bn, num_warps=w, fast_dot=f, num_stages=st) for a in operands]
            errs[v] = max_rel_err(calls[v][0](), want)
        times = {v: [] for v in calls}
        for _, order in alternating(list(calls), args.rounds):
            for v in order:
                times[v].append(graph_time_us(calls[v])[0])
        floor = floor_bytes / bw * 1e6
        for v, ts in times.items():
            s, bn, w, f, st = v
            us = statistics.median(ts)
            print(f"{name} B={b:<3d} splits {'default' if s is None else s:>7} block_n {bn:3d} warps {w:2d} "
                  f"{'fast' if f else 'fp32'} stages {'-' if st is None else st}  {us:8.2f} us "
                  f"({min(ts):.2f}-{max(ts):.2f})  floor {floor:7.2f} us {100 * floor / us:5.1f}%  "
                  f"err {errs[v]:.1e}", flush=True)
        del calls, times, operands, want   # so the next batch's caches are built in the memory these held
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
