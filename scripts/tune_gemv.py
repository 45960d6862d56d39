"""Tile sweep for the GEMV / small-M GEMM providers on the GPU: which (BLOCK_N, BLOCK_K, warps, stages, K
slices, swapped operands, weight decode) is fastest per format, shape and M. The winners go into the
`TileTable`s of `kernels/linear.py` and `kernels/linear_nvfp4.py` by hand, with the sweep's date.

Timing as `bench_kernels.py` (CUDA-graph replay over weight copies far past the L2, median), shorter runs.
After BF16's grid, its best plan and cuBLAS (`torch.nn.functional.linear`, the target's peer) on the same copies
are timed again in --rounds alternating rounds (the best of many noisy timings is biased low against one), --net
adding their times without do_bench's fixed cost a replay; at M > 1 BF16's grid holds the TMA kernel's tiles
(`TMA_TILES`) and the planner's plan beside the pointer-loaded dot's. The two best plans of a grid are refined
(stages, swapped operands, K slices) under the same x's pass switch as the plan each refines.
It sweeps the Triton kernels only: the Gluon wgmma kernel that NVFP4 runs at M = 2-32 on the LM heads on sm_90
(`GemvPlan.wgmma`) has its own tiles (`gemm_nvfp4_wgmma.py`, swept by `sweep_wgmma.py`) and is switched off here
(`WGMMA = False`), so each grid times its Triton kernel; `clock_watch.py --compare wgmma` sets the two side by side.
A time budget keeps it inside one device call; every result is appended to the JSON file as it comes.

    python3 scripts/tune_gemv.py --json out.json [--budget-s 420] [--shapes lm_head_qwen,q_proj] [--ms 1,32]
        [--rounds 3] [--net]
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import itertools
import json
import math
import statistics
import sys
import time

import torch

from mtpfactory.kernels.linear import TILES_FP8, linear_triton, make_plan, plan_for
from mtpfactory.kernels.linear_fp8 import _linear_fp8_native, linear_fp8_triton
from mtpfactory.kernels.linear_nvfp4 import TILES_NVFP4, _linear_nvfp4_native, linear_nvfp4_triton

linear = importlib.import_module("mtpfactory.kernels.linear")               # the package exports the Ops
linear_nvfp4 = importlib.import_module("mtpfactory.kernels.linear_nvfp4")
sys.path.insert(0, __file__.rsplit("/", 1)[0])
from bench_kernels import (  # noqa: E402
    SHAPES,
    alternating,
    copy_bandwidth,
    copy_bandwidth_net,
    formats,
    max_rel_err,
    net_us,
    replay_us,
    weight_bytes,
)

# format -> (weights key, call(x, w, plan))
FORMATS = {
    "bf16": ("bf16", lambda x, w, p: linear_triton(x, w, plan=p)),
    "fp8": ("fp8", lambda x, w, p: linear_fp8_triton(x, *w, plan=p)),
    "nvfp4": ("nvfp4", lambda x, w, p: linear_nvfp4_triton(x, *w, plan=p)),
}
FMA_TILES = [(2, 1024), (2, 2048), (4, 512), (4, 1024), (4, 2048), (8, 512), (8, 1024), (16, 256), (16, 512),
             (32, 256), (32, 512), (64, 256), (64, 512), (128, 128), (128, 256)]
DOT_TILES = [(16, 256), (32, 128), (32, 256), (64, 64), (64, 128), (64, 256), (128, 64), (128, 128), (256, 64)]
# NVFP4 decodes into registers and loads num_stages - 1 K steps ahead itself
NVFP4_TILES = [(16, 256), (32, 256), (64, 128), (64, 256), (128, 64), (128, 128), (256, 64)]
# the NVFP4 GEMV (M = 1, fp16 block sums): rows per program x K per step (2026-12-03: 128 x 128 and 256 x 128
# 10-40% slower; 32 x 512, 64 x 512 and 8 warps slower than these), 2 or 4 warps, one step ahead; each with
# x paired in the GEMV's programs and by x's own pass (`uses_x_pass`)
NVFP4_GEMV_TILES = [(32, 256), (64, 256), (128, 256)]
# the NVFP4 GEMV of 2 to 8 rows (`_gemv_nvfp4_rows_kernel`): rows per program x K per step
NVFP4_ROWS_TILES = [(16, 256), (32, 256), (64, 256), (32, 128)]
# BF16 on the TMA kernel (`GemvPlan.tma`, sm_90 on): rows, K per step, stages (4 warps). 2026-12-04, 8192 x
# 2048: 64 x 64 at 3-6 stages and 128 x 64 at 3 slower (11.4-17.8 us against 10.8-11.0)
TMA_TILES = [(64, 128, 4), (64, 128, 6), (64, 256, 3), (128, 128, 4)]
# FP8 on the dot path, each in bf16 and in fp16 (x's pass, `F16_DOT_MIN_ELEMENTS`)
FP8_DOT_TILES = [(64, 128), (64, 256), (128, 64), (128, 128)]


def time_us(calls: list, rep_ms: int = 40) -> float:
    """One call's time: `bench_kernels.replay_us` over a graph of the calls, shorter."""
    return replay_us(calls, 5, rep_ms) / len(calls)


def main() -> int:
    linear_nvfp4.WGMMA = False               # the Triton tiles: see the docstring
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", required=True)
    ap.add_argument("--budget-s", type=float, default=420)
    ap.add_argument("--shapes", default="lm_head_qwen,q_proj,fc")
    ap.add_argument("--ms", default="1,32,8")
    ap.add_argument("--formats", default=",".join(FORMATS))
    ap.add_argument("--rounds", type=int, default=3, help="alternating rounds of BF16's best plan against cuBLAS")
    ap.add_argument("--net", action="store_true",
                    help="BF16's best and cuBLAS also without do_bench's fixed cost a replay (bench_kernels --net)")
    args = ap.parse_args()
    if args.rounds < 1:
        ap.error(f"--rounds {args.rounds}: at least 1")
    t_end = time.monotonic() + args.budget_s
    bw = copy_bandwidth()
    bw_net = copy_bandwidth_net() if args.net else None
    print(f"copy bandwidth {bw / 1e12:.3f} TB/s" + ("" if bw_net is None else f", {bw_net / 1e12:.3f} TB/s net"),
          flush=True)
    out = open(args.json, "a")
    for shape in args.shapes.split(","):
        n, k = SHAPES[shape]
        w = formats(n, k)   # bench_kernels.formats: ROTATE_BYTES of each format's own bytes, at least MIN_CALLS copies
        for m in (int(v) for v in args.ms.split(",")):
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            for fname in args.formats.split(","):
                key, call = FORMATS[fname]
                floor_us = (weight_bytes(w[key][0]) + 2 * m * (n + k)) / bw * 1e6
                w0 = w[key][0]
                ref = (torch.nn.functional.linear(x.float(), w0.float()) if key == "bf16" else
                       _linear_fp8_native(x.float(), *w0) if key == "fp8" else _linear_nvfp4_native(x.float(), *w0))
                results = []

                def set_x_pass(x_pass):
                    """x's pass forced on (True) or off (False): the NVFP4 GEMV and fp16 dot, the FP8 dot in fp16;
                    None: as shipped."""
                    setattr(*x_pass_switch[:2], shipped_x_pass if x_pass is None else x_pass_switch[2 if x_pass else 3])

                def run(plan, x_pass=None):
                    if time.monotonic() > t_end:
                        return None
                    set_x_pass(x_pass)
                    try:
                        y = call(x, w0, plan)
                        err = max_rel_err(y, ref)
                        us = time_us([lambda t=t: call(x, t, plan) for t in w[key]])
                    except Exception as e:  # noqa: BLE001  (a tile that does not compile is reported)
                        print(f"  {shape} M={m} {fname} {plan} failed: {type(e).__name__} {str(e)[:80]}")
                        return None
                    rec = dict(shape=shape, n=n, k=k, m=m, format=fname, us=us, floor_us=floor_us,
                               pct=100 * floor_us / us, err=err, plan=plan.__dict__, x_pass=x_pass)
                    if err > 2e-2:
                        print(f"  {shape} M={m} {fname} {plan}: WRONG, max error {err:.3g} of max |y|")
                    out.write(json.dumps(rec) + "\n")
                    out.flush()
                    results.append((us, plan, x_pass))
                    return us

                # (module, switch, its value with x's pass, without)
                x_pass_switch = ((linear_nvfp4, "LM_HEAD_MIN_ELEMENTS", 0, 1 << 62) if fname == "nvfp4" else
                                 (linear, "F16_DOT_MIN_ELEMENTS", 0, 1 << 62))
                shipped_x_pass = getattr(*x_pass_switch[:2])
                grid_x_pass = None
                if fname == "nvfp4" and m == 1:        # the GEMV, x's pass off and on
                    plans = [make_plan(m, n, k, bn, bk, block_m=1, num_warps=nw, num_stages=2)
                             for (bn, bk), nw in itertools.product(NVFP4_GEMV_TILES, (2, 4)) if bk <= k]
                    shipped = linear_nvfp4.default_plan(x, n, k, True)   # the shipped plan, in the same run
                    plans += [shipped] if shipped not in plans else []
                    for p, xp in itertools.product(plans, (False, True)):
                        run(p, xp)
                    grid = []
                elif fname == "fp8" and m > 1:         # the dot in bf16 and in fp16 (x's pass)
                    plans = [make_plan(m, n, k, bn, bk, num_warps=nw, num_stages=3, swap_ab=sw)
                             for (bn, bk), nw, sw in itertools.product(FP8_DOT_TILES, (4, 8), (False, True))]
                    shipped = plan_for(m, n, k, True, TILES_FP8)
                    plans += [shipped] if shipped not in plans else []
                    for p, xp in itertools.product(plans, (False, True)):
                        run(p, xp)
                    grid = []
                elif fname == "nvfp4" and m <= linear_nvfp4.ROWS_KERNEL_MAX:   # the GEMV of several rows
                    bm = 1 << (m - 1).bit_length()
                    grid = [make_plan(m, n, k, bn, bk, block_m=bm, num_warps=nw, num_stages=st)
                            for (bn, bk), nw, st in itertools.product(NVFP4_ROWS_TILES, (2, 4, 8), (1, 2))
                            if bk <= k]
                    grid.append(plan_for(m, n, k, True, TILES_NVFP4))    # the tensor cores' plan, in the same run
                elif fname == "nvfp4":                 # tensor cores: the bf16 dot, then the fp16 dot's grid (x's pass)
                    bf16_dot = plan_for(m, n, k, True, TILES_NVFP4)
                    for st in (2, 3):                  # the bf16 dot on its tiles (one or two steps ahead)
                        run(dataclasses.replace(bf16_dot, num_stages=st), False)
                    shipped = linear_nvfp4.default_plan(x, n, k, True)   # the shipped plan, in the same run
                    grid = [make_plan(m, n, k, bn, bk, num_warps=nw, num_stages=st, swap_ab=bn >= 64)
                            for (bn, bk), nw, st in itertools.product(NVFP4_TILES, (4, 8), (1, 2)) if bk <= k]
                    grid += [shipped] if shipped not in grid else []
                    grid_x_pass = True                 # the fp16 dot on tiles of 32 rows (`uses_f16_dot`; stages 2:
                                                       # one step ahead), the bf16 dot on tiles of 16
                elif m == 1:
                    grid = [make_plan(m, n, k, bn, bk, block_m=1, num_warps=nw, num_stages=2)
                            for (bn, bk), nw in itertools.product(FMA_TILES, (4, 8)) if bk <= k]
                else:
                    swaps = (False, True) if fname != "bf16" else (False,)   # decoded tiles as the dot's A too
                    grid = [make_plan(m, n, k, bn, bk, num_warps=nw, num_stages=3, swap_ab=sw)
                            for (bn, bk), nw, sw in itertools.product(DOT_TILES, (4, 8), swaps)]
                    if fname == "bf16" and linear.tma_refusal(x, w0, False) is None:   # the TMA kernel's tiles
                        grid += [make_plan(m, n, k, bn, bk, num_warps=4, num_stages=st, tma=True)
                                 for bn, bk, st in TMA_TILES]
                        shipped = plan_for(m, n, k, True, tma=True)               # what the planner runs
                        grid += [shipped] if shipped not in grid else []
                for p in grid:
                    run(p, grid_x_pass)
                results.sort(key=lambda r: r[0])
                pointer = [r for r in results if not r[1].tma]
                # refine the two best (stages, swapped operands, K slices), each under its own x's pass switch, so
                # that a refinement runs the same dot as the tile it refines
                for _, p, xp in pointer[:2] if grid else []:
                    d = dict(p.__dict__)
                    for st in ((1, 4) if d["block_m"] > 1 and fname != "nvfp4" else ()):   # NVFP4: in the grid
                        run(make_plan(m, n, k, d["block_n"], d["block_k"], block_m=d["block_m"],
                                      num_warps=d["num_warps"], num_stages=st, swap_ab=d["swap_ab"]), xp)
                    if d["block_m"] >= 16 and not d["swap_ab"]:
                        run(make_plan(m, n, k, d["block_n"], d["block_k"], block_m=d["block_m"],
                                      num_warps=d["num_warps"], num_stages=d["num_stages"], swap_ab=True), xp)
                    if n <= 16384:
                        for sp in (2, 4, 8):
                            run(make_plan(m, n, k, d["block_n"], d["block_k"], splits=sp, block_m=d["block_m"],
                                          num_warps=d["num_warps"], num_stages=d["num_stages"],
                                          swap_ab=d["swap_ab"]), xp)
                results.sort(key=lambda r: r[0])
                for us, p, xp in results[:3]:
                    print(f"{shape:12s} {n}x{k} M={m:<2d} {fname:10s} {us:9.2f} us  floor {floor_us:8.2f} us "
                          f"{100 * floor_us / us:5.1f}%  {p}{'' if xp is None else f' x_pass={xp}'}", flush=True)
                if fname == "bf16" and results:
                    # the peer: the grid's best of many noisy timings is biased low against one timing of cuBLAS,
                    # so the two are timed again in alternating rounds, in the same process
                    _, best, xp = results[0]
                    set_x_pass(xp)
                    pair = {"best": [lambda t=t: call(x, t, best) for t in w[key]],
                            "cuBLAS": [lambda t=t: torch.nn.functional.linear(x, t) for t in w[key]]}
                    times = {v: [] for v in pair}
                    nets = {v: [] for v in pair}
                    for _, order in alternating(pair, args.rounds):
                        for v in order:
                            replay = replay_us(pair[v], 5, 40)
                            times[v].append(replay / len(pair[v]))
                            nets[v].append(net_us(pair[v], replay, 5, 40) if args.net else math.nan)
                    med = {v: statistics.median(ts) for v, ts in times.items()}
                    for v, ts in times.items():
                        rec = dict(shape=shape, n=n, k=k, m=m, format="cublas-bf16" if v == "cuBLAS" else "bf16-best",
                                   us=med[v], us_rounds=ts, floor_us=floor_us, pct=100 * floor_us / med[v],
                                   plan=best.__dict__ if v == "best" else None)
                        line = (f"{shape:12s} {n}x{k} M={m:<2d} {v:10s} {med[v]:9.2f} us  floor {floor_us:8.2f} us "
                                f"{100 * floor_us / med[v]:5.1f}%  ({min(ts):.2f}-{max(ts):.2f} over {args.rounds} "
                                "alternating rounds)")
                        if args.net:
                            net, floor_net = statistics.median(nets[v]), floor_us * bw / bw_net
                            rec.update(net_us=net, floor_net_us=floor_net)
                            line += f"  net {net:9.2f} us, floor {floor_net:8.2f} us {100 * floor_net / net:5.1f}%"
                        out.write(json.dumps(rec) + "\n")
                        print(line + ("" if v == "best" else "  (torch.nn.functional.linear, the same weight copies)"))
                    print(f"{shape:12s} {n}x{k} M={m:<2d} best / cuBLAS {med['best'] / med['cuBLAS']:.3f}", flush=True)
                set_x_pass(None)
                if time.monotonic() > t_end:
                    print("# time budget spent")
                    return 0
            del x
        del w
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
